"""Padding-free attention ([grpo] padding_free): each sequence of a packed row attends only to itself.

A packed microbatch is one row [1, T] of whole sequences laid end to end, their positions
restarting at 0 at each sequence (plugin.data.batch). torchtitan's Attention takes sequence
boundaries as a `VarlenMetadata` when its `attn_type` is "varlen"; `use_packed_attention` sets
that on every block and makes a `PackedAttention` its `inner_attention`:
- CUDA in bf16/fp16: torch's variable-length flash kernel (torch.nn.attention.varlen), as torchtitan's varlen.
- elsewhere: SDPA over buckets of sequences of similar lengths, each right-padded to its bucket's
  longest, the fast path on CPU (flex attention has no CPU backward, and one dense block-diagonal
  [T, T] mask gives much of the gain back). Under torch.compile it is one opaque custom op: the
  sequence lengths are data, not shapes.
The boundaries come from the plugin's positions, never from EOS ids: a completion's closing EOS is
not in the input, and chat templates put `<|im_end|>` inside prompts.
"""

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.attention.varlen import varlen_attn
from torchtitan.models.attention import VarlenMetadata

# torch 2.13's varlen_attn takes `enable_gqa`; 2.11's, this package's oldest torch (the H200 image's), does not
VARLEN_TAKES_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters


def sequence_bounds(tokens: torch.Tensor, positions: torch.Tensor | None) -> VarlenMetadata:
    """The sequences of a [B, T] batch as varlen boundaries over its B * T flattened tokens.

    A packed row ([1, T] with positions) starts a sequence wherever its positions restart at 0;
    otherwise each of the B rows is one sequence (right-padding only ever follows a row's tokens).
    """
    B, T = tokens.shape
    if positions is not None and B == 1:
        starts = torch.nonzero(positions.view(-1) == 0).view(-1)
        cu = torch.cat([starts, starts.new_tensor([T])]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
    else:
        cu, longest = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=tokens.device), T
    return VarlenMetadata(cu, cu, longest, longest)


