"""Per-token log-probs and entropy from plain or vocab-sharded logits, one function for policy and reference.

With tensor parallelism the output layer returns logits as a DTensor sharded on the vocab
dim (`Shard(-1)`). Inside `torch.distributed.tensor.parallel.loss_parallel()` DTensor runs
log_softmax / cross_entropy on the shards and all-reduces only [B, T]-sized statistics, so
the vocabulary is never gathered. torchtitan's train context enters loss_parallel when
TP > 1, and backward also runs inside it, as loss_parallel requires.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.checkpoint import checkpoint
from torchtitan.components.loss import IGNORE_INDEX

from plugin.runtime import internals


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


VOCAB_BLOCK = 4096  # output-layer rows per block: a chunk's temporaries are [tokens, VOCAB_BLOCK], whatever V


@dataclass(frozen=True)
class Scoring:
    """How log-probs are scored: one object from the config to every scoring function here."""

    temperature: float = 1.0
    chunk_size: int = 0  # global sequence positions per chunk, of every sequence (B * chunk_size tokens); 0: chunk_tokens
    chunk_tokens: int = 0  # tokens (batch x positions, all ranks) per chunk; 0 with chunk_size 0: all at once
    seq_shards: int = 1  # ranks the trunk output is sequence-sharded over (the TP degree under sequence parallelism)
    compiled: bool = False  # torch.compile the log-prob, entropy and vocab-block computations
    backend: str = "inductor"  # [compile] backend
    with_entropy: bool = True  # compute the entropy at all (the reference's pass does not); None in its place otherwise
    entropy_grad: bool = False  # let gradients flow through the entropy (an entropy bonus)
    vocab_block: int = VOCAB_BLOCK  # output-layer rows per block of the blocked and fused passes


_compiled: dict[object, object] = {}
# whether a compiled Scoring also compiles the log-probs of vocab-sharded (DTensor) logits: off, see _score_chunk;
# tests turn it on to show what a shared compile cache does to such a graph (tests/test_logprobs.py), and
# benchmarks/logprob_memory.py for its compiled loss_parallel baselines, whose shapes do not vary
COMPILE_SHARDED_LOGITS = False


def maybe_compiled(fn, enabled: bool, backend: str = "inductor", varying: tuple[int, ...] = ()):
    """`fn` compiled once per (function, backend, varying) when `enabled`, else `fn` itself.

    `varying`: the dims of its plain tensor arguments whose size changes between calls (a chunk's tokens, a
    batch's length), each traced as any size from the first call. Else dynamo specializes the first graph
    on the first call's sizes and compiles again at the first other size (a batch's last, shorter chunk),
    before it makes the dim dynamic itself.
    """
    if not enabled:
        return fn
    key = (fn, backend, varying)
    if key not in _compiled:
        compiled = torch.compile(fn, backend=backend)

        def marked(*args, **kwargs):
            # plain tensors only: a DTensor's graph fails to compile once its sizes are dynamic (_score_chunk)
            internals.lengths_vary(*[(a, d) for a in args if type(a) is torch.Tensor for d in varying if d < a.dim()])
            return compiled(*args, **kwargs)

        _compiled[key] = marked if varying else compiled
    return _compiled[key]


def _score_chunk(head, h, labels, scoring: Scoring):
    """Log-probs and entropy (None without `with_entropy`) of one chunk; its logits live only inside this call."""
    logits = head(h)  # [1, k, V], or a Shard(-1) DTensor under loss_parallel; k varies (a batch's last chunk)
    s = scoring
    # vocab-sharded logits are scored eagerly: once a DTensor's token count varies (the next batch, a shorter last
    # chunk), torch 2.13 fails to compile the graph (RecursionError in make_fx's proxy thunks, marked dynamic up
    # front or not); the fused pass and the reference's blocks compile their vocab shards as plain tensors
    compiled = s.compiled and (COMPILE_SHARDED_LOGITS or not isinstance(logits, DTensor))
    if not s.with_entropy:
        return maybe_compiled(compute_logprobs, compiled, s.backend, (1,))(logits, labels, s.temperature), None
    # entropy is a logged statistic unless the loss has an entropy bonus
    return maybe_compiled(compute_logprobs_and_entropy, compiled, s.backend, (1,))(
        logits, labels, s.temperature, s.entropy_grad)


def chunk_tokens_for(budget_mib: float, vocab_size: int, seq_shards: int = 1) -> int:
    """Tokens per chunk whose fp32 logits on one rank fit in `budget_mib` MiB; 0 (no budget): all at once.

    A chunk of N tokens gives each rank fp32 logits of N x ceil(V / S); the result is a multiple of S.
    """
    if budget_mib <= 0:
        return 0
    tokens = int(budget_mib * 2**20) // (4 * -(-vocab_size // seq_shards))
    return max(seq_shards, tokens // seq_shards * seq_shards)


def local_chunk(batch: int, local_len: int, scoring: Scoring) -> int:
    """This rank's tokens per chunk: `chunk_size` positions of each sequence, else `chunk_tokens` of the batch."""
    if scoring.chunk_size > 0:
        return batch * max(1, scoring.chunk_size // scoring.seq_shards)
    if scoring.chunk_tokens > 0:
        return max(1, scoring.chunk_tokens // scoring.seq_shards)
    return batch * local_len


def _token_layout(hidden: torch.Tensor, labels: torch.Tensor, scoring: Scoring):
    """This rank's n tokens, its tokens per chunk k, and the [S, n] positions in the flattened [B, T] labels.

    This rank's B sequence shards are one sequence of n tokens, so a chunk counts tokens, not
    positions. Under sequence parallelism, giving each rank's tokens [c, c+k) to the output layer
    yields logits for tokens [c, c+k) of every rank, rank-major; the positions are laid out the same way.
    """
    B, T = labels.shape
    S, T_local = scoring.seq_shards, hidden.shape[1]
    if T_local * S != T:
        raise ValueError(f"hidden has {T_local} positions per rank; labels need {T} / {S}")
    n = B * T_local
    index_by_shard = torch.arange(B * T, device=labels.device).view(B, S, T_local).transpose(0, 1).reshape(S, n)
    return n, local_chunk(B, T_local, scoring), index_by_shard


def chunked_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    scoring: Scoring = Scoring(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probs of `labels` and entropies from trunk states, scoring one chunk of tokens at a time.

    Args:
        hidden: [B, T / seq_shards, D], this rank's sequence shard of the trunk output.
        labels: [B, T], the full sequence's labels (replicated across TP ranks).
        head: hidden chunk -> logits (final norm + output layer, possibly vocab-parallel).
        scoring: temperature, chunking, sequence shards, compile and entropy options (see Scoring).
    """
    B, T = labels.shape
    S, T_local = scoring.seq_shards, hidden.shape[1]
    n, k, index_by_shard = _token_layout(hidden, labels, scoring)
    flat_hidden = hidden.reshape(1, n, hidden.shape[-1])  # [1, n, D]
    labels_by_shard = labels.view(-1)[index_by_shard]  # [S, n]
    # with several chunks, recompute each in backward so its logits are freed after its forward
    recompute = torch.is_grad_enabled() and k < n
    logprobs, entropy = [], []
    for start in range(0, n, k):
        h_c = flat_hidden[:, start : start + k]
        labels_c = labels_by_shard[:, start : start + k].reshape(1, -1)
        if recompute:
            lp, ent = checkpoint(_score_chunk, head, h_c, labels_c, scoring, use_reentrant=False)
        else:
            lp, ent = _score_chunk(head, h_c, labels_c, scoring)
        logprobs.append(lp.view(S, -1))
        if scoring.with_entropy:
            entropy.append(ent.view(S, -1))

    def unflatten(chunks):  # [S, n] pieces -> [B, T]
        return torch.cat(chunks, dim=1).view(S, B, T_local).transpose(0, 1).reshape(B, T)

    return unflatten(logprobs), unflatten(entropy) if scoring.with_entropy else None


class _FusedChunks(torch.autograd.Function):
    """A loss whose gradients were computed in forward: backward only scales them by the incoming gradient.

    `run` returns the loss, d loss / d hidden, d loss / d each of `params`, and per-token log-probs
    and entropies (outputs without gradient). Autograd hands the parameters' gradients to their
    .grad like any other, accumulated over gradient-accumulation microbatches.
    """

    @staticmethod
    def forward(ctx, hidden, run, *params):
        loss, ctx.grad_hidden, ctx.grads, logprobs, entropy = run(hidden)
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(ctx, grad, _logprobs, _entropy):
        # scaled in place, not copied: a second copy of the output weight's gradient would be the pass's peak
        grads, ctx.grads = [g.mul_(grad) for g in ctx.grads], None
        return ctx.grad_hidden.mul_(grad), None, *grads


def _block_stats(z, index, m, s, u, picked, temperature):
    """One vocab block's logits `z` [N, Vb] into the running max `m`, sum of exp `s`, sum of exp * logit `u` (the
    entropy's; None: not computed) and label logit, per token."""
    z = _scaled(z, temperature)
    m_new = torch.maximum(m, z.amax(-1))
    e = torch.exp(z - m_new[:, None])
    scale = torch.exp(m - m_new)
    hit = (index >= 0) & (index < z.shape[1])  # the label is in this block
    label_logit = z.gather(1, index.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    u = None if u is None else u * scale + (e * z).sum(-1)
    return m_new, s * scale + e.sum(-1), u, torch.where(hit, label_logit, picked)


def _block_grad(z, index, lse, entropy, d_logprob, d_entropy, temperature, dtype):
    """d loss / d logits of one vocab block, in `dtype`, from the loss's per-token derivatives."""
    logp = _scaled(z, temperature) - lse[:, None]
    p = logp.exp()
    # d logprob / dz = onehot - p; d entropy / dz = -p * (log p + H)
    dz = -p * (d_logprob[:, None] + d_entropy[:, None] * (logp + entropy[:, None]))
    hit = (index >= 0) & (index < z.shape[1])
    dz = dz.scatter_add(1, index.clamp(0, z.shape[1] - 1)[:, None], torch.where(hit, d_logprob, 0.0)[:, None])
    return (dz / temperature).to(dtype)


class _Vocab:
    """The output layer's weight [V, D] as blocks of this rank's rows (its Shard(0) under TP), and the TP group."""

    def __init__(self, weight: torch.Tensor, scoring: Scoring):
        self.sharded = isinstance(weight, DTensor)
        self.w = weight.to_local() if self.sharded else weight  # [V / S, D]
        self.group = weight.device_mesh.get_group() if self.sharded else None
        # DTensor's Shard(0): ceil(V / S) rows a rank, the last ranks' fewer
        self.offset = weight.device_mesh.get_local_rank() * -(-weight.shape[0] // weight.device_mesh.size()) \
            if self.sharded else 0
        block = scoring.vocab_block
        self.blocks = [(v, self.w[v : v + block]) for v in range(0, self.w.shape[0], block)]
        self.temperature = scoring.temperature
        # their arguments' dim 0 is a chunk's tokens
        self.block_stats, self.block_grad = (maybe_compiled(f, scoring.compiled, scoring.backend, (0,))
                                             for f in (_block_stats, _block_grad))
        self.buffer = None
        # the gradient products' operands: CUDA multiplies bf16 into fp32 (mm's out_dtype); the CPU has no such
        # kernel (torch 2.13), so there they are fp32
        self.product_dtype = self.w.dtype if self.w.device.type == "cuda" else torch.float32

    def logits(self, x: torch.Tensor, w_b: torch.Tensor) -> torch.Tensor:
        """x @ w_b.T [N, Vb], into one buffer that every block reuses: on CPU glibc may map and page-fault a
        fresh allocation of this size each time (always under the benchmarks' MALLOC_MMAP_THRESHOLD_)."""
        size = x.shape[0] * w_b.shape[0]
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.promote_types(x.dtype, w_b.dtype), device=x.device)
        return torch.mm(x, w_b.T, out=self.buffer[:size].view(x.shape[0], w_b.shape[0]))

    def stats(self, x: torch.Tensor, label: torch.Tensor, with_entropy: bool = True):
        """[N] log-sum-exp, log-probs of `label` (0 at IGNORE_INDEX) and entropies (None without `with_entropy`)
        over the whole vocabulary.

        A running log-sum-exp over this rank's blocks, then across TP ranks, which exchange
        only [N]-sized statistics, the reductions loss_parallel makes.
        """
        N = x.shape[0]
        m = torch.full((N,), float("-inf"), device=x.device)
        # each its own tensor: as views of one, the second's storage offset would be N, which a compiled
        # block_stats traced with N dynamic guards on, so the next call (fresh outputs) would recompile it
        s, picked = torch.zeros(N, device=x.device), torch.zeros(N, device=x.device)
        u = torch.zeros(N, device=x.device) if with_entropy else None
        for v, w_b in self.blocks:
            m, s, u, picked = self.block_stats(self.logits(x, w_b), label - self.offset - v, m, s, u, picked,
                                               self.temperature)
        if self.group is not None:
            m_all = m.clone()
            torch.distributed.all_reduce(m_all, torch.distributed.ReduceOp.MAX, group=self.group)
            scale = torch.exp(m - m_all)
            # a label's logit is on one rank, 0 on the others
            sums = torch.stack([picked, s * scale] + ([] if u is None else [u * scale]))
            torch.distributed.all_reduce(sums, group=self.group)
            m, picked, s = m_all, sums[0], sums[1]
            u = None if u is None else sums[2]
        lse = m + s.log()
        return lse, torch.where(label == IGNORE_INDEX, 0.0, picked - lse), None if u is None else lse - u / s

    def logit_grad(self, v, w_b, x, label, lse, entropy, d_logprob, d_entropy):
        """d loss / d logits [N, Vb] of the block of rows [v, v + Vb), in `product_dtype`."""
        return self.block_grad(self.logits(x, w_b), label - self.offset - v, lse, entropy, d_logprob, d_entropy,
                               self.temperature, self.product_dtype)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32, so that a product is not rounded to bf16 before it is summed with others: from bf16
    operands with mm's `out_dtype` (CUDA, torch >= 2.8), else from fp32 operands (_Vocab.product_dtype)."""
    return a @ b if a.dtype == torch.float32 else torch.mm(a, b, out_dtype=torch.float32)


def _head_input(norm: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """norm(h) [1, k, D] as the output layer's input: under TP the whole chunk on every rank."""
    x = norm(h)  # Shard(1) under TP
    if isinstance(x, DTensor):
        # each rank's part of its gradient covers that rank's vocab shard, and the ranks' parts add up
        x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    return x


@torch.no_grad()
def blocked_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    norm: torch.nn.Module,
    weight: torch.Tensor,
    scoring: Scoring = Scoring(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """chunked_logprobs without gradients (the reference's pass), each chunk's logits made `vocab_block` rows at a time.

    Without `with_entropy` nothing of the entropy is computed.

    Its temporaries are [tokens, vocab_block], whatever V. The head is `norm` and a bias-free
    output layer of `weight`, as fused_chunked_loss's; other arguments as chunked_logprobs'.
    """
    B, T = labels.shape
    with_entropy = scoring.with_entropy
    n, k, index_by_shard = _token_layout(hidden, labels, scoring)
    vocab = _Vocab(weight, scoring)
    flat_hidden = hidden.reshape(1, n, hidden.shape[-1])  # [1, n, D]
    logprobs, entropy = torch.zeros(2, B * T, device=labels.device)
    for start in range(0, n, k):
        index = index_by_shard[:, start : start + k].reshape(-1)  # [S * k] positions in [B * T]
        x = _head_input(norm, flat_hidden[:, start : start + k])
        _, logprobs[index], ent = vocab.stats(x.view(-1, x.shape[-1]), labels.view(-1)[index], with_entropy)
        if with_entropy:
            entropy[index] = ent
    return logprobs.view(B, T), entropy.view(B, T) if with_entropy else None


def fused_chunked_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    norm: torch.nn.Module,
    weight: torch.Tensor,
    token_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    scoring: Scoring = Scoring(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-token loss summed over the batch, with each chunk's forward and backward run in forward.

    The head is `norm` (hidden -> the output layer's input) and a bias-free output layer of
    `weight` [V, D], a Shard(0) DTensor under TP. A chunk's logits are made `vocab_block` rows
    of the weight (of this rank's shard under TP) at a time, twice: chunk by chunk, a running
    log-sum-exp with the entropy's sum of p * logit (as blocked_logprobs), which gives the loss
    and its per-token derivatives; then block by block over every chunk, d loss / d logits and
    its products with the weight block and the output layer's input, in fp32, so that each
    gradient is rounded to the weight's dtype once. Until then the output layer's input and its
    fp32 gradient are held for the whole microbatch ([tokens, D]; under TP, the gathered
    sequence). Nothing is recomputed in backward. The loss must be a sum of per-token terms: `token_loss(logprobs,
    entropy, index)` gets a chunk's [N] log-probs and entropies and their [N] positions in the
    flattened [B, T] labels, and returns their loss sum.

    Returns the loss (differentiable to `hidden`, `norm`'s parameters and `weight`) and detached
    [B, T] log-probs and entropies (always computed: the loss may use them); `scoring.entropy_grad`
    lets the loss's gradient flow through the entropy. Arguments as chunked_logprobs'.
    """
    B, T = labels.shape
    entropy_grad = scoring.entropy_grad
    n, k, index_by_shard = _token_layout(hidden, labels, scoring)
    params = [*(p for p in norm.parameters() if p.requires_grad), weight]
    vocab = _Vocab(weight, scoring)

    def run(hidden):
        flat_hidden = hidden.detach().reshape(1, n, hidden.shape[-1])  # [1, n, D]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        logprobs, entropy = torch.zeros(2, B * T, device=labels.device)
        chunks = []
        # a chunk at a time: the output layer's input, the running log-sum-exp, the loss and its per-token derivatives
        for start in range(0, n, k):
            h_c = flat_hidden[:, start : start + k].requires_grad_()
            index = index_by_shard[:, start : start + k].reshape(-1)  # [S * k] positions in [B * T]
            label = labels.view(-1)[index]
            with torch.enable_grad():
                x = _head_input(norm, h_c)
            x_c = x.detach().view(-1, x.shape[-1])  # [N, D]
            lse, lp, ent = vocab.stats(x_c, label)
            lp, ent = lp.requires_grad_(), ent.requires_grad_()
            with torch.enable_grad():
                loss_c = token_loss(lp, ent if entropy_grad else ent.detach(), index)
            d_lp, d_ent = torch.autograd.grad(loss_c, [lp, ent], allow_unused=True, materialize_grads=True)
            d_lp = torch.where(label == IGNORE_INDEX, 0.0, d_lp)
            loss += loss_c.detach()
            logprobs[index], entropy[index] = lp.detach(), ent.detach()
            chunks.append((h_c, x, x_c, x_c.to(vocab.product_dtype), (label, lse, ent.detach(), d_lp, d_ent)))
        # a vocab block at a time, over every chunk. The products come out in fp32 and are summed in fp32: each
        # block's weight gradient over all tokens, each chunk's input gradient over all blocks; each is rounded
        # to the weight's dtype once, as one matmul over the whole batch or vocabulary would round it.
        grad_xs = [torch.zeros_like(x_c, dtype=torch.float32) for _, _, x_c, _, _ in chunks]
        grad_w = torch.empty_like(vocab.w)
        for v, w_b in vocab.blocks:
            w_op = w_b.to(vocab.product_dtype)
            grad_w_b = torch.zeros_like(w_b, dtype=torch.float32)
            for (_, _, x_c, x_op, terms), grad_x in zip(chunks, grad_xs):
                g = vocab.logit_grad(v, w_b, x_c, *terms)  # [N, Vb]
                grad_x += _mm_fp32(g, w_op)
                grad_w_b += _mm_fp32(g.T, x_op)
            grad_w[v : v + w_b.shape[0]] = grad_w_b
        # back through the norm (under TP, each rank's part of the gathered chunk), a chunk at a time
        grad_hidden = torch.empty_like(flat_hidden)
        grads = [None] * (len(params) - 1)
        for start, (h_c, x, *_), grad_x in zip(range(0, n, k), chunks, grad_xs):
            g_h, *g_norm = torch.autograd.grad(x, [h_c, *params[:-1]], grad_x.to(x.dtype).view_as(x))
            grad_hidden[:, start : start + k] = g_h
            # out of place: a DTensor gradient may come Partial (a replicated norm weight's under TP)
            grads = [g if acc is None else acc + g for acc, g in zip(grads, g_norm)]
        if vocab.sharded:
            grad_w = DTensor.from_local(grad_w, weight.device_mesh, weight.placements, shape=weight.shape,
                                        stride=weight.stride())
        return loss, grad_hidden.view_as(hidden), [*grads, grad_w], logprobs.view(B, T), entropy.view(B, T)

    return _FusedChunks.apply(hidden, run, *params)

