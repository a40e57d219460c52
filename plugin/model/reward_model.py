"""Reward models: a `[online] reward_funcs` entry that is a folder holding a Hugging Face sequence-classification
checkpoint (TRL's reward models), scored on torchtitan's own llama3 or qwen3 model with a score head.

1. Start-up (`RewardModel.__init__`, at the first builder that loads the reward functions): config.json must name
   `LlamaForSequenceClassification`, `Qwen3ForSequenceClassification` or `Qwen3MoeForSequenceClassification` with
   one label, the safetensors must hold `score.weight`, and the folder a tokenizer.json; a conversational prompt
   file needs its chat template (`check_prompts`). Each failure names the entry.
2. Build, at the first scoring (the policy and its parallel layout exist by then): torchtitan's model of the
   family, sized by config.json, on the meta device, its LM head replaced by `score` = Linear(dim, 1), then
   torchtitan's parallelize function of the family, as the reference is: FSDP, TP (the trunk's plan; the score
   head is left out of it, so its weight and output are whole on every rank), EP. Frozen; in the run's dtype
   (FSDP's mixed precision, else the training forward's autocast); with `[reference_model] offload` its weights
   visit the device only while it scores.
3. Load: the family's state-dict adapter and DCP's HF reader, as `[reference_model] checkpoint_path` loads an HF
   folder; `score.weight` passes through under its own name.
4. Score (`rewards`): what TRL feeds its reward models, in padding-free rows of at most
   `[online] reward_model_max_token_len` tokens, each completion's score the score head at its last token.
   - Conversational prompts: the reward model's chat template renders prompt + completion messages (a tool
     trajectory's messages included), no generation prompt; plain text prompts: prompt + completion text.
     The text is encoded by the reward model's tokenizer, with nothing added (TRL's add_special_tokens=False).
   - Where the reward model's tokenizer.json and chat template are the policy's, the ids are the ones the policy
     read and sampled (prompt ids, then the completion's, tool turns included), no decode/encode round trip;
     after a chat completion the template's closing text (ChatML's "<|im_end|>\n") follows, as in the render.
     They equal the round trip's ids wherever re-encoding the sampled text gives back the sampled ids (a
     tokenizer's own split; a sampler may draw another split of the same text) and, for plain text, where the
     prompt ids have no BOS the text encoding lacks.
   - TP peers hold the same completions and score them together; each data-parallel rank scores its own.
     FSDP's all-gathers and EP's all-to-alls span the data-parallel ranks, so every rank runs as many forwards
     as the busiest one (padding rows where it has no more).
"""

import json
import struct
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import maybe_enable_amp
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from plugin import cpu
from plugin.data.batch import packed_positions
from plugin.data.chat import ChatTemplate
from plugin.data.rollouts import BadRow
from plugin.model.policy import FAMILIES, GRPOModel
from plugin.model.reference import load_reference_checkpoint, offloaded
from plugin.runtime import internals

# config.json's architecture -> the torchtitan family that runs it
ARCHITECTURES = {"LlamaForSequenceClassification": "llama3", "Qwen3ForSequenceClassification": "qwen3",
                 "Qwen3MoeForSequenceClassification": "qwen3"}
SCORE = "score.weight"  # the head's name in transformers' checkpoints
HEAD = "reward_head.weight"  # its name here (GRPOModel has a score method)


class RewardModelError(ValueError):
    """A reward model entry that cannot be used: names the entry and what is wrong."""


