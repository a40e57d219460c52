"""Sampling completions from the training policy, in the training processes, on its own mesh.

`KVCacheSampler` prefills each distinct prompt but its last token once, copies its cache rows to
the prompt's sequences, then decodes one token per sequence per step against a cache of this
rank's attention heads. `NoCacheSampler` re-runs the whole sequence per new token: the oracle the
cached one is tested against. Both draw with the same noise, so they pick the same tokens.

1. Full vocabulary at `temperature`, no top-k/top-p: the log-probs are exact.
2. Gumbel-max with float32 noise hashed from (key, token index, global vocab id): a sequence's
   draws depend on its key alone, not on the rank layout or the batch it shares. Under TP each
   rank scores its own vocab shard; one all-reduce of per-row candidates picks the token.
3. Every step goes through `model(...)` or `model.hidden_states(...)`, so FSDP's hooks run; compiled
   blocks run eagerly (`compile_decode` compiles the decode step itself).
4. The host looks at the stops every `check_every` steps: finished sequences leave the batch there,
   and between checks they keep decoding (discarded). Peers step until no rank has any left.
"""

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication

from plugin.generation.sampling import _int64, local_vocab, row_seeds, sample_sharded
from plugin.model.attention import attention_modules
from plugin.runtime import internals


@dataclass
class Samples:
    completions: list[list[int]]  # new token ids per sequence; includes the stop id if one was drawn
    logprobs: list[list[float]]  # the sampler's log-prob of each new token, at the temperature
    truncated: list[bool]  # True: reached max_new_tokens without drawing a stop id


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], keys: list[int]) -> Samples: ...