# a bucket of sequences padded to its longest costs at most this much more attention than each sequence alone; the
# constant (a 64-token sequence's) batches short sequences whatever their spread: a call costs more than their math
BUCKET_SLACK, BUCKET_FREE = 1.3, 64 * 64


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """The sequences as buckets of similar lengths, longest first: each bucket is one batched SDPA call."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets, cost = [], 0
    for i in order:
        if buckets:
            longest, n = lengths[buckets[-1][0]], len(buckets[-1]) + 1
            if n * longest * longest <= BUCKET_SLACK * (cost + lengths[i] ** 2) + BUCKET_FREE:
                buckets[-1].append(i)
                cost += lengths[i] ** 2
                continue
        buckets.append([i])
        cost = lengths[i] ** 2
    return buckets


def _attend_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
    """Causal SDPA of each sequence [bounds[i], bounds[i+1]) of [N, H, hd] q and [N, H_kv, hd] k, v, on its own.

    Sequences of similar lengths go through SDPA together, each right-padded to the bucket's
    longest: its padding comes after its tokens, so causal attention never lets a token see it.
    """
    gqa = q.shape[1] != k.shape[1]
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    where, values = [], []
    for bucket in length_buckets(lengths):
        longest = lengths[bucket[0]]
        offsets = torch.arange(longest, device=q.device)
        first = torch.tensor([starts[i] for i in bucket], device=q.device)
        lens = torch.tensor([lengths[i] for i in bucket], device=q.device)
        real = offsets[None] < lens[:, None]  # [n, longest]
        # a padded slot reads the sequence's first token: any real token would do, none is attended to
        index = first[:, None] + torch.where(real, offsets[None], 0)
        piece = [t[index].transpose(1, 2) for t in (q, k, v)]  # [n, H, longest, hd]
        o = F.scaled_dot_product_attention(*piece, is_causal=True, scale=scale, enable_gqa=gqa).transpose(1, 2)
        where.append(index[real])
        values.append(o[real])
    # the buckets cover every token once: one scatter into the packed layout
    return q.new_empty(q.shape).index_put((torch.cat(where),), torch.cat(values))


@torch.library.custom_op("grpo::attend_each", mutates_args=())
def _attend_each_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    return _attend_each(q, k, v, cu_seqlens.tolist(), scale).contiguous()


@_attend_each_op.register_fake
def _(q, k, v, cu_seqlens, scale):
    return torch.empty_like(q)


@torch.library.custom_op("grpo::attend_each_backward", mutates_args=())
def _attend_each_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_attend_each's gradients, the forward recomputed per sequence in fp32 or wider (the op kept only its inputs);
    an op's body runs below autograd, so the softmax's backward is written out."""
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    dtype = torch.promote_types(q.dtype, torch.float32)
    rep = q.shape[1] // k.shape[1]  # query heads per KV head: query head h reads KV head h // rep
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs, go = (t[start:end].transpose(0, 1).to(dtype) for t in (q, k, v, grad))  # [heads, L, hd]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        L = end - start
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax((qs @ ks.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")), dim=-1)  # [H, L, L]
        dp = go @ vs.transpose(1, 2)
        ds = p * (dp - (go * (p @ vs)).sum(-1, keepdim=True))  # the softmax's backward
        per_kv = lambda x: x.view(-1, rep, L, x.shape[-1]).sum(1).transpose(0, 1)  # noqa: E731  [L, H_kv, hd]
        dq[start:end] = (ds @ ks * scale).transpose(0, 1)
        dk[start:end] = per_kv(ds.transpose(1, 2) @ qs * scale)
        dv[start:end] = per_kv(p.transpose(1, 2) @ go)
    return dq, dk, dv


@_attend_each_backward.register_fake
def _(grad, q, k, v, cu_seqlens, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)


def _backward(ctx, grad):
    q, k, v, cu_seqlens = ctx.saved_tensors
    return *_attend_each_backward(grad, q, k, v, cu_seqlens, ctx.scale), None, None


_attend_each_op.register_autograd(_backward, setup_context=_setup)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: VarlenMetadata, scale: float) -> torch.Tensor:
    """torch's varlen kernel, causal; grouped-query KV heads through `enable_gqa` where torch has it."""
    gqa = {}
    if q.shape[1] != k.shape[1]:
        if VARLEN_TAKES_GQA:
            gqa = dict(enable_gqa=True)
        else:  # torch < 2.13 (the H200 image's 2.11): each KV head repeated for its query heads, as SDPA's GQA reads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, bounds.cu_seq_q, bounds.cu_seq_k, bounds.max_q, bounds.max_k, scale=scale,
                       window_size=(-1, 0), **gqa)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: VarlenMetadata,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of `bounds`: [N, H, hd] q, [N, H_kv, hd] k and v -> [N, H, hd]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # the flash kernel's dtypes
        return _varlen(q, k, v, bounds, scale)
    if torch.compiler.is_compiling():
        # one opaque op for any lengths: a branch on max_q here would make every new longest length a recompile
        return _attend_each_op(q, k, v, bounds.cu_seq_q, scale)
    n_seqs = bounds.cu_seq_q.numel() - 1
    if bounds.max_q * n_seqs == q.shape[0]:
        # equal lengths (a padded batch): one batched call
        q, k, v = (t.view(n_seqs, bounds.max_q, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).flatten(0, 1)
    return _attend_each(q, k, v, bounds.cu_seq_q.tolist(), scale)


class PackedAttention(nn.Module):
    """An Attention's `inner_attention` for varlen boundaries: [B, H, T, hd] q, k, v -> [B * T, H, hd]."""

    def forward(self, q, k, v, attention_masks: VarlenMetadata, scale: float | None = None):
        mesh = placements = None
        if isinstance(q, DTensor):  # qwen3's TP plan hands head-sharded DTensors; attention never mixes heads
            mesh, placements = q.device_mesh, q.placements
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        # torchtitan views the result as [B, T, H * hd]
        out = packed_attention(*(t.transpose(1, 2).flatten(0, 1) for t in (q, k, v)), attention_masks, scale).contiguous()
        if mesh is not None:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return out


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules: those with an `inner_attention` submodule (the plugin's model-family contract).

    Each once: torchtitan's compile of MoE blocks wraps each attention on its own, and the compiled wrapper reads
    and writes the wrapped module's attributes without holding `inner_attention` as a child of its own."""
    return [m for m in model.modules() if "inner_attention" in dict(m.named_children())]


def use_packed_attention(model: nn.Module) -> None:
    """Every attention of `model` takes varlen boundaries and attends within each sequence (see the module's doc)."""
    for m in attention_modules(model):
        if m.attn_type != "sdpa":
            raise ValueError(f"[grpo] padding_free = true needs the flavor's SDPA attention; this one has attn_type = "
                             f"{m.attn_type!r}: choose an sdpa [model] flavor or set [grpo] padding_free = false")
        m.attn_type, m.inner_attention = "varlen", PackedAttention()
