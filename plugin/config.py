"""The [grpo] and [reference_model] TOML sections (`[job] custom_config_module = "plugin.config"`)."""

import math
from dataclasses import dataclass, field
from pathlib import Path

from . import cpu

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon")
ADVANTAGE_NORMS = ("group_std", "batch_std", "none")
ROLLOUT_FORMATS = ("auto", "jsonl", "parquet")
ROLLOUT_ON_ERROR = ("raise", "skip")
REFERENCE_FORMATS = ("auto", "dcp", "hf")


@dataclass
class GRPO:
    clip_low: float = 0.2
    """Lower clip of the importance ratio: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""

    clip_high: float = 0.2
    """Upper clip of the importance ratio (DAPO's clip-higher uses a larger value than clip_low)."""

    dual_clip: float = 0.0
    """Dual-clip bound c > 1: for negative advantages a token's policy loss is at most -c * A; 0 turns it off."""

    behavior_ratio_cap: float = 0.0
    """With behaviour log-probs in the rollouts, the importance ratio is truncated at this value; 0 = no cap."""

    entropy_coef: float = 0.0
    """Entropy bonus: entropy_coef * per-token entropy is subtracted from the loss."""

    beta: float = 0.04
    """Weight of the per-token KL penalty to the frozen reference model."""

    kl_estimator: str = "k3"
    """KL estimator per token: k1 = l - l_ref, k2 = (l - l_ref)^2 / 2, k3 = exp(l_ref - l) - (l_ref - l) - 1."""

    loss_aggregation: str = "token_mean"
    """token_mean, seq_mean_token_mean, seq_mean_token_sum or fixed_horizon (Dr. GRPO: token sum / (completions * horizon))."""

    horizon: int = 0
    """The max completion length that fixed_horizon divides by; 0 = [training] seq_len."""

    advantage_norm: str = "group_std"
    """Advantage = reward - group mean, divided by the group's std (group_std), the batch's std (batch_std) or nothing (none)."""

    advantage_eps: float = 1e-4
    """Added to the std before dividing, so groups with equal rewards get zero advantage, not NaN."""

    group_size: int = 0
    """Completions per prompt; 0 infers it from the rollout file (every group must then have the same size)."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts: logits are divided by it before log-probs are taken."""

    logprob_chunk_size: int = 0
    """Sequence positions scored per chunk through the output layer; 0 scores the whole sequence at once."""


@dataclass
class ReferenceModel:
    compile: bool = False
    """torch.compile the reference model's log-prob computation (the policy's follows [compile] components 'loss')."""

    checkpoint_path: str = ""
    """Start the reference from this checkpoint (a DCP step folder or an HF *.safetensors folder); "" = the policy's initial weights."""

    checkpoint_format: str = "auto"
    """Format of checkpoint_path: dcp, hf, or auto (a .metadata file means dcp, *.safetensors files mean hf)."""

    sync_steps: int = 0
    """Every sync_steps optimizer steps, reference <- sync_alpha * policy + (1 - sync_alpha) * reference; 0 = never."""

    sync_alpha: float = 0.6
    """The policy's weight in a reference sync, in (0, 1]; 1 copies the policy."""

    offload: bool = False
    """Keep the reference's weights in CPU memory between its forward passes (no effect when training on CPU)."""


@dataclass
class RolloutData:
    format: str = "auto"
    """Rollout file format: jsonl, parquet, or auto (from [training] dataset_path's suffix: .jsonl/.json/.ndjson, .parquet/.pq)."""

    on_error: str = "raise"
    """A bad row stops the run with an error naming file, line and field (raise), or its group is left out and counted (skip)."""

    chat_template: str = ""
    """Python format string a text prompt is put in before tokenizing, e.g. "User: {prompt}\\nAssistant:"; "" = the prompt as is."""


@dataclass
class JobConfig:
    grpo: GRPO = field(default_factory=GRPO)
    reference_model: ReferenceModel = field(default_factory=ReferenceModel)
    rollout_data: RolloutData = field(default_factory=RolloutData)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"[{key.split('.')[0]}] {key.split('.')[1]} = {value!r} is not one of {list(choices)}")


def reference_checkpoint_format(path: str, fmt: str = "auto") -> str:
    """'dcp' or 'hf': the format of [reference_model] checkpoint_path, checked against the folder's contents."""
    key = f"[reference_model] checkpoint_path = {path!r}"
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key} does not exist or is not a folder")
    found = {"dcp": (folder / ".metadata").is_file(), "hf": any(folder.glob("*.safetensors"))}
    if fmt == "auto":
        if found["dcp"] == found["hf"]:
            what = "holds both .metadata and *.safetensors" if found["dcp"] else "holds neither a DCP .metadata file nor *.safetensors files"
            raise ValueError(f"{key} {what}; set [reference_model] checkpoint_format to 'dcp' or 'hf'")
        return "dcp" if found["dcp"] else "hf"
    if not found[fmt]:
        expected = ".metadata file" if fmt == "dcp" else "*.safetensors files"
        raise ValueError(f"{key} has no {expected}, as [reference_model] checkpoint_format = {fmt!r} requires")
    return fmt


