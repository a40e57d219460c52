"""Sampling completions from the training policy, in the training processes, on its own mesh.

`KVCacheSampler` prefills each prompt but its last token, then decodes one token per sequence
per step against a cache of this rank's attention heads. `NoCacheSampler` re-runs the whole
sequence per new token: the oracle the cached one is tested against. Both draw with the same
noise, so they pick the same tokens.

1. Full vocabulary at `temperature`, no top-k/top-p: the log-probs are exact.
2. Gumbel-max with noise hashed from (key, token index, vocab id): a sequence's draws depend on
   its key alone, not on the rank layout or the batch it shares.
3. Every step goes through `model(...)` or `model.hidden_states(...)`, so FSDP's hooks run; compiled
   blocks run eagerly.
4. Sequences that have stopped keep decoding (discarded) until all have, on every rank.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from plugin.runtime import internals


@dataclass
class Samples:
    completions: list[list[int]]  # new token ids per sequence; includes the stop id if one was drawn
    logprobs: list[list[float]]  # the sampler's log-prob of each new token, at the temperature
    truncated: list[bool]  # True: reached max_new_tokens without drawing a stop id


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], keys: list[int]) -> Samples: ...


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic on every device)
def _int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> sign-extends)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit ints; int64 products wrap as uint64's do."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniforms(keys: torch.Tensor, t: int, vocab: int) -> torch.Tensor:
    """[B, V] float64 in (0, 1): splitmix64's stream of each key's t-th token state, one value per vocab id."""
    state = _mix(keys + _int64((t + 1) * _GOLDEN % (1 << 64)))  # [B]
    ids = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.int64)
    bits = _mix(state[:, None] + ids * _GOLDEN)  # [B, V]
    return (_shr(bits, 11).double() + 0.5) / 2.0**53  # the top 53 bits, as exact doubles


def sample(logits: torch.Tensor, keys: torch.Tensor, t: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t of each row by Gumbel-max, and its log-prob at `temperature`: ([B], [B] fp32)."""
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    gumbel = -torch.log(-torch.log(uniforms(keys, t, logits.shape[-1])))
    tokens = torch.argmax(logprobs.double() + gumbel, dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _to_keys(keys: Sequence[int], device) -> torch.Tensor:
    for i, k in enumerate(keys):
        if not -(1 << 63) <= k < 1 << 64:
            raise ValueError(f"key {i} = {k} is not a 64-bit integer")
    return torch.tensor([_int64(k) for k in keys], dtype=torch.int64, device=device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """logits[rows, cols] as a plain [n, V] tensor; under TP only those rows are all-gathered."""
    if not isinstance(logits, DTensor):
        return logits[rows, cols]
    picked = logits.to_local()[rows, cols]
    if all(isinstance(p, Replicate) for p in logits.placements):
        return picked
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % logits.ndim == logits.ndim - 1)
               for p in logits.placements):
        raise NotImplementedError(f"sampling from logits placed as {logits.placements}")
    placements = [p if isinstance(p, Replicate) else Shard(1) for p in logits.placements]
    shape = (picked.shape[0], logits.shape[-1])
    return DTensor.from_local(picked, logits.device_mesh, placements, run_check=False, shape=shape,
                              stride=(shape[1], 1)).full_tensor()


