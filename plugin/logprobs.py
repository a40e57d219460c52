"""Per-token log-probs and entropy from plain or vocab-sharded logits, one function for policy and reference.

With tensor parallelism the output layer returns logits as a DTensor sharded on the vocab
dim (`Shard(-1)`). Inside `torch.distributed.tensor.parallel.loss_parallel()` DTensor runs
log_softmax / cross_entropy on the shards and all-reduces only [B, T]-sized statistics, so
the vocabulary is never gathered. torchtitan's train context enters loss_parallel when
TP > 1, and backward also runs inside it, as loss_parallel requires.
"""

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from torchtitan.components.loss import IGNORE_INDEX


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A per-token result as a plain tensor; DTensor results here are Replicate or Partial."""
    if isinstance(x, DTensor):
        # [B, T]-sized: an all-reduce for Partial, nothing for Replicate
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    return x


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # fp32 before the softmax: bf16 log-sum-exp loses ~3 digits on a 150k vocab
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def _picked(logp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logp[labels] per token, 0 at IGNORE_INDEX; nll_loss is the op loss_parallel shards."""
    nll = F.nll_loss(logp.flatten(0, 1), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX)
    return -_plain(nll).view(labels.shape)


def compute_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log p(labels[:, t] | logits[:, t]) as a plain [B, T] tensor; IGNORE_INDEX positions are 0."""
    return _picked(F.log_softmax(_scaled(logits, temperature), dim=-1), labels)


class _Entropy(torch.autograd.Function):
    """Entropy from log_softmax's output `logp`; its backward returns dH/dz = -p * (log p + H) as the gradient of `logp`.

    That vector sums to zero over the vocabulary, so log_softmax's backward hands it to the logits
    unchanged: on plain tensors it subtracts p * sum(grad) = 0, and under loss_parallel it passes
    its input through (it assumes an nll_loss backward did the softmax part, which is also why
    autograd through the entropy's own ops would be wrong on sharded logits). Only H, already
    replicated, crosses ranks; `logp` is the tensor nll_loss saves anyway.
    """

    @staticmethod
    def forward(ctx, logp):
        # the vocab sum of a Shard(-1) DTensor is Partial: reducing it is an all-reduce of [B, T]
        entropy = -(logp.exp() * logp).sum(-1)
        if isinstance(entropy, DTensor):
            entropy = entropy.redistribute(placements=[Replicate()] * entropy.device_mesh.ndim)
        ctx.save_for_backward(logp, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad):
        logp, entropy = ctx.saved_tensors
        return -grad.unsqueeze(-1) * logp.exp() * (logp + entropy.unsqueeze(-1))


def compute_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [B, T] log-probs of `labels` and entropies from one log_softmax of the logits.

    Without `entropy_grad` the entropy is a statistic and carries no gradient.
    """
    logp = F.log_softmax(_scaled(logits, temperature), dim=-1)  # [B, T, V], Shard(-1) under loss_parallel
    logprobs = _picked(logp, labels)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = _Entropy.apply(logp if entropy_grad else logp.detach())
    return logprobs, _plain(entropy)


def compute_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 entropy of softmax(logits / temperature) per position, [B, T], plain tensor."""
    return _plain(_Entropy.apply(F.log_softmax(_scaled(logits, temperature), dim=-1)))


_compiled: dict[object, object] = {}


def maybe_compiled(fn, enabled: bool, backend: str = "inductor"):
    """`fn` compiled once per (function, backend) when `enabled`, else `fn` itself."""
    if not enabled:
        return fn
    if (fn, backend) not in _compiled:
        _compiled[fn, backend] = torch.compile(fn, backend=backend)
    return _compiled[fn, backend]


def _score_chunk(head, h, labels, temperature, compiled, backend, entropy_grad, with_entropy=True):
    """Log-probs and entropy (None without `with_entropy`) of one chunk; its logits live only inside this call."""
    logits = head(h)  # [B, k, V], or a Shard(-1) DTensor under loss_parallel
    if not with_entropy:
        return maybe_compiled(compute_logprobs, compiled, backend)(logits, labels, temperature), None
    # entropy is a logged statistic unless the loss has an entropy bonus
    return maybe_compiled(compute_logprobs_and_entropy, compiled, backend)(logits, labels, temperature, entropy_grad)


def chunk_tokens_for(budget_mib: float, vocab_size: int, seq_shards: int = 1) -> int:
    """Tokens per chunk whose fp32 logits on one rank fit in `budget_mib` MiB; 0 (no budget): all at once.

    A chunk of N tokens gives each rank fp32 logits of N x ceil(V / S); the result is a multiple of S.
    """
    if budget_mib <= 0:
        return 0
    tokens = int(budget_mib * 2**20) // (4 * -(-vocab_size // seq_shards))
    return max(seq_shards, tokens // seq_shards * seq_shards)


def local_chunk(batch: int, local_len: int, seq_shards: int, chunk_size: int = 0, chunk_tokens: int = 0) -> int:
    """This rank's tokens per chunk: `chunk_size` positions of each sequence, else `chunk_tokens` of the batch."""
    if chunk_size > 0:
        return batch * max(1, chunk_size // seq_shards)
    if chunk_tokens > 0:
        return max(1, chunk_tokens // seq_shards)
    return batch * local_len


def chunked_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = 0,
    chunk_tokens: int = 0,
    seq_shards: int = 1,
    compiled: bool = False,
    backend: str = "inductor",
    entropy_grad: bool = False,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probs of `labels` and entropies from trunk states, scoring one chunk of tokens at a time.

    Args:
        hidden: [B, T / seq_shards, D], this rank's sequence shard of the trunk output.
        labels: [B, T], the full sequence's labels (replicated across TP ranks).
        head: hidden chunk -> logits (final norm + output layer, possibly vocab-parallel).
        chunk_size: global sequence positions per chunk, of every sequence (B * chunk_size tokens); 0: see chunk_tokens.
        chunk_tokens: tokens (batch x positions, all ranks) per chunk, whatever the batch size; 0 with
            chunk_size 0 scores everything at once.
        seq_shards: ranks the sequence is sharded over (the TP degree under sequence parallelism).
        compiled, backend: torch.compile the log-prob and entropy computation with this backend ([compile] backend).
        entropy_grad: let gradients flow through the entropy (for an entropy bonus).
        with_entropy: compute the entropy at all (the reference's pass does not); None in its place otherwise.
    """
    B, T = labels.shape
    S, T_local = seq_shards, hidden.shape[1]
    if T_local * S != T:
        raise ValueError(f"hidden has {T_local} positions per rank; labels need {T} / {S}")
    # This rank's B sequence shards as one sequence of n tokens, so a chunk counts tokens, not
    # positions. Under sequence parallelism, giving each rank's tokens [c, c+k) to the output layer
    # yields logits for tokens [c, c+k) of every rank, rank-major; the labels are laid out the same way.
    n = B * T_local
    flat_hidden = hidden.reshape(1, n, hidden.shape[-1])  # [1, n, D]
    labels_by_shard = labels.view(B, S, T_local).transpose(0, 1).reshape(S, n)  # [S, n]
    k = local_chunk(B, T_local, S, chunk_size, chunk_tokens)
    # with several chunks, recompute each in backward so its logits are freed after its forward
    recompute = torch.is_grad_enabled() and k < n
    logprobs, entropy = [], []
    for start in range(0, n, k):
        h_c = flat_hidden[:, start : start + k]
        labels_c = labels_by_shard[:, start : start + k].reshape(1, -1)
        if recompute:
            lp, ent = checkpoint(_score_chunk, head, h_c, labels_c, temperature, compiled, backend, entropy_grad,
                                 with_entropy, use_reentrant=False)
        else:
            lp, ent = _score_chunk(head, h_c, labels_c, temperature, compiled, backend, entropy_grad, with_entropy)
        logprobs.append(lp.view(S, -1))
        if with_entropy:
            entropy.append(ent.view(S, -1))

    def unflatten(chunks):  # [S, n] pieces -> [B, T]
        return torch.cat(chunks, dim=1).view(S, B, T_local).transpose(0, 1).reshape(B, T)

    return unflatten(logprobs), unflatten(entropy) if with_entropy else None


class _FusedChunks(torch.autograd.Function):
    """A loss whose gradients were computed in forward: backward only scales them by the incoming gradient.

    `run` returns the loss, d loss / d hidden, d loss / d each of `params`, and per-token log-probs
    and entropies (outputs without gradient). Autograd hands the parameters' gradients to their
    .grad like any other, accumulated over gradient-accumulation microbatches.
    """

    @staticmethod
    def forward(ctx, hidden, run, *params):
        loss, grad_hidden, grads, logprobs, entropy = run(hidden)
        ctx.save_for_backward(grad_hidden, *grads)
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(ctx, grad, _logprobs, _entropy):
        grad_hidden, *grads = ctx.saved_tensors
        return grad * grad_hidden, None, *(grad * g for g in grads)


def fused_chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    token_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = 0,
    chunk_tokens: int = 0,
    seq_shards: int = 1,
    compiled: bool = False,
    backend: str = "inductor",
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-token loss summed over the batch, with each chunk's forward and backward run in forward.

    Each chunk's logits live only while its loss and gradients (for the hidden states and `params`,
    the head's parameters) are computed, so nothing is recomputed in backward. The loss must be a
    sum of per-token terms: `token_loss(logprobs, entropy, index)` gets a chunk's [N] log-probs and
    entropies and their [N] positions in the flattened [B, T] labels, and returns their loss sum.

    Returns the loss (differentiable to `hidden` and `params`) and detached [B, T] log-probs and entropies.
    Arguments as chunked_logprobs'.
    """
    B, T = labels.shape
    S, T_local = seq_shards, hidden.shape[1]
    if T_local * S != T:
        raise ValueError(f"hidden has {T_local} positions per rank; labels need {T} / {S}")
    n = B * T_local
    # the token layout of chunked_logprobs: this rank's B sequence shards as one sequence, rank-major chunks
    index_by_shard = torch.arange(B * T, device=labels.device).view(B, S, T_local).transpose(0, 1).reshape(S, n)
    k = local_chunk(B, T_local, S, chunk_size, chunk_tokens)
    score = maybe_compiled(compute_logprobs_and_entropy, compiled, backend)

    def run(hidden):
        flat_hidden = hidden.detach().reshape(1, n, hidden.shape[-1])  # [1, n, D]
        grad_hidden = torch.zeros_like(flat_hidden)
        grads = [None] * len(params)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logprobs, entropy = torch.zeros(B * T, device=labels.device), torch.zeros(B * T, device=labels.device)
        for start in range(0, n, k):
            h_c = flat_hidden[:, start : start + k].requires_grad_()
            index = index_by_shard[:, start : start + k].reshape(-1)  # [S * k] positions in [B * T]
            with torch.enable_grad():
                lp, ent = score(head(h_c), labels.view(-1)[index].view(1, -1), temperature, entropy_grad)
                loss_c = token_loss(lp.view(-1), ent.view(-1), index)
                # under loss_parallel (train_context) this backward is one too
                g_h, *g_params = torch.autograd.grad(loss_c, [h_c, *params])
            grad_hidden[:, start : start + k] = g_h
            # out of place: a DTensor gradient may come Partial (a replicated norm weight's under TP);
            # fp32, as FSDP accumulates a bf16 parameter's gradient between reduce-scatters
            grads = [g.float() if acc is None else acc + g for acc, g in zip(grads, g_params)]
            loss += loss_c.detach()
            logprobs[index], entropy[index] = lp.detach().view(-1), ent.detach().view(-1)
        return loss, grad_hidden.view_as(hidden), grads, logprobs.view(B, T), entropy.view(B, T)

    return _FusedChunks.apply(hidden, run, *params)


def isolate_compile_cache(rank: int) -> None:
    """Give each rank its own inductor/AOTAutograd cache directory.

    The AOTAutograd cache key does not tell ranks apart, so with a cache shared by the TP ranks
    one rank reuses a graph that has the other rank's vocab range baked in, and log-probs come
    out silently wrong (pytorch/pytorch#188390; tests/test_logprobs.py shows it).
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base = cache_dir()
    if os.path.basename(base).startswith("rank_"):
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank_{rank}")