def validate(job_config) -> None:
    """Reject a bad [grpo]/[reference_model] value or an unsupported parallelism at start-up."""
    g = job_config.grpo
    _choice("grpo.kl_estimator", g.kl_estimator, KL_ESTIMATORS)
    _choice("grpo.loss_aggregation", g.loss_aggregation, LOSS_AGGREGATIONS)
    _choice("grpo.advantage_norm", g.advantage_norm, ADVANTAGE_NORMS)
    if not 0 <= g.clip_low < 1:
        raise ValueError(f"[grpo] clip_low = {g.clip_low} must be in [0, 1): the ratio's lower bound is 1 - clip_low")
    if not g.clip_high >= 0:
        raise ValueError(f"[grpo] clip_high = {g.clip_high} must be >= 0")
    if not (g.beta >= 0 and math.isfinite(g.beta)):
        raise ValueError(f"[grpo] beta = {g.beta} must be a finite number >= 0")
    if not g.advantage_eps > 0:
        raise ValueError(f"[grpo] advantage_eps = {g.advantage_eps} must be > 0")
    if not g.temperature > 0:
        raise ValueError(f"[grpo] temperature = {g.temperature} must be > 0")
    if g.group_size < 0 or g.group_size == 1:
        raise ValueError(f"[grpo] group_size = {g.group_size} must be 0 (infer) or >= 2: GRPO compares completions within a group")
    if g.dual_clip != 0 and not g.dual_clip > 1:
        raise ValueError(f"[grpo] dual_clip = {g.dual_clip} must be 0 (off) or > 1")
    if g.behavior_ratio_cap != 0 and not g.behavior_ratio_cap >= 1:
        raise ValueError(f"[grpo] behavior_ratio_cap = {g.behavior_ratio_cap} must be 0 (off) or >= 1")
    if g.entropy_coef < 0:
        raise ValueError(f"[grpo] entropy_coef = {g.entropy_coef} must be >= 0")
    if g.horizon < 0:
        raise ValueError(f"[grpo] horizon = {g.horizon} must be >= 0 (0 = [training] seq_len)")
    if g.logprob_chunk_size < 0:
        raise ValueError(f"[grpo] logprob_chunk_size = {g.logprob_chunk_size} must be >= 0 (0 = no chunking)")

    r = job_config.reference_model
    _choice("reference_model.checkpoint_format", r.checkpoint_format, REFERENCE_FORMATS)
    if r.checkpoint_path:
        reference_checkpoint_format(r.checkpoint_path, r.checkpoint_format)
    if r.sync_steps < 0:
        raise ValueError(f"[reference_model] sync_steps = {r.sync_steps} must be >= 0 (0 = never)")
    if r.sync_steps > 0 and not 0 < r.sync_alpha <= 1:
        raise ValueError(
            f"[reference_model] sync_alpha = {r.sync_alpha} must be in (0, 1] when "
            f"[reference_model] sync_steps = {r.sync_steps}: reference <- alpha * policy + (1 - alpha) * reference"
        )

    d = job_config.rollout_data
    _choice("rollout_data.format", d.format, ROLLOUT_FORMATS)
    _choice("rollout_data.on_error", d.on_error, ROLLOUT_ON_ERROR)
    if d.chat_template:
        try:  # the prompt must show up in the result; another field or a stray brace raises
            uses_prompt = d.chat_template.format(prompt="\0") != d.chat_template.format(prompt="")
        except (KeyError, IndexError, ValueError, AttributeError):
            uses_prompt = False
        if not uses_prompt:
            raise ValueError(
                f"[rollout_data] chat_template = {d.chat_template!r} must be a format string whose one field is "
                "{prompt} (write a literal brace as {{ or }})"
            )

    p = job_config.parallelism
    if p.pipeline_parallel_degree > 1:
        raise ValueError(
            f"[parallelism] pipeline_parallel_degree = {p.pipeline_parallel_degree}: pipeline parallelism "
            "is not supported by the GRPO models yet; use tensor_parallel_degree and data_parallel_shard_degree"
        )
    if p.context_parallel_degree > 1:
        raise ValueError(
            f"[parallelism] context_parallel_degree = {p.context_parallel_degree}: context parallelism "
            "is not supported by the GRPO models yet"
        )
    tp = p.tensor_parallel_degree
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if cpu.is_active() and tp > 1 and compile_model and job_config.activation_checkpoint.mode != "none":
        # seen with torch 2.13 on CPU: AOTAutograd saves a DeviceMesh for backward and asserts
        raise ValueError(
            f"[activation_checkpoint] mode = {job_config.activation_checkpoint.mode!r} with [compile] "
            f"components 'model' and [parallelism] tensor_parallel_degree = {tp} fails on CPU "
            "(torch 2.13): set [activation_checkpoint] mode = \"none\""
        )
    if tp > 1 and g.logprob_chunk_size % tp:
        raise ValueError(
            f"[grpo] logprob_chunk_size = {g.logprob_chunk_size} must be a multiple of "
            f"[parallelism] tensor_parallel_degree = {tp}: each rank scores its sequence shard in chunks"
        )