def _any_rank(flag: bool, device) -> bool:
    """Whether `flag` is set on any rank of the default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    x = torch.tensor([int(flag)], device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return bool(x.item())


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
                 pad_id: int):
        """`max_new_tokens` >= 1 and `temperature` > 0: [online] and [grpo] check them."""
        self.model, self.max_new_tokens, self.temperature, self.pad_id = model, max_new_tokens, temperature, pad_id
        self.stop_ids = list(stop_ids)
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
        """Sample a completion for each prompt; every rank calls this at the same time."""
        self._check(prompts, keys)
        n = len(prompts)
        if n == 0:  # this rank still joins every collective of its peers' steps
            prompts, keys = [[self.pad_id]], [0]
        keys_t = _to_keys(keys, self.device)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        B, N = len(prompts), self.max_new_tokens
        tokens = torch.full((B, N), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, N), dtype=torch.float32, device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        done[n:] = True
        with generation_mode(self.model), self._session(prompts) as step:
            for t in range(N):
                tokens[:, t], logprobs[:, t] = sample(step(tokens[:, :t]), keys_t, t, self.temperature)
                done |= torch.isin(tokens[:, t], stops)
                # FSDP and TP peers must run the same number of forwards
                if t + 1 < N and not _any_rank(not bool(done.all()), self.device):
                    break
        out = Samples([], [], [])
        stop_set = set(self.stop_ids)
        for ids, lps in zip(tokens[:n].tolist(), logprobs[:n].tolist()):
            end = next((j + 1 for j, x in enumerate(ids) if x in stop_set), None)
            out.completions.append(ids[:end or N])
            out.logprobs.append(lps[:end or N])
            out.truncated.append(end is None)
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

    Prefill (`state.positions` None): causal SDPA over [B, H, P, hd], every row from position 0,
    and its keys/values stored at positions 0..P-1. Decode: the batch folded into the sequence
    dim, [1, H, B', hd], one token per row at `state.positions[b]`; it is written there, and attends
    to the row's cache up to it. Right-padding's cache entries sit past a row's next position,
    so each is overwritten before any query can see it.
    """

    def __init__(self, state: SimpleNamespace, rows: int, length: int):
        super().__init__()
        self.state, self.rows, self.length = state, rows, length
        self.k = self.v = None  # [B', H_kv local, length, hd]

    def forward(self, q, k, v, *, scale=None, enable_gqa: bool = False, **_):
        mesh = placements = None
        if isinstance(q, DTensor):  # qwen3's TP plan hands head-sharded DTensors; attention never mixes heads
            mesh, placements = q.device_mesh, q.placements
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        positions = self.state.positions
        if positions is None:
            if self.k is None:
                shape = (self.rows, k.shape[1], self.length, k.shape[3])
                self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
            B, _, P, _ = k.shape
            self.k[:B, :, :P], self.v[:B, :, :P] = k, v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        else:
            rows = torch.arange(positions.shape[0], device=positions.device)
            self.k[rows, :, positions] = k[0].transpose(0, 1)  # [B', H_kv, hd]
            self.v[rows, :, positions] = v[0].transpose(0, 1)
            seen = self.state.length
            mask = torch.arange(seen, device=positions.device) <= positions[:, None]  # [B', seen]
            out = F.scaled_dot_product_attention(
                q.permute(2, 1, 0, 3), self.k[:, :, :seen], self.v[:, :, :seen], attn_mask=mask[:, None, None, :],
                scale=scale, enable_gqa=enable_gqa,
            ).permute(2, 1, 0, 3)  # [B', H, 1, hd] -> [1, H, B', hd]
        if mesh is not None:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return out


class KVCacheSampler(_BaseSampler):
    """Prefill once, then one token per sequence per step against a KV cache of local heads."""

    @contextmanager
    def _session(self, prompts: list[list[int]]):
        B, lengths = len(prompts), [len(p) for p in prompts]
        rows = _round_up(B, self.tp)  # decode folds the rows into the sequence dim, which TP shards
        prefill = _round_up(max(max(lengths) - 1, 1), self.tp)
        state = SimpleNamespace(positions=None, length=0)
        cache_len = max(prefill, max(lengths) - 1 + self.max_new_tokens)
        swapped = [(m, m.inner_attention) for m in self.model.modules()
                   if isinstance(getattr(m, "inner_attention", None), nn.Module)]
        for m, _ in swapped:
            m.inner_attention = KVCache(state, rows, cache_len)
        try:
            # all but each prompt's last token; its logits are not needed
            self.model.hidden_states(self._padded([p[:-1] for p in prompts], prefill),
                                     positions=self._positions(prefill))
            pad = [self.pad_id] * (rows - B)
            last = torch.tensor([p[-1] for p in prompts] + pad, device=self.device)  # [B']
            start = torch.tensor([n - 1 for n in lengths] + [0] * (rows - B), device=self.device)
            real = torch.arange(rows, device=self.device) < B
            row_ids = torch.arange(B, device=self.device)

            def step(generated: torch.Tensor) -> torch.Tensor:
                t = generated.shape[1]
                if t:
                    last[:B] = generated[:, -1]
                state.positions = start + t * real  # padding rows stay at position 0
                state.length = max(lengths) + t
                logits = self.model(last[None], positions=state.positions[None])  # [1, B', V]
                return _rows(logits, torch.zeros_like(row_ids), row_ids)

            yield step
        finally:
            for m, inner in swapped:
                m.inner_attention = inner  # drops the caches


class NoCacheSampler(_BaseSampler):
    """The oracle: one forward of the whole right-padded sequence per new token."""

    @contextmanager
    def _session(self, prompts: list[list[int]]):
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        longest = max(len(p) for p in prompts)
        padded = self._padded(prompts, longest)
        row_ids = torch.arange(len(prompts), device=self.device)

        def step(generated: torch.Tensor) -> torch.Tensor:
            t = generated.shape[1]
            width = _round_up(longest + t, self.tp)
            tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
            tokens[:, :longest] = padded
            tokens.scatter_(1, lengths[:, None] + torch.arange(t, device=self.device), generated)
            logits = self.model(tokens, positions=self._positions(width))  # [B, width, V]
            return _rows(logits, row_ids, lengths + t - 1)

        yield step


def build_sampler(model: nn.Module, *, kv_cache: bool, max_new_tokens: int, stop_ids: Sequence[int],
                  temperature: float, pad_id: int) -> Sampler:
    cls = KVCacheSampler if kv_cache else NoCacheSampler
    return cls(model, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature, pad_id=pad_id)
