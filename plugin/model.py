"""The GRPO policy model: torchtitan's llama3/qwen3 model class that, given labels, scores them.

`grpo_model_cls` combines `GRPOModel` (and the family's trunk) with torchtitan's class once
per base, as FSDP2 does for its own `FSDP<Module>` classes. Called without labels, the model is
torchtitan's. With labels it returns a `PolicyOutput`: the policy's per-token log-probs and
entropy, the frozen reference's log-probs (plugin.reference) and the batch's per-completion
values, which is what the GRPO loss takes.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from torchtitan.components.loss import IGNORE_INDEX

from .logprobs import blocked_logprobs, chunked_logprobs, fused_chunked_loss, local_chunk
from .metrics import GRPOStats
from .reference import Reference


@dataclass
class PolicyOutput:
    """What the model hands to the loss: per-token log-probs and the batch's per-completion data."""

    logprobs: torch.Tensor  # [B, T] fp32, requires grad
    entropy: torch.Tensor | None  # [B, T] fp32; carries a gradient only with an entropy bonus; None: not computed
    ref_logprobs: torch.Tensor | None = None  # [B, T] fp32; None when beta = 0
    old_logprobs: torch.Tensor | None = None  # [B, T] behaviour log-probs, NaN where unknown; None: on-policy
    advantages: torch.Tensor | None = None  # [B]
    rewards: torch.Tensor | None = None  # [B]
    loss_weights: torch.Tensor | None = None  # [B], see data.loss_weights
    stats: GRPOStats | None = None
    sampler_logprobs: torch.Tensor | None = None  # [B, T] online mode's sampler log-probs, NaN elsewhere
    # [grpo] fused_policy_pass: the loss sum, its gradients computed in forward; logprobs and entropy are then detached
    fused_loss: torch.Tensor | None = None


@dataclass
class ScoringConfig:
    temperature: float = 1.0
    chunk_size: int = 0  # global sequence positions per chunk, of each sequence ([grpo] logprob_chunk_size)
    chunk_tokens: int = 0  # tokens of the batch per chunk, all ranks; 0 with chunk_size 0 = all at once
    seq_shards: int = 1  # ranks the trunk output is sequence-sharded over (TP degree)
    compile: bool = False
    compile_backend: str = "inductor"
    entropy_grad: bool = False  # the entropy bonus needs its gradient
    entropy: bool = True  # compute it at all: the reference's pass uses only its log-probs
    head_reshard_after_forward: bool = False  # the FSDP policy of the head's group, see head_comms_once
    # [grpo] fused_policy_pass: the per-token GRPO terms (plugin.loss.grpo_token_terms with the run's
    # settings) that the policy pass differentiates chunk by chunk; None: log-probs go to the loss
    token_terms: Callable | None = None


class GRPOModel:
    """Mixin over torchtitan's model class: scores labels, owns the frozen reference."""

    def __init__(self, model_args):
        super().__init__(model_args)
        self.scoring = ScoringConfig()
        self.grpo_stats: GRPOStats | None = None
        self.reference: Reference | None = None  # not a submodule (plugin.reference says why)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, rollouts=None, *,
                trunk_only: bool = False, with_reference: bool = True, **kwargs):
        """Logits when called without labels (torchtitan's own use); PolicyOutput with them.

        Through forward, so FSDP's root hooks run, also: `trunk_only` returns `hidden_states` (a
        sampler's prefill), and `with_reference=False` skips the reference pass (a scoring pass).
        """
        if trunk_only:
            return self.hidden_states(tokens, **kwargs)
        if labels is None:
            return super().forward(tokens, **kwargs)
        ref_logprobs = None
        if self.reference is not None and with_reference:
            if rollouts is not None and rollouts.ref_logprobs is not None:
                # the rollouts carry the reference's log-probs for every completion token: no reference pass
                self.reference.load_once(self, tokens.device)
                ref_logprobs = rollouts.ref_logprobs.to(tokens.device)
            else:
                ref_logprobs = self.reference.logprobs(self, tokens, labels, self.grpo_stats, **kwargs)
        fused = self.scoring.token_terms is not None and rollouts is not None and torch.is_grad_enabled()
        if not fused:
            logprobs, entropy = self.score(tokens, labels, **kwargs)
            if rollouts is None:  # the reference's own call: only log-probs are asked for
                return PolicyOutput(logprobs, entropy)
        r = rollouts.to(tokens.device)
        fused_loss = None
        if fused:
            fused_loss, logprobs, entropy = self.fused_loss(tokens, labels, r, ref_logprobs, **kwargs)
        if rollouts.keep_logprobs:
            # the first pass over an online batch: its log-probs are the old log-probs of the replays
            rollouts.old_logprobs = logprobs.detach().clone()
        return PolicyOutput(logprobs, entropy, ref_logprobs, r.old_logprobs, r.advantages, r.rewards, r.loss_weights,
                            self.grpo_stats, r.sampler_logprobs, fused_loss)

    def score(self, tokens: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] log-probs of `labels` and entropies (None when scoring.entropy is off) under this model."""
        cfg = self.scoring
        hidden = self.hidden_states(tokens, **kwargs)
        common = dict(temperature=cfg.temperature, chunk_size=cfg.chunk_size, chunk_tokens=cfg.chunk_tokens,
                      seq_shards=cfg.seq_shards, compiled=cfg.compile, backend=cfg.compile_backend,
                      with_entropy=cfg.entropy)
        if not torch.is_grad_enabled():  # the reference's pass: vocab blocks, as the fused policy pass
            with head_weight(self) as weight:
                return blocked_logprobs(hidden, labels, self.norm, weight, **common)
        B, T_local = hidden.shape[:2]
        chunked = local_chunk(B, T_local, cfg.seq_shards, cfg.chunk_size, cfg.chunk_tokens) < B * T_local
        with head_comms_once(self, chunked=chunked) as head:
            return chunked_logprobs(hidden, labels, head, entropy_grad=cfg.entropy_grad, **common)

    def fused_loss(self, tokens: torch.Tensor, labels: torch.Tensor, r, ref_logprobs: torch.Tensor | None,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The GRPO loss sum with each chunk's backward run in forward; detached [B, T] log-probs and entropies."""
        cfg = self.scoring
        hidden = self.hidden_states(tokens, **kwargs)
        T = labels.shape[1]
        mask = (labels != IGNORE_INDEX).view(-1)
        old = None if r.old_logprobs is None else r.old_logprobs.view(-1)
        ref = None if ref_logprobs is None else ref_logprobs.view(-1)

        def token_loss(logprobs, entropy, index):  # [N] tokens at `index` of the flattened [B, T]
            row = index // T
            # as grpo_loss: behaviour log-probs where the rollouts have them, on-policy elsewhere
            old_c = logprobs.detach() if old is None else torch.where(old[index].isnan(), logprobs.detach(), old[index])
            terms = cfg.token_terms(logprobs[:, None], old_c[:, None], None if ref is None else ref[index][:, None],
                                    r.advantages[row], r.loss_weights[row], mask[index][:, None], entropy[:, None])
            return terms.loss.sum()

        with head_weight(self) as weight:
            return fused_chunked_loss(hidden, labels, self.norm, weight, token_loss, temperature=cfg.temperature,
                                      chunk_size=cfg.chunk_size, chunk_tokens=cfg.chunk_tokens,
                                      seq_shards=cfg.seq_shards, compiled=cfg.compile, backend=cfg.compile_backend,
                                      entropy_grad=cfg.entropy_grad)

    def to_empty(self, *, device, recurse: bool = True):
        super().to_empty(device=device, recurse=recurse)
        if self.reference is not None:
            self.reference.materialize(device, recurse)
        return self

    def init_weights(self, *args, **kwargs):
        super().init_weights(*args, **kwargs)
        if self.reference is not None:
            self.reference.init_buffers(*args, **kwargs)


