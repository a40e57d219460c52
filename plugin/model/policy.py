"""The GRPO policy model: torchtitan's llama3/qwen3 model class that, given labels, scores them.

`grpo_model_cls` combines `GRPOModel` with torchtitan's class once per base, as FSDP2 does for its
own `FSDP<Module>` classes. torchtitan calls `forward`: without labels it is torchtitan's model
(logits); with labels and the batch's `Rollouts` it returns a `PolicyOutput`, the GRPO loss's
input. Every other job is a method of its own: `hidden_states` (the trunk, the sampler's
prefill), `logprobs` (no-grad log-probs: the reference's pass, online mode's old log-probs),
`score` and `fused_loss` (the policy's pass, unfused or fused with the loss's backward).

The model-family contract, all the plugin relies on besides `FAMILIES`' RoPE buffer name:
- `tok_embeddings`: token ids -> [B, T, D]; `layers`: an nn.ModuleDict of blocks, each called
  `layer(h, rope, attention_masks, positions)`; `norm`: the final norm; `output`: a bias-free
  nn.Linear whose weight is [V, D] (a Shard(0) DTensor under TP);
- each block's `attention` has an `inner_attention` submodule called `(q, k, v, scale=..., enable_gqa=...)`
  on [B, H, T, hd] (the sampler puts its KV cache there), and torchtitan's `attn_type` switch whose
  "varlen" case calls it `(q, k, v, VarlenMetadata, scale=...)` (plugin.model.attention, padding-free);
- `model_args.max_seq_len` (the RoPE table's length) and, for tied embedding and output weights,
  `model_args.enable_weight_tying`.
Adding a family is one `FAMILIES` entry and its TrainSpec registration (plugin/__init__.py).
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.models.attention import VarlenMetadata

from plugin.model.attention import sequence_bounds, use_packed_attention
from plugin.model.moe import Routing
from plugin.model.reference import Reference
from plugin.runtime import internals
from plugin.runtime.stats import GRPOStats
from plugin.scoring.logprobs import Scoring, blocked_logprobs, chunked_logprobs, fused_chunked_loss, local_chunk

# the torchtitan model families the plugin registers, and the name of each one's RoPE buffer
FAMILIES = {"llama3": "freqs_cis", "qwen3": "rope_cache"}


@dataclass
class PolicyOutput:
    """What the model hands to the loss: per-token log-probs and the batch's per-completion data."""

    logprobs: torch.Tensor  # [B, T] fp32, requires grad
    entropy: torch.Tensor | None  # [B, T] fp32; carries a gradient only with an entropy bonus; None: not computed
    ref_logprobs: torch.Tensor | None = None  # [B, T] fp32; None when beta = 0
    old_logprobs: torch.Tensor | None = None  # [B, T] behaviour log-probs, NaN where unknown; None: on-policy
    advantages: torch.Tensor | None = None  # [B]
    rewards: torch.Tensor | None = None  # [B]
    loss_weights: torch.Tensor | None = None  # [B], see batch.loss_weights
    sampler_logprobs: torch.Tensor | None = None  # [B, T] online mode's sampler log-probs, NaN elsewhere
    # [grpo] fused_policy_pass: the loss sum, its gradients computed in forward; logprobs and entropy are then detached
    fused_loss: torch.Tensor | None = None
    # padding-free: the per-token tensors (and the labels) are one packed row [1, T]; this turns each into the
    # padded [B, longest] layout the loss computes on (Rollouts.unpacked). None: they are [B, T] already
    unpack: Callable | None = None

    def padded(self, labels: torch.Tensor) -> tuple["PolicyOutput", torch.Tensor]:
        """This output and `labels` in the padded layout, row b completion b."""
        u = self.unpack
        if u is None:
            return self, labels
        nan = float("nan")
        return replace(self, logprobs=u(self.logprobs), entropy=u(self.entropy), ref_logprobs=u(self.ref_logprobs),
                       old_logprobs=u(self.old_logprobs, nan), sampler_logprobs=u(self.sampler_logprobs, nan),
                       unpack=None), u(labels, IGNORE_INDEX)


