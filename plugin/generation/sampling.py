"""Full-vocabulary Gumbel-max sampling where the logits lie: the noise, a vocab shard's candidates, the pick.

The noise is a hash of (key, token index, global vocab id), so a vocab shard draws exactly the
full vocabulary's noise for its ids, and a sequence's draws depend on its key alone. Under TP each
rank scores only its own columns, in blocks (no [B, V] temporary); one all-reduce of five numbers
per row hands every rank every shard's candidate, and they all pick the same token and its exact
log-prob from the log-sum-exp pieces.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic on every device)
def _int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _int32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


_GOLDEN, _M1, _M2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)
# murmur3's fmix32 constants and the 32-bit golden ratio, as signed int32
_GOLDEN32, _F1, _F2, _F3 = _int32(0x9E3779B9), _int32(0x85EBCA6B), _int32(0xC2B2AE35), _int32(0x27D4EB2F)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> sign-extends)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _shr32(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit ints; int64 products wrap as uint64's do."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32: a bijection of 32-bit ints; int32 products wrap as uint32's do."""
    x = (x ^ _shr32(x, 16)) * _F1
    x = (x ^ _shr32(x, 13)) * _F2
    return x ^ _shr32(x, 16)


def row_seeds(keys: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """[B, 2] int32: two 32-bit seeds of each key's t-th token, from splitmix64's stream of the key.

    `t`: one token index for every row, or [B] each row's own (a multi-turn row resumes at its own column).
    """
    if isinstance(t, torch.Tensor):  # int64 products wrap modulo 2^64, as the int path's % does
        state = _mix(keys + (t.to(torch.int64) + 1) * _GOLDEN)
    else:
        state = _mix(keys + _int64((t + 1) * _GOLDEN % (1 << 64)))  # [B] int64
    # the narrowing casts keep the low 32 bits, as two's complement does
    return torch.stack([state.to(torch.int32), _shr(state, 32).to(torch.int32)], dim=-1)


def uniform(ids: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[B, count] float32 in [-(1 - 2^-24), 0): -v, for v the hash of each row's two seeds ([B, 1] each, int32) and the
    global vocab ids [count] (int32), uniform in (0, 1 - 2^-24]. Negated because the noise takes log1p(-v): made
    negative here, the sign costs no pass of its own. Integer arithmetic, and a conversion that is exact (scaling by
    a power of two; rounding is symmetric, so -v is bit for bit v negated), so a compiled copy (`compiled_uniform`)
    gives the same bits. (The seeds come as two columns, not one [B, 2]: a compiled copy would give B = 2 the symbol
    of that 2, and compile again for any other B; so would a column's stride of 2.)"""
    h = _mix32(ids * _GOLDEN32 + first)  # [B, count]
    # the second seed enters after the mix: rows whose first seeds differ by a multiple of the
    # golden ratio would otherwise draw shifted copies of one stream
    h = (h ^ second) * _F3
    h = h ^ _shr32(h, 15)
    v = _shr32(h, 1).float() * -2.0**-31 - 2.0**-32  # -v in [-1, 0): float32 rounds the largest 31-bit values to -1
    return v.clamp_min(2.0**-24 - 1)  # v at most the largest float32 below 1: E stays finite


_COMPILED_UNIFORM = None


def compiled_uniform():
    """`uniform` compiled once for the process, its sizes traced ([online] compile_decode): eagerly its dozen integer
    passes are half of sampling's time (4.6x faster compiled, a [128 x 49152] block on 2 cores). The logarithms
    after it stay eager: a compiled log may differ from ATen's in the last bit, and the noise would with it."""
    global _COMPILED_UNIFORM
    if _COMPILED_UNIFORM is None:
        compiled = torch.compile(uniform, dynamic=True)

        def run(ids, first, second):
            with torch.compiler.set_stance("default"):  # generation_mode's force_eager is lifted for it
                return compiled(ids, first, second)

        _COMPILED_UNIFORM = run
    return _COMPILED_UNIFORM


def log_exponential(seeds: torch.Tensor, start: int, count: int, uniform=uniform) -> torch.Tensor:
    """[B, count] float32 log(E), E = -log(1 - v) ~ Exp(1), for the global vocab ids start..start+count-1 of each row's
    seeds: minus the Gumbel noise (`gumbel`). `uniform`: the function that hashes -v (this module's `uniform`, or
    `compiled_uniform()`)."""
    first, second = (seeds[:, i:i + 1].contiguous() for i in (0, 1))  # contiguous: [B, 1]'s strides say nothing of B
    u = uniform(torch.arange(start, start + count, dtype=torch.int32, device=seeds.device), first, second)
    return torch.log1p(u, out=u).neg_().log_()


def gumbel(seeds: torch.Tensor, start: int, count: int, uniform=uniform) -> torch.Tensor:
    """[B, count] float32 Gumbel noise for the global vocab ids start..start+count-1 of each row's seeds.

    Hashed from (seeds, global id) alone, so a vocab shard draws exactly the full vocabulary's noise
    for its ids. The noise is -log(E) with E = -log(1 - v) ~ Exp(1): v's float32 resolution is finest
    near 0, where E is small and the noise large, i.e. where the winners' noise lives; the largest
    value is 22.9 (v = 2^-32), so a truncated tail is as rare as 1e-10 per draw. `uniform`: as
    `log_exponential`'s.
    """
    return log_exponential(seeds, start, count, uniform).neg_()


# candidate columns per row: the best score, its global vocab id, its scaled logit, the row's
# max scaled logit and sum of exp(scaled logit - max) over the shard
_CANDIDATE = 5
# [B, block] float32 temporaries: ~1 MiB on a CPU, so each block's passes stay in its cache; 128 MiB
# on a GPU, where each block's passes are ~20 kernel launches and the cache is no concern
_BLOCK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 25}


def shard_candidates(logits: torch.Tensor, seeds: torch.Tensor, start: int, temperature: float,
                     uniform=uniform) -> torch.Tensor:
    """[B, 5] float32: a vocab shard's Gumbel-max candidate per row and its log-sum-exp pieces.

    `logits` [B, V_shard] hold the global vocab ids start..start+V_shard-1. The shard is read in
    blocks of columns, so no [B, V] temporary exists. Ties keep the lower vocab id.
    `temperature` 0 is greedy: the candidate is the largest logit, without noise, and the log-sum-exp
    pieces are temperature 1's (a greedy token's log-prob is its log-softmax). `uniform`: as `gumbel`'s.
    """
    B, V = logits.shape
    greedy = temperature == 0
    if greedy:
        temperature = 1.0
    block = max(1024, _BLOCK_ELEMENTS.get(logits.device.type, 1 << 18) // max(B, 1))
    best = torch.full((B,), -torch.inf, device=logits.device)
    best_id, best_z = torch.zeros(B, device=logits.device), torch.zeros(B, device=logits.device)
    m, s = torch.full((B,), -torch.inf, device=logits.device), torch.zeros(B, device=logits.device)
    for c0 in range(0, V, block):
        z = logits[:, c0:c0 + block].float()  # [B, C]; the logits themselves in fp32
        if temperature != 1.0:  # x / 1 is x: at temperature 1 a pass and a copy saved
            z = z / temperature
        if greedy:
            score = z
        else:  # z + Gumbel noise, as z - log(E): IEEE subtraction is the addition of the negation, bit for bit
            log_e = log_exponential(seeds, start + c0, z.shape[1], uniform)
            score = torch.sub(z, log_e, out=log_e)
        value, index = score.max(dim=-1)  # the first of equal maxima
        better = value > best  # strictly: an earlier block's (lower) id wins a tie
        best = torch.where(better, value, best)
        best_id = torch.where(better, (index + start + c0).float(), best_id)  # exact below 2^24
        best_z = torch.where(better, z.gather(-1, index[:, None]).squeeze(-1), best_z)
        m_new = torch.maximum(m, z.amax(dim=-1))
        s = s * torch.exp(m - m_new) + torch.sub(z, m_new[:, None]).exp_().sum(dim=-1)  # online log-sum-exp
        m = m_new
    return torch.stack([best, best_id, best_z, m, s], dim=-1)


def pick(candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and log-prob ([B], [B] fp32) from every shard's candidates [R, B, 5], shards in vocab order."""
    winner = candidates[..., 0].argmax(dim=0)  # [B]; the first (lowest-id) shard of equal maxima
    row = candidates.gather(0, winner[None, :, None].expand(1, -1, _CANDIDATE))[0]  # [B, 5]
    m, s = candidates[..., 3], candidates[..., 4]  # [R, B]
    top = m.amax(dim=0)
    lse = top + torch.log((s * torch.exp(m - top)).sum(dim=0))
    return row[:, 1].long(), row[:, 2] - lse


def sample(logits: torch.Tensor, keys: torch.Tensor, t: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t of each row by Gumbel-max over plain [B, V] logits, and its log-prob at `temperature` (0: greedy)."""
    return pick(shard_candidates(logits, row_seeds(keys, t), 0, temperature)[None])


@dataclass
class VocabShard:
    """Where a rank's logits columns sit in the vocabulary, and the group that holds the other shards."""

    start: int
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


def local_vocab(logits: torch.Tensor) -> tuple[torch.Tensor, VocabShard]:
    """This rank's logits columns and their place: the output layer's vocab shards stay where they are."""
    if not isinstance(logits, DTensor):
        return logits, VocabShard(0)
    local, last = logits.to_local(), logits.ndim - 1
    sharded = [d for d, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim % logits.ndim == last]
    if len(sharded) + sum(isinstance(p, Replicate) for p in logits.placements) != len(logits.placements) \
            or len(sharded) > 1:
        raise NotImplementedError(f"sampling from logits placed as {logits.placements}")
    if not sharded:
        return local, VocabShard(0)
    mesh, d = logits.device_mesh, sharded[0]
    rank, size = mesh.get_local_rank(d), mesh.size(d)
    chunk = -(-logits.shape[-1] // size)  # Shard follows torch.chunk: equal chunks, the last one shorter
    return local, VocabShard(min(rank * chunk, logits.shape[-1]), rank, size, mesh.get_group(d))


def sample_sharded(logits: torch.Tensor, shard: VocabShard, seeds: torch.Tensor, temperature: float,
                   uniform=uniform) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max over a vocab shard's [B, V_shard] logits: every rank of the shard's group picks the same token.

    Each rank scores only its columns; one all-reduce of [shards, B, 5] per-row values (each rank
    fills its slot, the rest are zeros, so the sum is exact) hands every rank every shard's candidate.
    `uniform`: as `gumbel`'s.
    """
    mine = shard_candidates(logits, seeds, shard.start, temperature, uniform)
    if shard.group is None:
        return pick(mine[None])
    candidates = mine.new_zeros((shard.size, *mine.shape))
    candidates[shard.rank] = mine
    dist.all_reduce(candidates, group=shard.group)
    return pick(candidates)