class ScoreModel(GRPOModel):
    """Mixin over torchtitan's model class: the trunk and final norm, then `reward_head` (dim -> 1, the checkpoint's
    `score`) in place of the LM head.

    It reuses the GRPO model's trunk (padding-free attention, the length hooks of compiled blocks); `output` is
    None, as torchtitan's pipeline stages have it, so its TP plan entry and FSDP group are skipped.
    """

    def __init__(self, model_args):
        super().__init__(model_args)
        self.output = None
        self.reward_head = nn.Linear(model_args.dim, 1, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """[n] fp32 scores at flat indices `last` of a packed [1, T] row with its `positions`."""
        h = self.norm(self.trunk(tokens, positions=positions))
        if isinstance(h, DTensor):  # sequence-sharded under TP: the rows' last tokens may be on any rank
            h = h.full_tensor()
        return self.reward_head(h.flatten(0, 1)[last]).float()[:, 0]

    def init_weights(self, *args, **kwargs):
        super().init_weights(*args, **kwargs)
        nn.init.zeros_(self.reward_head.weight)  # the checkpoint's replaces it


_SCORE_CLASSES: dict[type, type] = {}


def score_model_cls(base: type[nn.Module], family: str) -> type[nn.Module]:
    """ScoreModel over torchtitan's model class `base` of a FAMILIES family, made once per base."""
    if base not in _SCORE_CLASSES:
        _SCORE_CLASSES[base] = type(f"Score{base.__name__}", (ScoreModel, base), {"rope_buffer": FAMILIES[family]})
    return _SCORE_CLASSES[base]


class _ScoreHeadAdapter:
    """The family's state-dict adapter for the trunk; the score head's weight under its own name both ways."""

    def __init__(self, inner):
        self.inner = inner

    def to_hf(self, state_dict: dict) -> dict:
        rest = {k: v for k, v in state_dict.items() if k != HEAD}
        return {**self.inner.to_hf(rest), SCORE: state_dict[HEAD]}

    def from_hf(self, hf_state_dict: dict) -> dict:
        rest = {k: v for k, v in hf_state_dict.items() if k != SCORE}
        return {**self.inner.from_hf(rest), HEAD: hf_state_dict[SCORE]}

    def get_hf_storage_reader(self, path: str):
        return self.inner.get_hf_storage_reader(path)


def _safetensors_names(folder: Path) -> set[str]:
    """The tensor names of a folder's safetensors files, read from their headers."""
    names = set()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            names |= set(json.loads(fh.read(n))) - {"__metadata__"}
    return names


def _rope_theta(config: dict, default: float) -> float:
    params = config.get("rope_parameters") or {}
    return float(config.get("rope_theta", params.get("rope_theta", default)))


def _rope_scaling(config: dict) -> dict | None:
    """The checkpoint's RoPE scaling, transformers 4's rope_scaling or 5's rope_parameters; None: plain RoPE."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind in (None, "default") else {**scaling, "rope_type": kind}


def model_args(config: dict, family: str, key: str):
    """torchtitan's model args of `family` for an HF config.json; RewardModelError for what the family cannot run."""
    def need(condition: bool, what: str):
        if not condition:
            raise RewardModelError(f"{key}: {what}, which torchtitan's {family} cannot run")

    need(not config.get("attention_bias") and not config.get("mlp_bias"), "config.json has attention or MLP biases")
    need(config.get("hidden_act", "silu") == "silu", f"config.json's hidden_act is {config.get('hidden_act')!r}")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    common = dict(dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
                  vocab_size=config["vocab_size"], max_seq_len=config.get("max_position_embeddings", 4096))
    spec = get_train_spec(f"grpo_{family}")
    if family == "llama3":
        from torchtitan.models.llama3.model.args import RoPEScalingArgs

        need(config.get("head_dim", dim // n_heads) == dim // n_heads,
             f"config.json's head_dim {config.get('head_dim')} is not hidden_size / num_attention_heads")
        scaling = _rope_scaling(config)
        need(scaling is None or scaling["rope_type"] == "llama3",
             f"its RoPE scaling is {scaling and scaling['rope_type']!r}")
        rope = RoPEScalingArgs(scaling_factor=1.0) if scaling is None else RoPEScalingArgs(
            scaling_factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"])
        # torchtitan derives the FFN width: multiple_of rounds int(8 * dim / 3) * ffn_dim_multiplier up to it
        width, derived = config["intermediate_size"], int(2 * 4 * dim / 3)
        return replace(spec.model_args["smollm2_135m"], **common, norm_eps=config.get("rms_norm_eps", 1e-5),
                       rope_theta=_rope_theta(config, 10000.0), rope_scaling_args=rope, multiple_of=width,
                       ffn_dim_multiplier=None if derived <= width else width / derived, enable_weight_tying=False)
    need(_rope_scaling(config) is None, "its RoPE is scaled")
    args = dict(common, head_dim=config.get("head_dim") or dim // n_heads, norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=_rope_theta(config, 1e6), enable_weight_tying=False)
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 4's name, 5's
    if not experts:
        return replace(spec.model_args["debugmodel"], **args, hidden_dim=config["intermediate_size"], moe_enabled=False)
    need(config.get("decoder_sparse_step", 1) == 1 and not config.get("mlp_only_layers"),
         "some of its layers are dense (decoder_sparse_step, mlp_only_layers): torchtitan's qwen3 makes every layer "
         "a mixture of experts")
    base = spec.model_args["debugmodel_moe"]
    moe = replace(base.moe_args, num_experts=experts, top_k=config["num_experts_per_tok"],
                  route_norm=bool(config.get("norm_topk_prob", True)), load_balance_coeff=None,
                  # torchtitan's grouped matmuls compute in bf16; its for-loop in the run's dtype
                  use_grouped_mm=not cpu.is_active())
    return replace(base, **args, moe_enabled=True, moe_inter_dim=config["moe_intermediate_size"], moe_args=moe)


class RewardModel:
    """One reward model entry: checked at start-up, built and loaded at its first scoring, shared by training's
    and evaluation's reward lists (GRPOJob.reward_model)."""

    def __init__(self, folder: str, key: str, job_config):
        self.folder, self.key, self.job_config = folder, key, job_config
        path = Path(folder)
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RewardModelError(f"{key}: the folder has no readable config.json ({e}); a reward model is a "
                                   "sequence-classification checkpoint saved by transformers") from None
        arch = (config.get("architectures") or ["(none)"])[0]
        if arch not in ARCHITECTURES:
            raise RewardModelError(f"{key}: config.json's architecture {arch} is not one this plugin scores with; "
                                   f"a reward model is one of {', '.join(ARCHITECTURES)}")
        labels = config.get("num_labels", len(config.get("id2label") or {"0": ""}))
        if labels != 1:
            raise RewardModelError(f"{key}: the checkpoint has {labels} labels; a reward model has one "
                                   "(num_labels = 1), its score the reward")
        names = _safetensors_names(path)
        if not names:
            raise RewardModelError(f"{key}: the folder has no .safetensors weights")
        if SCORE not in names:
            raise RewardModelError(f"{key}: the weights have no score head ('{SCORE}'); is this a "
                                   f"*ForSequenceClassification checkpoint? (a causal LM's head is 'lm_head.weight')")
        if not (path / "tokenizer.json").is_file():
            raise RewardModelError(f"{key}: the folder has no tokenizer.json; the reward model's own tokenizer "
                                   "encodes what it scores")
        self.family = ARCHITECTURES[arch]
        self.args = model_args(config, self.family, key)
        tp = job_config.parallelism.tensor_parallel_degree
        if self.args.n_heads % tp or self.args.n_kv_heads % tp:
            raise RewardModelError(f"{key}: [parallelism] tensor_parallel_degree = {tp} does not divide its "
                                   f"{self.args.n_heads} attention heads and {self.args.n_kv_heads} KV heads")
        from torchtitan.components.tokenizer import HuggingFaceTokenizer

        self.tokenizer = HuggingFaceTokenizer(folder)
        if self.tokenizer.get_vocab_size() > self.args.vocab_size:
            raise RewardModelError(f"{key}: its tokenizer has {self.tokenizer.get_vocab_size()} tokens, its "
                                   f"embedding {self.args.vocab_size}")
        self.chat = ChatTemplate.from_folder(folder)
        self.chat.origin = f"{key}: the chat template"
        policy = Path(job_config.model.hf_assets_path)
        self.shares_tokenizer = _same_file(path / "tokenizer.json", policy / "tokenizer.json") and \
            _same_template(self.chat, ChatTemplate.from_folder(str(policy), job_config.rollout_data.chat_template_path))
        self.max_tokens = job_config.online.reward_model_max_token_len
        self.module: nn.Module | None = None  # built at the first scoring, with what follows
        self.device, self._tp, self.offload, self.weights_bytes = None, 1, False, 0
        logger.info(f"{key}: a reward model, {arch} ({self.args.n_layers} layers of {self.args.dim}), checked; "
                    "it is built and loaded at its first scoring, "
                    + ("reading the ids the policy sampled (it shares the policy's tokenizer and chat template)"
                       if self.shares_tokenizer else "reading the decoded text with its own tokenizer"))

    def check_prompts(self, prompts, key: str) -> None:
        """Start-up: conversational prompts need the reward model's chat template."""
        if self.chat.source is None and any(isinstance(p.text, list) for p in prompts):
            raise RewardModelError(f"{self.key}: {key} has conversational prompts (message lists), which the reward "
                                   "model reads rendered by its own chat template, and its folder has none (no "
                                   "'chat_template' in tokenizer_config.json, no chat_template.jinja)")

    # -- what it reads

    def inputs(self, prompts, completions: list, completion_ids: list[list[int]],
               stop_ids: list[int]) -> list[list[int]]:
        """Each completion's ids as the reward model reads them (the module's doc, 4)."""
        out = []
        for p, c, ids in zip(prompts, completions, completion_ids):
            try:
                if self.shares_tokenizer:
                    stopped = bool(ids) and ids[-1] in stop_ids
                    if isinstance(p.text, list):  # the template writes the end of the turn, a truncated one's too
                        seq = list(p.ids) + list(ids) + ([] if stopped else stop_ids[:1])
                        seq += self.tokenizer.encode(self._closing(p.text, c, seq[-1]), add_bos=False, add_eos=False)
                    else:  # TRL's text leaves the stop token out
                        seq = list(p.ids) + list(ids[:-1] if stopped else ids)
                elif isinstance(p.text, list):
                    text = self.chat.render(p.text + c, name="prompt + completion", add_generation_prompt=False)
                    seq = self.tokenizer.encode(text, add_bos=False, add_eos=False)
                else:
                    seq = self.tokenizer.encode(p.text + c, add_bos=False, add_eos=False)
            except BadRow as e:
                raise RewardModelError(f"{self.key}: the completion of the prompt at {p.where}: {e}") from None
            if not seq:
                raise RewardModelError(f"{self.key}: the prompt at {p.where} and its completion encode to no tokens")
            if len(seq) > self.args.max_seq_len:
                raise RewardModelError(
                    f"{self.key}: the prompt at {p.where} with its completion is {len(seq)} tokens, past the reward "
                    f"model's max_position_embeddings ({self.args.max_seq_len}); nothing is truncated")
            out.append(seq)
        return out

    def _closing(self, prompt: list[dict], completion: list[dict], stop_id: int) -> str:
        """The chat template's text after the completion's last stop token ("\\n" in ChatML)."""
        text = self.chat.render(prompt + completion, name="prompt + completion", add_generation_prompt=False)
        stop = self.tokenizer.decode([stop_id], skip_special_tokens=False)
        cut = text.rfind(stop)
        return text[cut + len(stop):] if cut != -1 else ""

    # -- scoring

    @torch.no_grad()
    def rewards(self, prompts, completions: list, completion_ids: list[list[int]], stop_ids: list[int]) -> list[float]:
        """One score per completion; every rank calls it (the module's doc, 4), with no completions too."""
        module, job = self._module(), self._job()
        device, pd = self.device, job.parallel_dims
        failure, seqs = None, []
        try:
            seqs = self.inputs(prompts, completions, completion_ids, list(stop_ids) or [0])
        except RewardModelError as e:
            failure = e
        chunks = _chunks([len(s) for s in seqs], self.max_tokens)
        if dist.is_initialized() and dist.get_world_size() > 1 and (pd.fsdp_enabled or pd.ep_enabled):
            # FSDP's gathers and EP's all-to-alls run in every forward: as many forwards on every rank, and a rank
            # that cannot score stops its peers too, rather than leaving them in a collective
            agreed = torch.tensor([len(chunks), failure is not None], device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            if failure is None and agreed[1]:
                raise RewardModelError(f"{self.key}: another rank's completions cannot be scored (its log says why)")
            chunks += [[]] * (int(agreed[0]) - len(chunks))
        if failure is not None:
            raise failure
        amp = maybe_enable_amp(pd, self.job_config.training.mixed_precision_param, device.type)
        scores = [0.0] * len(seqs)
        with offloaded(module, device, self.offload), amp:
            for chunk in chunks:
                row = packed_row([seqs[i] for i in chunk] or [[0]], self._tp)
                values = module(*(t.to(device) for t in row)).tolist()
                for i, v in zip(chunk, values):
                    scores[i] = v
        internals.end_forward_only_iteration(module)  # no backward follows: FSDP's records of the forwards go
        return scores

    def _job(self):
        from plugin.job import GRPOJob

        return GRPOJob.of(self.job_config)

    def _module(self) -> nn.Module:
        if self.module is None:
            self.module = self._build()
        return self.module

    def _build(self) -> nn.Module:
        job, jc = self._job(), self.job_config
        policy, parallel_dims = job.policy, job.parallel_dims
        self.device = next(policy.parameters()).device
        self._tp = parallel_dims.tp if parallel_dims.tp_enabled else 1
        base = get_train_spec(self.family)
        with torch.device("meta"):
            module = score_model_cls(base.model_cls, self.family)(self.args)
        with warnings.catch_warnings():  # the plan's "output" entry: the score head is no LM head
            warnings.filterwarnings("ignore", message="Parallelize plan key 'output'")
            module = base.parallelize_fn(module, parallel_dims, jc)
        cpu.prepare_parallelized(module)
        module.requires_grad_(False)
        module.eval()
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(True)  # no backward follows: free each gathered group right away
        from plugin.scoring.logprobs import Scoring

        module.configure(Scoring(), padding_free=True)
        self.offload = jc.reference_model.offload and not cpu.is_active()
        module.to_empty(device=self.device)
        with torch.no_grad():
            module.init_weights()
        adapter = _ScoreHeadAdapter(get_train_spec(f"grpo_{self.family}").state_dict_adapter(self.args, self.folder))
        load_reference_checkpoint(module, self.folder, "hf", adapter)
        if self.offload:
            module.to("cpu")
        self.weights_bytes = sum(_local(p).numel() * _local(p).element_size() for p in module.parameters())
        logger.info(f"{self.key}: reward model {self.family} ({sum(p.numel() for p in module.parameters()):,} "
                    f"parameters, {self.weights_bytes / 2**20:.1f} MiB on this rank) loaded from {self.folder}")
        return module


def packed_row(seqs: list[list[int]], multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`seqs` as ScoreModel.forward's input: one [1, T] row of them end to end (T a multiple of `multiple`, the TP
    degree, which sequence parallelism shards it by), its positions, and each sequence's last index."""
    lens = torch.tensor([len(s) for s in seqs])
    width = -(-int(lens.sum()) // multiple) * multiple
    tokens = torch.zeros(1, width, dtype=torch.long)
    tokens[0, : int(lens.sum())] = torch.tensor([t for s in seqs for t in s])
    return tokens, packed_positions(lens, width), torch.cumsum(lens, 0) - 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive sequences, each chunk at most `budget` tokens (a longer sequence alone)."""
    chunks, tokens = [], 0
    for i, n in enumerate(lengths):
        if not chunks or tokens + n > budget:
            chunks.append([])
            tokens = 0
        chunks[-1].append(i)
        tokens += n
    return chunks


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def _same_template(a: ChatTemplate, b: ChatTemplate) -> bool:
    return a.source == b.source and a.special_tokens == b.special_tokens