class Llama3Trunk:
    def hidden_states(self, tokens: torch.Tensor, attention_masks=None, positions=None) -> torch.Tensor:
        """The trunk's output before the final norm; sequence-sharded [B, T/TP, D] under TP."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks, positions)
        return h


class Qwen3Trunk:
    def hidden_states(self, tokens: torch.Tensor, attention_masks=None, positions=None) -> torch.Tensor:
        """The trunk's output before the final norm; sequence-sharded [B, T/TP, D] under TP."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, attention_masks, positions)
        return h


TRUNKS = {"llama3": Llama3Trunk, "qwen3": Qwen3Trunk}
_GRPO_CLASSES: dict[type, type] = {}


def grpo_model_cls(base: type[nn.Module], family: str) -> type[nn.Module]:
    """GRPOModel and the family's trunk over torchtitan's model class `base`, made once per base."""
    if base not in _GRPO_CLASSES:
        _GRPO_CLASSES[base] = type(f"GRPO{base.__name__}", (GRPOModel, TRUNKS[family], base), {})
    return _GRPO_CLASSES[base]


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
    """The head (final norm + output layer) to score chunks with grad, all-gathered and reduce-scattered once.

    torchtitan gives [norm, output] (with tied weights also the embedding) one FSDP group.
    Called once per chunk, the group would reshard after every chunk's post-backward and
    all-gather again for the next chunk's recompute, with one reduce-scatter per chunk: here it
    stays gathered over the chunks, and the chunks' gradients are reduce-scattered together.
    """
    group = model.output if isinstance(model.output, FSDPModule) else None
    if group is None or not chunked:
        yield lambda h: model.output(model.norm(h))
        return
    first = True

    def head(h: torch.Tensor) -> torch.Tensor:
        nonlocal first
        logits = model.output(model.norm(h))
        if first:
            logits = _HeadSyncOnBackward.apply(logits, group)
        first = False
        return logits

    group.set_reshard_after_forward(False, recurse=False)
    # until the first chunk's backward: accumulate unsharded, keep the head gathered
    group.set_requires_gradient_sync(False, recurse=False)
    group.set_reshard_after_backward(False, recurse=False)
    try:
        yield head
    finally:
        group.set_reshard_after_forward(model.scoring.head_reshard_after_forward, recurse=False)


@contextmanager
def head_weight(model: nn.Module):
    """The output layer's weight, for the passes that make the head's logits themselves in vocab blocks.

    Those are [grpo] fused_policy_pass, which runs the head's backward inside forward, and the
    reference's. Under FSDP the head's parameters are unsharded, all-gathered once. FSDP would
    take the fused pass's backward for the step's (prefetches, a final callback that ends the
    iteration mid-forward), so its hooks stay quiet as they do while it recomputes a group for
    activation checkpointing. The fused pass's backward hands the gradients to the unsharded
    parameters, and the root's post-backward callback reduce-scatters them, as for a group no
    autograd node led back to.
    """
    group = model.output if isinstance(model.output, FSDPModule) else None
    if group is not None:
        group.unshard()
        state = group._get_fsdp_state()
        training_state, state._training_state = state._training_state, TrainingState.PRE_BACKWARD
    try:
        yield model.output.weight
    finally:
        if group is not None:
            state._training_state = training_state
            if not ties_weights(model):
                # the gradients are computed: backward needs no head (the tied embedding's group is FSDP's to reshard)
                group.reshard()


def ties_weights(model: nn.Module) -> bool:
    """Whether the output layer shares the embedding's weight (qwen3's 0.6B-4B and debug flavors)."""
    return bool(getattr(model.model_args, "enable_weight_tying", False))
