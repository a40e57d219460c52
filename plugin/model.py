"""Policy + frozen reference model, scored through one log-prob path, and their parallelize function.

The reference is a deep copy of the policy's (meta-device) module, parallelized by the same
torchtitan parallelize function on the same TP/FSDP mesh. It is kept out of the policy's
module tree, so torchtitan's optimizer, grad-norm clipping, FSDP gradient reduction and
checkpoint/export of `model_parts` only ever see the policy.

The reference's lifecycle:
1. start-up: at the first forward, i.e. after torchtitan's checkpoint load, it takes the
   policy's weights or loads [reference_model] checkpoint_path; a resumed full checkpoint
   restores it instead (it is saved with the optimizer state, see _ReferenceInTrainingState);
2. sync: an optimizer step post-hook moves it toward the policy every sync_steps steps;
3. offload: with [reference_model] offload it lives in CPU memory outside its forward.
"""

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from . import cpu
from .config import reference_checkpoint_format, validate
from .logprobs import chunked_logprobs, isolate_compile_cache
from .metrics import GRPOStats


@dataclass
class PolicyOutput:
    """What the model hands to the loss: per-token log-probs and the batch's per-completion data."""

    logprobs: torch.Tensor  # [B, T] fp32, requires grad
    entropy: torch.Tensor  # [B, T] fp32; carries a gradient only with an entropy bonus
    ref_logprobs: torch.Tensor | None  # [B, T] fp32; None when beta = 0
    old_logprobs: torch.Tensor | None  # [B, T] behaviour log-probs, NaN where unknown; None: on-policy
    advantages: torch.Tensor | None  # [B]
    rewards: torch.Tensor | None  # [B]
    loss_weights: torch.Tensor | None  # [B], see data.loss_weights
    stats: GRPOStats | None


@dataclass
class ScoringConfig:
    temperature: float = 1.0
    chunk_size: int = 0  # global sequence positions per chunk; 0 = whole sequence
    seq_shards: int = 1  # ranks the trunk output is sequence-sharded over (TP degree)
    compile: bool = False
    entropy_grad: bool = False  # the entropy bonus needs its gradient
    head_reshard_after_forward: bool = False  # the FSDP policy of the head's group, see head_comms_once


@dataclass
class ReferenceConfig:
    """Where the reference's start-up weights come from, and how it is synced and stored."""

    checkpoint_path: str = ""  # "" = the policy's initial weights
    checkpoint_format: str = ""  # "dcp" or "hf", resolved at start-up
    sd_adapter: Any = None  # the TrainSpec's state-dict adapter, to read HF checkpoints
    sync_steps: int = 0
    sync_alpha: float = 1.0
    offload: bool = False  # False on CPU, where there is nothing to offload to


def _grpo_forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, rollouts=None, **kwargs):
    """Logits when called without labels (torchtitan's own use); PolicyOutput with them."""
    if labels is None:
        return self._base_cls.forward(self, tokens, **kwargs)
    rollouts = rollouts.to(tokens.device) if rollouts is not None else None
    ref_logprobs = None
    if self.reference is not None:
        if self._reference_stale:
            with reference_on_device(self, tokens.device):
                self.init_reference()
        # the offload's transfers count toward the pass's time and peak memory
        with torch.no_grad(), self.grpo_stats.reference_pass(tokens.device), reference_on_device(self, tokens.device):
            ref_logprobs = self.reference(tokens, labels=labels, **kwargs).logprobs
            end_forward_only_iteration(self.reference)
    logprobs, entropy = self.score(tokens, labels, **kwargs)
    if rollouts is None:  # the reference's own call: only log-probs are asked for
        return PolicyOutput(logprobs, entropy, None, None, None, None, None, None)
    return PolicyOutput(
        logprobs, entropy, ref_logprobs, rollouts.old_logprobs, rollouts.advantages, rollouts.rewards,
        rollouts.loss_weights, self.grpo_stats,
    )