def _to_keys(keys: Sequence[int], device) -> torch.Tensor:
    for i, k in enumerate(keys):
        if not -(1 << 63) <= k < 1 << 64:
            raise ValueError(f"key {i} = {k} is not a 64-bit integer")
    return torch.tensor([_int64(k) for k in keys], dtype=torch.int64, device=device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _max_rank(value: int, device) -> int:
    """The largest `value` over the ranks of the default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    x = torch.tensor([value], device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


def _any_rank(flag: bool, device) -> bool:
    """Whether `flag` is set on any rank of the default process group."""
    return bool(_max_rank(int(flag), device))


def max_prompt_tokens(seq_len: int, max_new_tokens: int) -> int:
    """The longest prompt that can be sampled from: its last new token is drawn at position
    len(prompt) + max_new_tokens - 2, and RoPE covers positions below [training] seq_len (the
    model's max_seq_len); also the longest whose completion fits a training sequence of seq_len + 1."""
    return seq_len + 1 - max_new_tokens


@contextmanager
def generation_mode(model: nn.Module):
    """No grad, compiled blocks run eagerly, FSDP's parameters stay gathered across forwards; clean after.

    The root's own groups are left alone: torchtitan's root holds no parameters, and FSDP
    already keeps a root's gathered after forward. Every group's own reshard-after-forward
    setting is put back, everything is resharded at the end, and the root's per-iteration
    records reset, so the training forward that follows starts clean.
    """
    groups = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    saved = [(m, internals.reshards_after_forward(m)) for m in groups]
    for m in groups:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        # fullgraph-compiled blocks would recompile for every new shape and for the swapped modules;
        # qwen3's TP plan makes the RoPE table a Replicate DTensor, which plain positions then index
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), implicit_replication():
            yield
    finally:
        for m, reshard in saved:
            m.set_reshard_after_forward(reshard, recurse=False)
        internals.end_forward_only_iteration(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


class _BaseSampler:
    def __init__(self, model: nn.Module, *, max_new_tokens: int, stop_ids: Sequence[int], temperature: float,
                 pad_id: int, max_num_seqs: int = 0, check_every: int = 8,
                 autocast: Callable[[], AbstractContextManager] = nullcontext, compile_decode: bool = False):
        """`max_new_tokens` >= 1 and `temperature` >= 0 (0: greedy): [online] and [grpo] check them.

        max_num_seqs: most sequences one decode batch holds (0: all of the call's); check_every:
        decode steps between the stop checks, the only host syncs of the decode loop; autocast:
        the training forward's autocast (torchtitan's maybe_enable_amp), so generation computes in
        the trainer's dtype; compile_decode: the cached sampler's decode step under torch.compile.
        """
        self.model, self.max_new_tokens, self.temperature, self.pad_id = model, max_new_tokens, temperature, pad_id
        self.stop_ids, self.max_num_seqs, self.check_every = list(stop_ids), max_num_seqs, check_every
        self.autocast, self.compile_decode = autocast, compile_decode
        if compile_decode and any(isinstance(m, FSDPModule) for m in model.modules()):
            # the compiled step would trace FSDP's hooks, which generation_mode keeps eager; not built yet
            raise NotImplementedError("[online] compile_decode with FSDP (data_parallel_shard_degree > 1): "
                                      "use it on one rank or TP only")
        self.tp = model.scoring.seq_shards  # sequence parallel shards the sequence dim over the TP ranks
        self.max_seq_len = model.model_args.max_seq_len  # the RoPE table's length
        self.device = next(model.parameters()).device

    def _check(self, prompts: list[list[int]], keys: list[int]) -> None:
        """Raise on every rank if a prompt on any rank cannot be sampled from, rather than leave peers waiting."""
        if len(keys) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
        error, limit = None, max_prompt_tokens(self.max_seq_len, self.max_new_tokens)
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= limit:
                error = (f"prompt {i} has {len(p)} tokens: it needs 1 to {limit} with max_new_tokens = "
                         f"{self.max_new_tokens} and RoPE positions below {self.max_seq_len} (the model's "
                         "max_seq_len, [training] seq_len)")
                break
        if _any_rank(error is not None, self.device):
            raise ValueError(error or "a prompt on another rank cannot be sampled from (see that rank's error)")

    def generate(self, prompts: list[list[int]], keys: list[int]) -> Samples:
        """Sample a completion for each prompt; every rank calls this at the same time.

        With max_num_seqs the prompts go in consecutive calls of at most that many; a sequence's
        draws depend on its key alone, so the split changes nothing. Peers run as many calls as
        the rank that needs most (each call's steps hold collectives).
        """
        self._check(prompts, keys)
        cap = self.max_num_seqs or max(len(prompts), 1)
        calls = _max_rank(max(-(-len(prompts) // cap), 1), self.device)
        out = Samples([], [], [])
        for c in range(calls):
            part = self._generate(prompts[c * cap:(c + 1) * cap], keys[c * cap:(c + 1) * cap])
            for mine, theirs in zip((out.completions, out.logprobs, out.truncated), part):
                mine.extend(theirs)
        return out

    def _generate(self, prompts: list[list[int]], keys: list[int]) -> tuple[list, list, list]:
        """One decode batch. Every `check_every` steps the host looks at the stops: the batch keeps only
        its unfinished rows (in multiples of the TP degree, which shards the rows under decode), and
        ends when no rank has any left. Rows past `n` are padding: done from the start."""
        n, N, tp = len(prompts), self.max_new_tokens, self.tp
        B = _round_up(max(n, 1), tp)
        prompts = prompts + [[self.pad_id]] * (B - n)  # an empty rank still joins every collective of its peers
        keys_t = _to_keys(list(keys) + [0] * (B - n), self.device)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, N), dtype=torch.float32, device=self.device)
        done = torch.arange(B, device=self.device) >= n
        live = torch.arange(B, device=self.device)  # the session's rows: indices into tokens
        with generation_mode(self.model), self.autocast(), self._session(prompts) as session:
            for t in range(N):
                logits, shard = local_vocab(session.step(t, tokens[live, :t]))
                tokens[live, t], logprobs[live, t] = sample_sharded(
                    logits.reshape(-1, logits.shape[-1]), shard, row_seeds(keys_t[live], t), self.temperature)
                done[live] |= torch.isin(tokens[live, t], stops)
                if t + 1 == N or (t + 1) % self.check_every:
                    continue
                # the one host sync of `check_every` steps; TP peers drew the same tokens, so agree on the rows
                unfinished = (~done[live]).nonzero().squeeze(-1)
                count = unfinished.numel()
                # FSDP and TP peers must run the same number of forwards
                if not _any_rank(count > 0, self.device):
                    break
                rows = _round_up(max(count, 1), tp)
                if self.compile_decode:  # a few row counts, each compiled once: the next power of two
                    rows = _round_up(1 << (max(count, 1) - 1).bit_length(), tp)
                if rows < live.numel():
                    finished = done[live].nonzero().squeeze(-1)
                    keep = torch.cat([unfinished, finished[:rows - count]])  # finished rows fill up to `rows`
                    session.keep(keep)
                    live = live[keep]
        out = ([], [], [])
        stop_set = set(self.stop_ids)
        for ids, lps in zip(tokens[:n].tolist(), logprobs[:n].tolist()):
            end = next((j + 1 for j, x in enumerate(ids) if x in stop_set), None)
            out[0].append(ids[:end or N])
            out[1].append(lps[:end or N])
            out[2].append(end is None)
        return out

    def _positions(self, length: int) -> torch.Tensor:
        """(1, length) positions from 0; padding past the RoPE table reuses its last row."""
        return torch.arange(length, device=self.device).clamp_max(self.max_seq_len - 1)[None]

    def _padded(self, prompts: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] prompts, right-padded (or cut) to `length`."""
        out = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            out[b, :min(len(p), length)] = torch.tensor(p[:length])
        return out.to(self.device)


class KVCache(nn.Module):
    """An Attention's `inner_attention` during generation: attends over a cache of this rank's heads.

    Prefill (`state.positions` None): causal SDPA over [U, H, P, hd] of the unique prompts, every
    row from position 0, and its keys/values stored at positions 0..P-1; `expand` then copies each
    prompt's rows to its sequences. Decode: the batch folded into the sequence dim, [1, H, B', hd],
    one token per row at `state.positions[b]`; it is written there, and attends to the row's cache
    up to it. Right-padding's cache entries sit past a row's next position, so each is
    overwritten before any query can see it.

    The decode query folds each KV head's query heads into SDPA's query-length dim ([B', H_kv,
    H / H_kv, hd]), so grouped-query attention needs no `enable_gqa` and no copy of K/V, and the
    per-row cache length is an additive float mask: what the GPU's memory-efficient and cuDNN
    kernels accept.
    """

    def __init__(self, state: SimpleNamespace, length: int):
        super().__init__()
        self.state, self.length = state, length
        self.k = self.v = None  # [B', H_kv local, length, hd]

    def expand(self, index: torch.Tensor) -> None:
        """Rows `index` of the cache, in order (a prompt's row to each of its sequences; the unfinished rows)."""
        self.k, self.v = self.k[index], self.v[index]

    def forward(self, q, k, v, *, scale=None, enable_gqa: bool = False, **_):
        mesh = placements = None
        if isinstance(q, DTensor):  # qwen3's TP plan hands head-sharded DTensors; attention never mixes heads
            mesh, placements = q.device_mesh, q.placements
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        positions = self.state.positions
        if positions is None:
            B, H_kv, P, hd = k.shape
            self.k = k.new_zeros((B, H_kv, self.length, hd))
            self.v = v.new_zeros((B, H_kv, self.length, hd))
            self.k[:, :, :P], self.v[:, :, :P] = k, v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        else:
            rows = torch.arange(positions.shape[0], device=positions.device)
            self.k[rows, :, positions] = k[0].transpose(0, 1)  # [B', H_kv, hd]
            self.v[rows, :, positions] = v[0].transpose(0, 1)
            seen = self.state.length
            _, H, Bq, hd = q.shape
            H_kv = self.k.shape[1]
            grouped = q[0].transpose(0, 1).reshape(Bq, H_kv, H // H_kv, hd)  # query head h reads KV head h // (H / H_kv)
            out = F.scaled_dot_product_attention(
                grouped, self.k[:, :, :seen], self.v[:, :, :seen], attn_mask=self.state.mask.to(q.dtype), scale=scale)
            out = out.reshape(Bq, H, hd).transpose(0, 1)[None]  # [1, H, B', hd]
        if mesh is not None:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return out


class KVCacheSampler(_BaseSampler):
    """Prefill each distinct prompt once, then one token per sequence per step against a KV cache of local heads."""

    @contextmanager
    def _session(self, prompts: list[list[int]]):
        lengths = [len(p) for p in prompts]
        # a group's G sequences share their prompt: prefill it once, then copy its cache rows
        unique: dict[tuple, int] = {}
        index = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts], device=self.device)
        firsts = [list(p) for p in unique]
        prefill = _round_up(max(max(lengths) - 1, 1), self.tp)
        state = SimpleNamespace(positions=None, length=0, mask=None)
        cache_len = max(prefill, max(lengths) - 1 + self.max_new_tokens)
        swapped = [(m, m.inner_attention, m.attn_type) for m in attention_modules(self.model)]
        caches = [KVCache(state, cache_len) for _ in swapped]
        for (m, _, _), cache in zip(swapped, caches):
            # torchtitan calls the cache SDPA's way, also where padding-free training set "varlen" (plugin.model.attention)
            m.inner_attention, m.attn_type = cache, "sdpa"
        try:
            # all but each prompt's last token; its logits are not needed
            self.model.hidden_states(self._padded([p[:-1] for p in firsts], prefill),
                                     positions=self._positions(prefill))
            for cache in caches:
                cache.expand(index)
            session = _Decode(self, state, caches, lengths, prompts)
            yield session
        finally:
            for m, inner, attn_type in swapped:
                m.inner_attention, m.attn_type = inner, attn_type  # drops the caches


class _Decode:
    """The cached sampler's decode steps over its live rows."""

    def __init__(self, sampler: KVCacheSampler, state: SimpleNamespace, caches: list[KVCache],
                 lengths: list[int], prompts: list[list[int]]):
        self.sampler, self.state, self.caches = sampler, state, caches
        device = sampler.device
        self.starts = [n - 1 for n in lengths]  # host copy: the step's attended length needs no sync
        self.start = torch.tensor(self.starts, device=device)
        self.first = torch.tensor([p[-1] for p in prompts], device=device)  # each row's first decode input
        self.forward = sampler.model
        if sampler.compile_decode:
            self.forward = _compiled(sampler.model)

    def step(self, t: int, generated: torch.Tensor) -> torch.Tensor:
        """[1, B', V] logits of the next token of every live row, given their `generated` [B', t] tokens."""
        state = self.state
        last = generated[:, -1] if t else self.first
        state.positions = self.start + t
        # compiled: attend over the whole cache (masked), so the step's shapes stay static
        state.length = self.caches[0].length if self.sampler.compile_decode else max(self.starts) + t + 1
        # the row's cache up to its own position; an additive mask, built once for every layer
        seen = torch.arange(state.length, device=last.device)
        state.mask = torch.zeros(seen.shape, device=last.device).expand(last.shape[0], -1).masked_fill(
            seen > state.positions[:, None], -torch.inf)[:, None, None, :]  # [B', 1, 1, seen]
        return self.forward(last[None], positions=state.positions[None])

    def keep(self, index: torch.Tensor) -> None:
        """Keep rows `index` (the unfinished ones, in this order)."""
        self.starts = [self.starts[i] for i in index.tolist()]
        self.start, self.first = self.start[index], self.first[index]
        for cache in self.caches:
            cache.expand(index)


def _compiled(model: nn.Module) -> Callable:
    """The decode step's forward under torch.compile; generation_mode's force_eager stance is lifted for it."""
    compiled = torch.compile(model.forward, dynamic=False)

    def forward(*args, **kwargs):
        with torch.compiler.set_stance("default"):
            return compiled(*args, **kwargs)

    return forward


class NoCacheSampler(_BaseSampler):
    """The oracle: one forward of the whole right-padded sequence per new token."""

    @contextmanager
    def _session(self, prompts: list[list[int]]):
        yield _FullForward(self, prompts)


class _FullForward:
    """The oracle's steps: the whole sequence of every live row, again."""

    def __init__(self, sampler: NoCacheSampler, prompts: list[list[int]]):
        self.sampler = sampler
        self.lengths = torch.tensor([len(p) for p in prompts], device=sampler.device)
        self.longest = max(len(p) for p in prompts)
        self.padded = sampler._padded(prompts, self.longest)

    def step(self, t: int, generated: torch.Tensor) -> torch.Tensor:
        """[B', V] logits of the next token of every live row."""
        s, B = self.sampler, generated.shape[0]
        width = _round_up(self.longest + t, s.tp)
        tokens = torch.full((B, width), s.pad_id, dtype=torch.long, device=s.device)
        tokens[:, :self.longest] = self.padded
        tokens.scatter_(1, self.lengths[:, None] + torch.arange(t, device=s.device), generated)
        logits = s.model(tokens, positions=s._positions(width))  # [B', width, V], vocab-sharded under TP
        rows = torch.arange(B, device=s.device)
        if isinstance(logits, DTensor):  # the rows' own positions, on the local vocab shard
            local_vocab(logits)  # raises for placements the sampler cannot read
            V = logits.shape[-1]
            picked = logits.to_local()[rows, self.lengths + t - 1]
            return DTensor.from_local(picked, logits.device_mesh, _row_placements(logits), run_check=False,
                                      shape=(B, V), stride=(V, 1))
        return logits[rows, self.lengths + t - 1]

    def keep(self, index: torch.Tensor) -> None:
        self.lengths, self.padded = self.lengths[index], self.padded[index]


def _row_placements(logits: DTensor) -> list:
    """A [B, V] row pick's placements from [B, T, V] logits': a vocab shard stays one."""
    return [Shard(1) if isinstance(p, Shard) else p for p in logits.placements]


def build_sampler(model: nn.Module, *, kv_cache: bool, max_new_tokens: int, stop_ids: Sequence[int],
                  temperature: float, pad_id: int, **options) -> Sampler:
    """The cached sampler, or the oracle; `options`: _BaseSampler's max_num_seqs, check_every, autocast, compile_decode."""
    cls = KVCacheSampler if kv_cache else NoCacheSampler
    return cls(model, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature, pad_id=pad_id,
               **options)
