"""Policy + frozen reference model, scored through one log-prob path, and their parallelize function.

The reference is a deep copy of the policy's (meta-device) module, parallelized by the same
torchtitan parallelize function on the same TP/FSDP mesh. It is kept out of the policy's
module tree, so torchtitan's optimizer, grad-norm clipping, FSDP gradient reduction and
checkpoint/export of `model_parts` only ever see the policy.
"""

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from torchtitan.tools.logging import logger

from . import cpu
from .config import validate
from .logprobs import chunked_logprobs, isolate_compile_cache
from .metrics import GRPOStats


@dataclass
class PolicyOutput:
    """What the model hands to the loss: per-token log-probs and the batch's per-completion data."""

    logprobs: torch.Tensor  # [B, T] fp32, requires grad
    entropy: torch.Tensor  # [B, T] fp32, detached
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


def _grpo_forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, rollouts=None, **kwargs):
    """Logits when called without labels (torchtitan's own use); PolicyOutput with them."""
    if labels is None:
        return self._base_cls.forward(self, tokens, **kwargs)
    rollouts = rollouts.to(tokens.device) if rollouts is not None else None
    ref_logprobs = None
    if self.reference is not None:
        if self._reference_stale:
            self.sync_reference()
        with torch.no_grad(), self.grpo_stats.reference_pass(tokens.device):
            ref_logprobs = self.reference(tokens, labels=labels, **kwargs).logprobs
    logprobs, entropy = self.score(tokens, labels, **kwargs)
    if rollouts is None:  # the reference's own call: only log-probs are asked for
        return PolicyOutput(logprobs, entropy, None, None, None, None, None, None)
    return PolicyOutput(
        logprobs, entropy, ref_logprobs, rollouts.old_logprobs, rollouts.advantages, rollouts.rewards,
        rollouts.loss_weights, self.grpo_stats,
    )


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
    return chunked_logprobs(
        self._hidden_states(tokens, **kwargs),
        labels,
        lambda h: self.output(self.norm(h)),
        temperature=cfg.temperature,
        chunk_size=cfg.chunk_size,
        seq_shards=cfg.seq_shards,
        compiled=cfg.compile,
        entropy_grad=cfg.entropy_grad,
    )


def _sync_reference(self) -> None:
    """reference <- policy, parameter by parameter (same class, same parallelization, same shards)."""
    with torch.no_grad():
        ref_params = dict(self.reference.named_parameters())
        for name, p in self.named_parameters():
            ref_params[name].copy_(p)
    self._reference_stale = False
    logger.info("Reference model set to the policy's current weights")


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
            "forward": _grpo_forward,
            "score": _score,
            "_hidden_states": _hidden_states,
            "sync_reference": _sync_reference,
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
    """

    def state_dict(self):
        sd = super().state_dict()
        reference = self.model_parts[0].reference
        if reference is not None:
            sd.update({REFERENCE_PREFIX + k: v for k, v in get_model_state_dict(reference).items()})
        return sd

    def load_state_dict(self, state_dict):
        ref_sd = {k[len(REFERENCE_PREFIX):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(REFERENCE_PREFIX)}
        super().load_state_dict(state_dict)
        model = self.model_parts[0]
        if ref_sd and model.reference is not None:
            set_model_state_dict(model.reference, ref_sd)
            model._reference_restored, model._reference_stale = True, False
            logger.info("Reference model restored from the checkpoint")


def build_grpo_optimizers_fn(base_build: Callable) -> Callable:
    """Wrap torchtitan's optimizer builder so checkpoints carry the reference model."""

    def build_grpo_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
        container = base_build(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
        base = type(container)
        container.__class__ = type(f"GRPO{base.__name__}", (_ReferenceInTrainingState, base), {})
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
            reference = base_parallelize(reference, parallel_dims, job_config)
            reference.requires_grad_(False)
            cpu.prepare_parallelized(reference)
        else:
            logger.info("[grpo] beta = 0: no reference model is built")

        model = base_parallelize(model, parallel_dims, job_config)
        cpu.prepare_parallelized(model)

        seq_shards = parallel_dims.tp if parallel_dims.tp_enabled else 1
        common = dict(
            temperature=job_config.grpo.temperature,
            chunk_size=job_config.grpo.logprob_chunk_size,
            seq_shards=seq_shards,
        )
        model.scoring = ScoringConfig(compile=policy_compiled, entropy_grad=job_config.grpo.entropy_coef > 0, **common)
        model.grpo_stats = GRPOStats()
        if reference is not None:
            reference.scoring = ScoringConfig(compile=ref_compiled, **common)
            # a plain attribute, not a submodule: invisible to parameters(), state_dict(), FSDP's root
            model.__dict__["reference"] = reference
            model._reference_stale = True
            model.register_load_state_dict_post_hook(_mark_reference_stale)
        return model

    return parallelize_grpo