def end_forward_only_iteration(module: nn.Module) -> None:
    """Reset an FSDP root's per-iteration records after a forward that no backward follows.

    FSDP2 appends every group's forward to a post-forward order list that only the root's
    post-backward callback clears; for the reference, which never runs backward, it would grow
    by one entry per group per pass.
    """
    if not isinstance(module, FSDPModule):
        return
    if hasattr(module, "reset_iter_state"):  # torch >= 2.13: also reshards and resets the training states
        module.reset_iter_state()
        return
    state = module._get_fsdp_state()
    state._comm_ctx.post_forward_order.clear()
    for other in state._state_ctx.all_states:
        # torch < 2.13 has one group per state (`_fsdp_param_group`)
        for group in getattr(other, "_fsdp_param_groups", None) or [other._fsdp_param_group]:
            if group is not None:
                group._post_forward_indices.clear()


def _hidden_states(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    """The trunk's output before the final norm; sequence-sharded [B, T/TP, D] under TP."""
    saved = self._modules["norm"], self._modules["output"]
    # torchtitan's forward passes through absent layers (its pipeline-stage convention)
    self._modules["norm"] = self._modules["output"] = None
    try:
        return self._base_cls.forward(self, tokens, **kwargs)
    finally:
        self._modules["norm"], self._modules["output"] = saved


def _score(self, tokens: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log-probs of `labels` and entropies under this model."""
    cfg = self.scoring
    hidden = self._hidden_states(tokens, **kwargs)
    with head_comms_once(self, chunked=cfg.chunk_size > 0) as head:
        return chunked_logprobs(
            hidden,
            labels,
            head,
            temperature=cfg.temperature,
            chunk_size=cfg.chunk_size,
            seq_shards=cfg.seq_shards,
            compiled=cfg.compile,
            entropy_grad=cfg.entropy_grad,
        )


class _HeadSyncOnBackward(torch.autograd.Function):
    """Identity on the first chunk's logits whose backward turns the head's gradient sync back on.

    It runs before that chunk's head backward, so before the chunk's FSDP post-backward, which
    is the last one of the head's (chunks run backward last to first): that post-backward
    reduce-scatters the gradient of all chunks at once. In any other order each later
    post-backward still reduce-scatters, so gradients are never left unreduced.
    """

    @staticmethod
    def forward(ctx, logits, group):
        ctx.group = group
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        ctx.group.set_requires_gradient_sync(True, recurse=False)
        ctx.group.set_reshard_after_backward(True, recurse=False)
        return grad, None


@contextmanager
def head_comms_once(model: nn.Module, chunked: bool):
    """The head (final norm + output layer) to score chunks with, all-gathered and reduce-scattered once.

    torchtitan gives [norm, output] (with tied weights also the embedding) one FSDP group.
    Called once per chunk, the group would reshard after every chunk's forward (the
    reference) or post-backward (the policy), and all-gather again for the next chunk's
    forward or recompute, with one reduce-scatter per chunk: here it stays gathered over the
    chunks, and the chunks' gradients are reduce-scattered together.
    """
    group = model.output if isinstance(model.output, FSDPModule) else None
    if group is None or not chunked:
        yield lambda h: model.output(model.norm(h))
        return
    first = True

    def head(h: torch.Tensor) -> torch.Tensor:
        nonlocal first
        logits = model.output(model.norm(h))
        if first and torch.is_grad_enabled():
            logits = _HeadSyncOnBackward.apply(logits, group)
        first = False
        return logits

    reshard_after_forward = model.scoring.head_reshard_after_forward
    group.set_reshard_after_forward(False, recurse=False)
    if torch.is_grad_enabled():
        # until the first chunk's backward: accumulate unsharded, keep the head gathered
        group.set_requires_gradient_sync(False, recurse=False)
        group.set_reshard_after_backward(False, recurse=False)
    try:
        yield head
    finally:
        group.set_reshard_after_forward(reshard_after_forward, recurse=False)
        if reshard_after_forward and not torch.is_grad_enabled():
            group.reshard()


@torch.no_grad()
def _sync_reference(self, alpha: float = 1.0) -> None:
    """reference <- alpha * policy + (1 - alpha) * reference, parameter by parameter.

    Both have the same class, parallelization and shards, so every update is local.
    """
    ref_params = dict(self.reference.named_parameters())
    for name, p in self.named_parameters():
        ref = ref_params[name]
        if alpha == 1:
            ref.copy_(p)
        else:
            ref.mul_(1 - alpha).add_(p, alpha=alpha)


@torch.no_grad()
def _init_reference(self) -> None:
    """The reference's start-up weights: [reference_model] checkpoint_path, else the policy's."""
    cfg = self.reference_cfg
    if cfg.checkpoint_path:
        load_reference_checkpoint(self.reference, cfg.checkpoint_path, cfg.checkpoint_format, cfg.sd_adapter)
        logger.info(f"Reference model loaded from [reference_model] checkpoint_path = {cfg.checkpoint_path} ({cfg.checkpoint_format})")
    else:
        self.sync_reference()
        logger.info("Reference model set to the policy's current weights")
    self._reference_stale = False


def load_reference_checkpoint(reference: nn.Module, path: str, fmt: str, sd_adapter=None) -> None:
    """Load a DCP step folder (model-only or full) or an HF safetensors folder into the reference.

    DCP reshards to the reference's own TP/FSDP layout. HF goes through the TrainSpec's
    state-dict adapter, exactly as torchtitan's `[checkpoint] initial_load_in_hf` does.
    """
    state_dict = get_model_state_dict(reference)
    if fmt == "hf":
        hf_state_dict = sd_adapter.to_hf(state_dict)
        dcp.load(hf_state_dict, storage_reader=sd_adapter.get_hf_storage_reader(path))
        state_dict = sd_adapter.from_hf(hf_state_dict)
    else:
        # a full checkpoint holds the model's entries at top level, next to "optimizer" etc.
        dcp.load(state_dict, checkpoint_id=path)
    set_model_state_dict(reference, state_dict)


@contextmanager
def reference_on_device(model: nn.Module, device: torch.device):
    """With [reference_model] offload, the reference's weights visit `device` only inside this block.

    `nn.Module.to` works for plain, TP (DTensor) and FSDP2-sharded parameters: it swaps
    DTensor parameters in place, and FSDP2 re-registers its shards after the move.
    """
    if not model.reference_cfg.offload:
        yield
        return
    model.reference.to(device)
    try:
        yield
    finally:
        model.reference.to("cpu")


def _to_empty(self, *, device, recurse: bool = True):
    self._base_cls.to_empty(self, device=device, recurse=recurse)
    if self.reference is not None:
        self.reference.to_empty(device=device, recurse=recurse)
    return self


def _init_weights(self, *args, **kwargs):
    self._base_cls.init_weights(self, *args, **kwargs)
    if self.reference is not None:
        # buffers (RoPE tables) are computed here; the weights are copied from the policy
        # at the first forward, i.e. after torchtitan's checkpoint load if there is one
        self.reference.init_weights(*args, **kwargs)
        self._reference_stale = True
        if self.reference_cfg.offload:
            self.reference.to("cpu")


def _train(self, mode: bool = True):
    self._base_cls.train(self, mode)
    if self.reference is not None:
        self.reference.eval()
    return self


_GRPO_CLASSES: dict[type, type] = {}


def grpo_model_cls(base: type[nn.Module]) -> type[nn.Module]:
    """A subclass of torchtitan's model class that scores labels and owns a frozen reference."""
    if base not in _GRPO_CLASSES:
        _GRPO_CLASSES[base] = type(f"GRPO{base.__name__}", (base,), {
            "_base_cls": base,
            "reference": None,
            "_reference_stale": False,
            "_reference_restored": False,
            "grpo_stats": None,
            "scoring": ScoringConfig(),
            "reference_cfg": ReferenceConfig(),
            "forward": _grpo_forward,
            "score": _score,
            "_hidden_states": _hidden_states,
            "sync_reference": _sync_reference,
            "init_reference": _init_reference,
            "to_empty": _to_empty,
            "init_weights": _init_weights,
            "train": _train,
        })
    return _GRPO_CLASSES[base]


def _mark_reference_stale(module, incompatible_keys) -> None:
    # a model-only load (initial weights) changed the policy: the reference starts from it,
    # unless a full checkpoint just restored the reference itself
    module._reference_stale = module.reference is not None and not module._reference_restored


REFERENCE_PREFIX = "grpo_reference."


class _ReferenceInTrainingState:
    """Optimizer-container mixin that saves/restores the reference with the training state.

    The reference is training state, like the optimizer's moments: it belongs in full
    checkpoints (so a resume is exact, and a synced reference survives), but never in the
    model-only / HF export, which is built from the policy's state dict alone.
    With an offloaded reference the saved tensors are its CPU copies.
    """

    grpo_steps = 0  # optimizer steps taken, for [reference_model] sync_steps

    def state_dict(self):
        sd = super().state_dict()
        reference = self.model_parts[0].reference
        if reference is not None:
            sd.update({REFERENCE_PREFIX + k: v for k, v in get_model_state_dict(reference).items()})
        return sd

    def load_state_dict(self, state_dict):
        ref_sd = {k[len(REFERENCE_PREFIX):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(REFERENCE_PREFIX)}
        super().load_state_dict(state_dict)
        self.grpo_steps = _optimizer_steps(self)
        model = self.model_parts[0]
        if ref_sd and model.reference is not None:
            set_model_state_dict(model.reference, ref_sd)
            model._reference_restored, model._reference_stale = True, False
            logger.info("Reference model restored from the checkpoint")


def _optimizer_steps(container) -> int:
    """Steps taken, as Adam/AdamW (torchtitan's optimizers) count them in their state."""
    for optimizer in container.optimizers:
        for state in optimizer.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


def _sync_after_step(container, args, kwargs) -> None:
    """Optimizer step post-hook: every sync_steps steps, move the reference toward the policy."""
    container.grpo_steps += 1
    model = container.model_parts[0]
    cfg = model.reference_cfg
    if container.grpo_steps % cfg.sync_steps == 0:
        with reference_on_device(model, next(model.parameters()).device):
            model.sync_reference(cfg.sync_alpha)
        logger.info(f"Step {container.grpo_steps}: reference <- {cfg.sync_alpha} * policy + {1 - cfg.sync_alpha:g} * reference")


def build_grpo_optimizers_fn(base_build: Callable) -> Callable:
    """Wrap torchtitan's optimizer builder so checkpoints carry the reference model and it can sync."""

    def build_grpo_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
        container = base_build(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
        base = type(container)
        container.__class__ = type(f"GRPO{base.__name__}", (_ReferenceInTrainingState, base), {})
        model = model_parts[0]
        if model.reference is not None and model.reference_cfg.sync_steps > 0:
            # a resume restores the step count from the optimizer state (load_state_dict)
            container.register_step_post_hook(_sync_after_step)
        return container

    return build_grpo_optimizers


def build_grpo_parallelize_fn(base_parallelize: Callable) -> Callable:
    """Wrap torchtitan's parallelize function: parallelize the policy and its reference alike."""

    def parallelize_grpo(model: nn.Module, parallel_dims, job_config) -> nn.Module:
        validate(job_config)
        compile_cfg = job_config.compile
        policy_compiled = compile_cfg.enable and "loss" in compile_cfg.components
        ref_compiled = job_config.reference_model.compile
        if parallel_dims.tp_enabled and (compile_cfg.enable or ref_compiled):
            isolate_compile_cache(torch.distributed.get_rank())

        reference = None
        if job_config.grpo.beta > 0:
            reference = copy.deepcopy(model)  # still on meta: no memory yet
            reference = parallelize_model(base_parallelize, reference, parallel_dims, job_config)
            reference.requires_grad_(False)
            if isinstance(reference, FSDPModule):
                # no backward follows its forward: free every all-gathered weight right away
                # (torchtitan keeps the last layers' for backward), so its parameters also stay
                # sharded like the policy's, as sync_reference needs
                reference.set_reshard_after_forward(True)
            cpu.prepare_parallelized(reference)
        else:
            logger.info("[grpo] beta = 0: no reference model is built, loaded or run; [reference_model] has no effect")

        model = parallelize_model(base_parallelize, model, parallel_dims, job_config)
        cpu.prepare_parallelized(model)

        seq_shards = parallel_dims.tp if parallel_dims.tp_enabled else 1
        common = dict(
            temperature=job_config.grpo.temperature,
            chunk_size=job_config.grpo.logprob_chunk_size,
            seq_shards=seq_shards,
        )
        model.scoring = ScoringConfig(
            compile=policy_compiled, entropy_grad=job_config.grpo.entropy_coef > 0,
            # torchtitan's FSDP policy for the last group: resharded after forward only with "always"
            head_reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward == "always", **common,
        )
        model.grpo_stats = GRPOStats()
        if reference is not None:
            reference.scoring = ScoringConfig(compile=ref_compiled, head_reshard_after_forward=True, **common)
            model.reference_cfg = build_reference_config(model, job_config)
            # a plain attribute, not a submodule: invisible to parameters(), state_dict(), FSDP's root
            model.__dict__["reference"] = reference
            model._reference_stale = True
            model.register_load_state_dict_post_hook(_mark_reference_stale)
        return model

    return parallelize_grpo


class _WithoutDataParallel:
    """`parallel_dims` as torchtitan's parallelize function sees it when FSDP is applied by `fully_shard_tied`."""

    fsdp_enabled = dp_replicate_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)


def ties_weights(model: nn.Module) -> bool:
    """Whether the output layer shares the embedding's weight (qwen3's 0.6B-4B and debug flavors)."""
    return bool(getattr(model.model_args, "enable_weight_tying", False))


def parallelize_model(base_parallelize: Callable, model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torchtitan's parallelize function, with tied embedding and output weights kept one parameter.

    TP gives the embedding and the output layer a DTensor parameter each; both are Shard(0) of
    the same [V, D] weight, so they are tied again before FSDP. torchtitan's FSDP wrapping puts
    the two in different groups, which FSDP2 rejects for a shared parameter ("use
    fully_shard([module_a, module_b])"): with tied weights FSDP is applied by fully_shard_tied.
    """
    if not ties_weights(model):
        return base_parallelize(model, parallel_dims, job_config)
    dp = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    model = base_parallelize(model, _WithoutDataParallel(parallel_dims) if dp else parallel_dims, job_config)
    model.output.weight = model.tok_embeddings.weight
    if dp:
        fully_shard_tied(model, parallel_dims, job_config)
    return model


def fully_shard_tied(model: nn.Module, parallel_dims, job_config) -> None:
    """torchtitan's FSDP/HSDP wrapping of a dense model (llama4's apply_fsdp), the embedding joining the head's group."""
    if not parallel_dims.fsdp_enabled:
        raise ValueError(
            "[parallelism] data_parallel_replicate_degree > 1 without data_parallel_shard_degree > 1 (DDP) is not "
            "supported with tied embedding and output weights: use data_parallel_shard_degree"
        )
    training, policy = job_config.training, job_config.parallelism.fsdp_reshard_after_forward
    mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    config = dict(mesh=mesh, mp_policy=mp)
    if training.enable_cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=policy != "never")
    # one group for the shared weight; like torchtitan's head group, kept gathered after forward by default
    fully_shard([model.tok_embeddings, model.norm, model.output], **config, reshard_after_forward=policy == "always")
    fully_shard(model, **config)
    disable_fsdp_gradient_division(model)
    logger.info("Applied FSDP with the tied embedding and output weights in one group")


def build_reference_config(model: nn.Module, job_config) -> ReferenceConfig:
    """[reference_model] resolved at start-up: the checkpoint's format and reader, the offload's effect."""
    r = job_config.reference_model
    cfg = ReferenceConfig(sync_steps=r.sync_steps, sync_alpha=r.sync_alpha, offload=r.offload)
    if r.checkpoint_path:
        cfg.checkpoint_path = r.checkpoint_path
        cfg.checkpoint_format = reference_checkpoint_format(r.checkpoint_path, r.checkpoint_format)
        if cfg.checkpoint_format == "hf":
            adapter_cls = get_train_spec(job_config.model.name).state_dict_adapter
            cfg.sd_adapter = adapter_cls(model.model_args, job_config.model.hf_assets_path)
    if r.offload and cpu.is_active():
        logger.info("[reference_model] offload = true has no effect on CPU: the weights already live in CPU memory")
        cfg.offload = False
    return cfg