def _lengths_vary(block: nn.Module, args: tuple, rope_rows: int) -> None:
    """A block's forward pre-hook: its inputs' token counts vary, so a compiled block is traced for any length from
    its first call. Else dynamo specializes the first graph on the first batch's lengths, and every block of the
    policy and the reference recompiles at the second step (seen: 53 of a 3-step, 4-rank run's 173 s)."""
    if torch.compiler.is_compiling():  # traced as part of a compiled caller (the sampler's decode step)
        return
    h, rope, attention_masks = args[0], args[1], args[2] if len(args) > 2 else None
    dims = [(h, 1)]
    if rope.shape[0] != rope_rows:  # a packed row's table rows at its positions (trunk), not the whole table
        dims.append((rope, 0))
    if isinstance(attention_masks, VarlenMetadata):  # a packed row's count of sequences
        dims += [(attention_masks.cu_seq_q, 0), (attention_masks.cu_seq_k, 0)]
    internals.lengths_vary(*dims)


def _tokens_vary(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook of an MoE layer's router, reorderer and shared experts, which torchtitan compiles one by
    one: their [tokens, ...] inputs (2-D; the 1-D ones, the router's expert bias, are per expert) are traced for
    any token count from the first call, as _lengths_vary does for whole blocks."""
    if torch.compiler.is_compiling():
        return
    internals.lengths_vary(*[(a, 0) for a in args if type(a) is torch.Tensor and a.dim() == 2])


class GRPOModel:
    """Mixin over torchtitan's model class: scores labels, owns the frozen reference."""

    rope_buffer = "freqs_cis"  # the family's RoPE table (FAMILIES), set per class by grpo_model_cls

    def __init__(self, model_args):
        super().__init__(model_args)
        self.scoring = Scoring()
        self.stats: GRPOStats | None = None
        self.reference: Reference | None = None  # not a submodule (plugin.model.reference says why)
        # [grpo] fused_policy_pass: the per-token GRPO terms (plugin.scoring.loss.grpo_token_terms with the run's settings)
        # that the policy pass differentiates chunk by chunk; None: log-probs go to the loss
        self.token_terms: Callable | None = None
        self.head_reshard_after_forward = False  # the FSDP policy of the head's group, see head_comms_once
        # [grpo] importance_sampling_level = "sequence": the fused pass's terms need each completion's mean log-ratio
        self.sequence_ratio = False
        self.routing: Routing | None = None  # MoE flavors' routing counts and load-balancing bias (plugin.model.moe)
        # bumped by the optimizer container at each applied step: a sampler holding a copy of the weights (vLLM)
        # reloads them before it generates when this changed
        self.weights_version = 0

    def configure(self, scoring: Scoring, stats: GRPOStats | None = None, reference: Reference | None = None,
                  token_terms: Callable | None = None, head_reshard_after_forward: bool = False,
                  sequence_ratio: bool = False, padding_free: bool = False) -> None:
        """What the parallelize function gives the parallelized model, once: how it scores, where its statistics
        go, its reference, for the fused pass the loss's per-token terms and their ratio's level, and whether its
        attention takes padding-free rows."""
        self.scoring, self.stats, self.reference, self.token_terms = scoring, stats, reference, token_terms
        self.head_reshard_after_forward, self.sequence_ratio = head_reshard_after_forward, sequence_ratio
        if padding_free:
            use_packed_attention(self)
        rope_rows = getattr(self, self.rope_buffer).shape[0]
        for layer in self.layers.values():
            # after FSDP's pre-forward hook (registered first, and prepended), which casts the inputs under mixed
            # precision into tensors of its own
            layer.register_forward_pre_hook(partial(_lengths_vary, rope_rows=rope_rows))
            if getattr(layer, "moe", None) is not None:
                for name, module in layer.moe.named_children():
                    if name != "experts":  # eager in torchtitan's compile, its grouped matmul a compiled function
                        module.register_forward_pre_hook(_tokens_vary)
        if isinstance(self, FSDPModule):
            # the methods called from outside forward run FSDP's root hooks as forward does
            for method in ("hidden_states", "_logprobs"):
                register_fsdp_forward_method(self, method)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, rollouts=None, **kwargs):
        """Logits without labels (torchtitan's own use); with labels, the loss's input: the policy's log-probs and
        the reference's, and the batch's per-completion values from its `rollouts` (plugin.data.batch.Rollouts)."""
        if labels is None:
            if self.attends_packed():  # torchtitan's forward would hand the varlen attention no boundaries
                return self.output(self.norm(self.trunk(tokens, **kwargs)))
            return super().forward(tokens, **kwargs)
        if rollouts is not None and rollouts.seq_lens is not None and self.stats is not None:
            self.stats.record_layout(int(rollouts.seq_lens.sum()), tokens.numel())
        r = None if rollouts is None else rollouts.to(tokens.device)
        unpack = r.unpacked if r is not None and r.packed else None
        ref_logprobs = None
        if self.reference is not None:
            if r is not None and r.ref_logprobs is not None:
                # the rollouts carry the reference's log-probs for every completion token: no reference pass
                self.reference.load_once(self, tokens.device)
                ref_logprobs = r.ref_logprobs
            else:
                ref_logprobs = self.reference.logprobs(self, tokens, labels, self.stats, **kwargs)
        if r is None:  # labels scored alone (no loss follows)
            return PolicyOutput(*self.score(tokens, labels, **kwargs), ref_logprobs)
        fused_loss = None
        # the moe/* metrics and the load-balancing bias count the training passes' routing; routing replay (R2, R3)
        # routes them with the experts the batch carries
        routing = self.routing
        if routing is not None:  # kept through the backward, whose activation checkpointing may run this again
            routing.replay_through_backward(r.routed_experts)
        with routing.record("policy") if routing is not None and torch.is_grad_enabled() else nullcontext():
            if self.token_terms is not None and torch.is_grad_enabled():
                fused_loss, logprobs, entropy = self.fused_loss(tokens, labels, r, ref_logprobs, **kwargs)
            else:
                logprobs, entropy = self.score(tokens, labels, **kwargs)
        return PolicyOutput(logprobs, entropy, ref_logprobs, r.old_logprobs, r.advantages, r.rewards, r.loss_weights,
                            r.sampler_logprobs, fused_loss, unpack)

    def attends_packed(self) -> bool:
        """Whether the attention takes varlen boundaries now ([grpo] padding_free, outside generation)."""
        return next(iter(self.layers.values())).attention.attn_type == "varlen"

    def trunk(self, tokens: torch.Tensor, attention_masks=None, positions=None) -> torch.Tensor:
        """The trunk's output before the final norm; sequence-sharded [B, T/TP, D] under TP."""
        if attention_masks is None and self.attends_packed():
            # a packed row's sequences from its positions; a padded batch's rows
            attention_masks = sequence_bounds(tokens, positions)
        h = self.tok_embeddings(tokens)
        rope = getattr(self, self.rope_buffer)
        if positions is not None and positions.shape[0] == 1:
            # the table's rows at the row's positions: each block takes its first T rows, as without positions, and no
            # block indexes by data (qwen3's TP plan makes the table a DTensor there, which compiled blocks cannot
            # index with dynamically shaped positions)
            rope, positions = rope[positions[0]], None
        for layer in self.layers.values():
            h = layer(h, rope, attention_masks, positions)
        return h

    def hidden_states(self, tokens: torch.Tensor, attention_masks=None, positions=None) -> torch.Tensor:
        """The trunk, called from outside forward (the sampler's prefill); FSDP's root hooks run as in forward."""
        return self.trunk(tokens, attention_masks, positions)

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """[B, T] log-probs of `labels`, no gradient, the vocabulary in blocks: the reference's pass, and online
        mode's old log-probs. No backward follows, so FSDP's per-iteration records are reset after it."""
        logprobs = self._logprobs(tokens, labels, **kwargs)
        internals.end_forward_only_iteration(self)
        return logprobs

    def _logprobs(self, tokens: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = self.trunk(tokens, **kwargs)
        with head_weight(self) as weight:
            return blocked_logprobs(hidden, labels, self.norm, weight, self.scoring)[0]

    def score(self, tokens: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] log-probs of `labels` and entropies (None when scoring.with_entropy is off), with gradients."""
        hidden = self.trunk(tokens, **kwargs)
        B, T_local = hidden.shape[:2]
        chunked = local_chunk(B, T_local, self.scoring) < B * T_local
        with head_comms_once(self, chunked=chunked) as head:
            return chunked_logprobs(hidden, labels, head, self.scoring)

    def fused_loss(self, tokens: torch.Tensor, labels: torch.Tensor, r, ref_logprobs: torch.Tensor | None,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The GRPO loss sum with each chunk's backward run in forward; detached [B, T] log-probs and entropies."""
        hidden = self.trunk(tokens, **kwargs)
        mask = (labels != IGNORE_INDEX).view(-1)
        old = None if r.old_logprobs is None else r.old_logprobs.view(-1)
        ref = None if ref_logprobs is None else ref_logprobs.view(-1)
        rows = r.token_rows(labels.numel())  # each token's completion, padded or padding-free

        seq = {}  # the sequence level's per-completion mean log-ratio, known before the first chunk

        def token_loss(logprobs, entropy, index):  # [N] tokens at `index` of the flattened labels
            row = rows[index]
            # as grpo_loss: behaviour log-probs where the rollouts have them, on-policy elsewhere
            old_c = logprobs.detach() if old is None else torch.where(old[index].isnan(), logprobs.detach(), old[index])
            terms = self.token_terms(logprobs[:, None], old_c[:, None], None if ref is None else ref[index][:, None],
                                     r.advantages[row], r.loss_weights[row], mask[index][:, None], entropy[:, None],
                                     **{k: v[row] for k, v in seq.items()})
            return terms.loss.sum()

        with head_weight(self) as weight:
            if self.sequence_ratio:
                seq["seq_log_ratio"] = self._mean_log_ratio(hidden, labels, weight, r.old_logprobs, rows,
                                                            r.advantages.numel())
            return fused_chunked_loss(hidden, labels, self.norm, weight, token_loss, self.scoring)

    def _mean_log_ratio(self, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                        old_logprobs: torch.Tensor | None, rows: torch.Tensor, B: int) -> torch.Tensor:
        """[B] each completion's mean of l - l_old over its tokens (`rows`: each token's completion); on-policy 0,
        else from a no-grad pass over the head.

        A chunk may hold part of a completion, so the fused pass takes the mean before its chunks:
        one more pass of the head's vocab blocks (log-probs only), no trunk recompute.
        """
        if old_logprobs is None:
            return torch.zeros(B, device=labels.device)
        mask = labels != IGNORE_INDEX
        logprobs = blocked_logprobs(hidden, labels, self.norm, weight, replace(self.scoring, with_entropy=False))[0]
        log_ratio = torch.where(mask & ~old_logprobs.isnan(), logprobs - old_logprobs, 0.0)
        per_row = partial(torch.zeros(B, dtype=log_ratio.dtype, device=labels.device).index_add, 0, rows)
        return per_row(log_ratio.view(-1)) / per_row(mask.view(-1).to(log_ratio.dtype)).clamp(min=1)

    def to_empty(self, *, device, recurse: bool = True):
        super().to_empty(device=device, recurse=recurse)
        if self.reference is not None:
            self.reference.materialize(device, recurse)
        return self

    def init_weights(self, *args, **kwargs):
        super().init_weights(*args, **kwargs)
        if self.reference is not None:
            self.reference.init_buffers(*args, **kwargs)


_GRPO_CLASSES: dict[type, type] = {}


def grpo_model_cls(base: type[nn.Module], family: str) -> type[nn.Module]:
    """GRPOModel over torchtitan's model class `base` of a FAMILIES family, made once per base."""
    if base not in _GRPO_CLASSES:
        _GRPO_CLASSES[base] = type(f"GRPO{base.__name__}", (GRPOModel, base), {"rope_buffer": FAMILIES[family]})
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
        group.set_reshard_after_forward(model.head_reshard_after_forward, recurse=False)


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
    if group is None:
        yield model.output.weight
        return
    group.unshard()
    with internals.fsdp_hooks_quiet(group):
        yield model.output.weight
    if not ties_weights(model):
        # the gradients are computed: backward needs no head (the tied embedding's group is FSDP's to reshard)
        group.reshard()


def ties_weights(model: nn.Module) -> bool:
    """Whether the output layer shares the embedding's weight (qwen3's 0.6B-4B and debug flavors)."""
    return bool(getattr(model.model_args, "enable_weight_tying", False))
