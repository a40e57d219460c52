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

import math
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
    logprobs: list[list[float]]  # the sampler's log-prob of each new token, at the temperature (NaN: a tool token)
    truncated: list[bool]  # True: reached max_new_tokens without drawing a stop id (or a tool result would overflow it)
    # with `turns`: 1 where the model drew the token, 0 where a tool turn appended it; None: every token is drawn
    tool_mask: list[list[int]] | None = None
    # an MoE policy whose routing is captured ([moe] router_replay = "R3"): per sequence, the experts each input
    # position (prompt + completion but its last token) was routed to, [positions, layers, k] int16; else None
    routed_experts: list | None = None


class Turns(Protocol):
    """What a multi-turn row does after a turn that ended with a stop id (plugin.generation.tools' ToolTurns)."""

    def resume(self, rows: list[int], completions: list[list[int]], room: list[int]) -> list[list[int] | None]:
        """For each row, the ids to append before it generates again (a tool turn), or None: it is finished.

        `completions`: each row's completion so far, its turn's stop id last; `room`: the most ids that may be
        appended with one new token left in the budget. Ids longer than `room` end the row as truncated, without
        them: the caller rolls its own record of that turn back. Every rank calls it at once (TP peers alike).
        """
        ...


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None = None) -> Samples: ...


class _Shifted:
    """`turns` for one of several decode calls: its row b is the caller's row `offset + b`."""

    def __init__(self, turns: Turns, offset: int):
        self.turns, self.offset = turns, offset

    def resume(self, rows: list[int], completions: list[list[int]], room: list[int]) -> list[list[int] | None]:
        return self.turns.resume([self.offset + b for b in rows], completions, room)


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


def check_prompts(prompts: list[list[int]], keys: list[int], max_seq_len: int, max_new_tokens: int, device) -> None:
    """Raise on every rank if a prompt on any rank cannot be sampled from, rather than leave peers waiting."""
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
    error, limit = None, max_prompt_tokens(max_seq_len, max_new_tokens)
    for i, p in enumerate(prompts):
        if not 1 <= len(p) <= limit:
            error = (f"prompt {i} has {len(p)} tokens: it needs 1 to {limit} with max_new_tokens = {max_new_tokens} "
                     f"and RoPE positions below {max_seq_len} (the model's max_seq_len, [training] seq_len)")
            break
    if _any_rank(error is not None, device):
        raise ValueError(error or "a prompt on another rank cannot be sampled from (see that rank's error)")


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
        self._capture = None  # plugin.model.moe.Capture of the call in progress, when the routing is captured
        if compile_decode and any(isinstance(m, FSDPModule) for m in model.modules()):
            # the compiled step would trace FSDP's hooks, which generation_mode keeps eager; not built yet
            raise NotImplementedError("[online] compile_decode with FSDP (data_parallel_shard_degree > 1): "
                                      "use it on one rank or TP only")
        self.tp = model.scoring.seq_shards  # sequence parallel shards the sequence dim over the TP ranks
        self.max_seq_len = model.model_args.max_seq_len  # the RoPE table's length
        self.device = next(model.parameters()).device

    def generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None = None) -> Samples:
        """Sample a completion for each prompt; every rank calls this at the same time.

        With max_num_seqs the prompts go in consecutive calls of at most that many; a sequence's
        draws depend on its key alone, so the split changes nothing. Peers run as many calls as
        the rank that needs most (each call's steps hold collectives). With `turns`, a row whose
        turn ends with a stop id may get ids appended (a tool turn) and go on from its cache.
        """
        check_prompts(prompts, keys, self.max_seq_len, self.max_new_tokens, self.device)
        cap = self.max_num_seqs or max(len(prompts), 1)
        calls = _max_rank(max(-(-len(prompts) // cap), 1), self.device)
        routing = getattr(self.model, "routing", None)
        captures = routing is not None and routing.captures_samples
        out = Samples([], [], [], [] if turns is not None else None, [] if captures else None)
        for c in range(calls):
            shifted = None if turns is None else _Shifted(turns, c * cap)  # `turns` numbers the rows of all calls
            call = prompts[c * cap:(c + 1) * cap]
            rows, length = _round_up(max(len(call), 1), self.tp), max(map(len, call), default=1) + self.max_new_tokens
            with routing.capturing(rows, length + self.tp + 1, self.device) if captures else nullcontext() as capture:
                self._capture = capture
                try:
                    part = self._generate(call, keys[c * cap:(c + 1) * cap], shifted)
                finally:
                    self._capture = None
            for mine, theirs in zip((out.completions, out.logprobs, out.truncated, out.tool_mask), part):
                if mine is not None:
                    mine.extend(theirs)
            if captures:  # each sequence's input positions: its prompt and completion but the last token
                out.routed_experts.extend(capture.row(b, len(p) + len(done) - 1)
                                          for b, (p, done) in enumerate(zip(call, part[0])))
        return out

    def _at(self, rows: torch.Tensor, positions: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Where the next forward's tokens sit, for a routing capture: token `source[i]` (default i) of the
        forward's input, flattened, is row `rows[i]`'s input at `positions[i]`."""
        if self._capture is not None:
            self._capture.at(rows, positions, source)

    def _generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None) -> tuple:
        """One decode batch, in rounds: a round decodes until no rank has a row in its turn; then `turns` says
        which rows go on, with which ids appended, and the next round decodes those. Row b writes its
        completion's column `col[b]` (its own index into the shared key stream, so a resumed row draws
        as if alone). Rows past `n` are padding: done from the start."""
        n, N, tp = len(prompts), self.max_new_tokens, self.tp
        B = _round_up(max(n, 1), tp)
        prompts = prompts + [[self.pad_id]] * (B - n)  # an empty rank still joins every collective of its peers
        keys_t = _to_keys(list(keys) + [0] * (B - n), self.device)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        # column N takes the draws of rows already done (discarded), which decode on until the next check
        tokens = torch.full((B, N + 1), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((B, N + 1), dtype=torch.float32, device=self.device)
        appended = torch.zeros((B, N + 1), dtype=torch.bool, device=self.device)  # a tool turn's ids
        col = torch.zeros(B, dtype=torch.long, device=self.device)
        done = torch.arange(B, device=self.device) >= n
        live = torch.arange(B, device=self.device)  # the session's rows: indices into tokens
        turn_start, ended, truncated = [0] * B, [None] * B, [False] * B  # host: each row's current turn, its end
        with generation_mode(self.model), self.autocast(), \
                self._session(prompts, tokens, multi_turn=turns is not None) as session:
            active = list(range(n))  # rows in their turn
            while True:
                starts = [turn_start[b] for b in active] or [N]
                live = self._round(session, live, keys_t, stops, tokens, logprobs, col, done, min(starts), max(starts))
                if turns is None:
                    break
                resumed = self._next_turns(turns, active, tokens, logprobs, appended, turn_start, ended, truncated)
                if not _any_rank(bool(resumed), self.device):
                    break
                active = [b for b, _, _ in resumed]
                for b, e, m in resumed:
                    turn_start[b], ended[b] = e + m, None
                index = torch.tensor(active, dtype=torch.long, device=self.device)
                col[index], done[index] = index.new_tensor([e + m for _, e, m in resumed]), False
                live = session.resume(resumed, self._filler(active, B, len(active)))
        out = ([], [], [], [] if turns is not None else None)
        for b, (ids, lps, tool) in enumerate(zip(tokens[:n].tolist(), logprobs[:n].tolist(), appended[:n].tolist())):
            end = ended[b] if turns is not None else next((j + 1 for j, x in enumerate(ids[:N]) if x in self.stop_ids),
                                                          None)
            out[0].append(ids[:end or N])
            out[1].append(lps[:end or N])
            out[2].append(end is None or truncated[b])
            if out[3] is not None:
                out[3].append([int(not x) for x in tool[:end or N]])
        return out

    def _next_turns(self, turns: Turns, active: list[int], tokens, logprobs, appended, turn_start: list[int],
                    ended: list, truncated: list[bool]) -> list[tuple[int, int, int]]:
        """After a round: where each active row's turn ended (its first stop id; None: the budget), and for the rows
        that `turns` resumes, their appended ids written after it. Returns (row, column after the stop id, ids)."""
        N, rows, completions, room = self.max_new_tokens, [], [], []
        for b, ids in zip(active, tokens[active].tolist()):
            ended[b] = next((j + 1 for j in range(turn_start[b], N) if ids[j] in self.stop_ids), None)
            if ended[b] is not None:
                rows.append(b)
                completions.append(ids[:ended[b]])
                room.append(N - 1 - ended[b])
        resumed = []
        for b, more, fits in zip(rows, turns.resume(rows, completions, room), room):
            if more is None:
                continue
            if len(more) > fits:
                truncated[b] = True  # a tool result that would overflow the budget ends the row, without it
                continue
            e = ended[b]
            tokens[b, e:e + len(more)] = torch.tensor(more, device=self.device)
            logprobs[b, e:e + len(more)] = math.nan
            appended[b, e:e + len(more)] = True
            resumed.append((b, e, len(more)))
        return resumed

    def _rows(self, count: int) -> int:
        """Rows a decode batch of `count` unfinished ones holds: a multiple of the TP degree (which shards them),
        compiled: the next power of two, so a few row counts are each compiled once."""
        if self.compile_decode:
            return _round_up(1 << (max(count, 1) - 1).bit_length(), self.tp)
        return _round_up(max(count, 1), self.tp)

    def _filler(self, active: list[int], B: int, count: int) -> list[int]:
        """Finished rows that fill a resumed round's batch up to `_rows(count)`; they decode on, discarded."""
        mine = set(active)
        return [b for b in range(B) if b not in mine][:min(self._rows(count), B) - count]

    def _round(self, session, live: torch.Tensor, keys_t, stops, tokens, logprobs, col, done, first_col: int,
               last_col: int):
        """Decode the `live` rows until no rank has one in its turn; returns the rows still in the session.

        The rows in their turn start it at columns first_col..last_col; the others only fill the batch.

        Every `check_every` steps the host looks at the stops: the batch keeps only its unfinished
        rows (`_rows`), and ends when no rank has any left. A row is done at a stop id or at column N.
        """
        N = self.max_new_tokens
        steps = _max_rank(N - first_col, self.device)  # peers run the same steps: the longest budget left
        for t in range(steps):
            c = col[live].clamp_max(N)
            # the longest sequence a row in its turn has now: the rows that only fill the batch may be past it
            logits, shard = local_vocab(session.step(live, c, min(last_col + t, N)))
            tokens[live, c], logprobs[live, c] = sample_sharded(
                logits.reshape(-1, logits.shape[-1]), shard, row_seeds(keys_t[live], c), self.temperature)
            done[live] |= torch.isin(tokens[live, c], stops) | (c + 1 >= N)
            col[live] = c + 1
            if t + 1 == steps or (t + 1) % self.check_every:
                continue
            # the one host sync of `check_every` steps; TP peers drew the same tokens, so agree on the rows
            unfinished = (~done[live]).nonzero().squeeze(-1)
            count = unfinished.numel()
            # FSDP and TP peers must run the same number of forwards
            if not _any_rank(count > 0, self.device):
                break
            rows = self._rows(count)
            if rows < live.numel():
                finished = done[live].nonzero().squeeze(-1)
                keep = torch.cat([unfinished, finished[:rows - count]])  # finished rows fill up to `rows`
                session.keep(keep, live)
                live = live[keep]
        return live

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
    prompt's rows to its sequences. Decode: the batch folded into the sequence dim, [1, H, M, hd],
    token m at cache row `state.rows[m]` (None: row m, one token per row) and `state.positions[m]`;
    it is written there, and attends to its row's cache up to it. A resumed row's appended ids
    come this way, several tokens of one row at once. Right-padding's cache entries, and the
    discarded draws of finished rows, sit past a row's next position, so each is overwritten before
    any query can see it.

    The decode query folds each KV head's query heads into SDPA's query-length dim ([M, H_kv,
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
            rows = self.state.rows
            write = torch.arange(positions.shape[0], device=positions.device) if rows is None else rows
            self.k[write, :, positions] = k[0].transpose(0, 1)  # [M, H_kv, hd]
            self.v[write, :, positions] = v[0].transpose(0, 1)
            seen = self.state.length
            _, H, M, hd = q.shape
            H_kv = self.k.shape[1]
            grouped = q[0].transpose(0, 1).reshape(M, H_kv, H // H_kv, hd)  # query head h reads KV head h // (H / H_kv)
            # one token per row reads the cache in place; several tokens of a row read copies of its rows
            keys, values = (self.k, self.v) if rows is None else (self.k[rows], self.v[rows])
            out = F.scaled_dot_product_attention(
                grouped, keys[:, :, :seen], values[:, :, :seen], attn_mask=self.state.mask.to(q.dtype), scale=scale)
            out = out.reshape(M, H, hd).transpose(0, 1)[None]  # [1, H, M, hd]
        if mesh is not None:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return out


class KVCacheSampler(_BaseSampler):
    """Prefill each distinct prompt once, then one token per sequence per step against a KV cache of local heads."""

    @contextmanager
    def _session(self, prompts: list[list[int]], tokens: torch.Tensor, multi_turn: bool = False):
        lengths = [len(p) for p in prompts]
        # a group's G sequences share their prompt: prefill it once, then copy its cache rows
        unique: dict[tuple, int] = {}
        index = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts], device=self.device)
        firsts = [list(p) for p in unique]
        prefill = _round_up(max(max(lengths) - 1, 1), self.tp)
        state = SimpleNamespace(positions=None, rows=None, length=0, mask=None)
        # a row's inputs sit at positions up to len(prompt) - 1 + max_new_tokens (column N: discarded draws)
        cache_len = max(prefill, max(lengths) + self.max_new_tokens)
        swapped = [(m, m.inner_attention, m.attn_type) for m in attention_modules(self.model)]
        caches = [KVCache(state, cache_len) for _ in swapped]
        for (m, _, _), cache in zip(swapped, caches):
            # torchtitan calls the cache SDPA's way, also where padding-free training set "varlen" (plugin.model.attention)
            m.inner_attention, m.attn_type = cache, "sdpa"
        try:
            # all but each prompt's last token; its logits are not needed
            cols = torch.arange(prefill, device=self.device)
            self._at(torch.arange(len(prompts), device=self.device).repeat_interleave(prefill), cols.repeat(len(prompts)),
                     (index[:, None] * prefill + cols).flatten())  # a unique prompt's tokens, for each of its rows
            self.model.hidden_states(self._padded([p[:-1] for p in firsts], prefill),
                                     positions=self._positions(prefill))
            for cache in caches:
                cache.expand(index)
            yield _Decode(self, state, caches, lengths, prompts, tokens, multi_turn)
        finally:
            for m, inner, attn_type in swapped:
                m.inner_attention, m.attn_type = inner, attn_type  # drops the caches


class _Decode:
    """The cached sampler's decode steps over its live rows (cache row i holds row `live[i]`)."""

    def __init__(self, sampler: KVCacheSampler, state: SimpleNamespace, caches: list[KVCache],
                 lengths: list[int], prompts: list[list[int]], tokens: torch.Tensor, multi_turn: bool):
        self.sampler, self.state, self.caches, self.tokens = sampler, state, caches, tokens
        device = sampler.device
        self.starts = [n - 1 for n in lengths]  # host copy: the step's attended length needs no sync
        self.max_start = max(self.starts)  # over the live rows
        self.start = torch.tensor(self.starts, device=device)
        self.first = torch.tensor([p[-1] for p in prompts], device=device)  # each row's first decode input
        self.live = list(range(len(prompts)))
        # multi-turn: every row's cache, kept when it leaves the batch, for a later turn (one copy of the batch's)
        self.parked = [(c.k.clone(), c.v.clone()) for c in caches] if multi_turn else None
        self.forward = sampler.model
        if sampler.compile_decode:
            self.forward = _compiled(sampler.model)

    def step(self, rows: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
        """[1, B', V] logits of the next token of the live `rows` (in cache order), whose completions have `cols`
        tokens (at most `width` among the rows in their turn)."""
        state = self.state
        last = torch.where(cols > 0, self.tokens[rows, (cols - 1).clamp(min=0)], self.first[rows])
        state.rows, state.positions = None, self.start[rows] + cols
        # compiled: attend over the whole cache (masked), so the step's shapes stay static
        length = self.caches[0].length
        state.length = length if self.sampler.compile_decode else min(self.max_start + width + 1, length)
        state.mask = self._mask(state.positions, state.length)
        self.sampler._at(rows, state.positions)
        return self.forward(last[None], positions=state.positions[None])

    @staticmethod
    def _mask(positions: torch.Tensor, length: int) -> torch.Tensor:
        """[M, 1, 1, length] additive: each token's row cache up to its own position; built once for every layer."""
        seen = torch.arange(length, device=positions.device)
        return torch.zeros(seen.shape, device=positions.device).expand(positions.shape[0], -1).masked_fill(
            seen > positions[:, None], -torch.inf)[:, None, None, :]

    def keep(self, index: torch.Tensor, live: torch.Tensor) -> None:
        """Keep rows `index` of the `live` ones (the unfinished, in this order); multi-turn: park the others."""
        if self.parked is not None:
            leaving = torch.ones(live.numel(), dtype=torch.bool, device=live.device)
            leaving[index] = False
            self._park(leaving.nonzero().squeeze(-1), live)
        for cache in self.caches:
            cache.expand(index)
        self.live = live[index].tolist()
        self.max_start = max(self.starts[b] for b in self.live)

    def _park(self, index: torch.Tensor, live: torch.Tensor) -> None:
        for cache, (k, v) in zip(self.caches, self.parked):
            k[live[index]], v[live[index]] = cache.k[index], cache.v[index]

    def resume(self, resumed: list[tuple[int, int, int]], filler: list[int]) -> torch.Tensor:
        """Start a round of the rows `resumed` ((row, column after its turn's stop id, ids appended there)) and
        `filler` rows: their cache rows back from the parked ones, then the stop id and the appended ids but the
        last one run through the model, every row's at once (the last is the next step's input). Returns the rows."""
        device, tp = self.sampler.device, self.sampler.tp
        live = torch.tensor(self.live, device=device)
        self._park(torch.arange(live.numel(), device=device), live)
        rows = [b for b, _, _ in resumed] + filler
        index = torch.tensor(rows, device=device)
        for cache, (k, v) in zip(self.caches, self.parked):
            cache.k, cache.v = k[index], v[index]
        self.live, self.max_start = rows, max(self.starts[b] for b in rows)
        at, where, ids = [], [], []  # cache row, position, token of each appended input
        for i, (b, e, m) in enumerate(resumed):
            at += [i] * m
            where += range(self.starts[b] + e, self.starts[b] + e + m)  # column c's token sits at start + 1 + c
            ids += self.tokens[b, e - 1:e + m - 1].tolist()
        # to a multiple of the TP degree (and at least one, a forward every peer runs): writes that are discarded,
        # at a resumed row's next position (its next step overwrites it) or a filler row's last one
        pad = _round_up(max(len(ids), 1), tp) - len(ids)
        b, e, m = resumed[-1] if resumed else (rows[0], 0, 0)
        at += [len(resumed) - 1 if resumed else 0] * pad
        where += [self.starts[b] + e + m if resumed else self.caches[0].length - 1] * pad
        ids += [self.sampler.pad_id] * pad
        state = self.state
        state.rows = torch.tensor(at, device=device)
        state.positions = torch.tensor(where, device=device)
        state.length = max(where) + 1
        state.mask = self._mask(state.positions, state.length)
        self.sampler._at(index[state.rows], state.positions)
        self.sampler.model.hidden_states(torch.tensor([ids], device=device), positions=state.positions[None])
        state.rows = None
        return index


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
    def _session(self, prompts: list[list[int]], tokens: torch.Tensor, multi_turn: bool = False):
        yield _FullForward(self, prompts, tokens)


class _FullForward:
    """The oracle's steps: the whole sequence of every live row, again; a resumed row's appended ids are in it."""

    def __init__(self, sampler: NoCacheSampler, prompts: list[list[int]], tokens: torch.Tensor):
        self.sampler, self.tokens = sampler, tokens
        self.lengths = torch.tensor([len(p) for p in prompts], device=sampler.device)
        self.longest = max(len(p) for p in prompts)
        self.padded = sampler._padded(prompts, self.longest)

    def step(self, rows: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
        """[B', V] logits of the next token of the live `rows`, whose completions have `cols` tokens (at most
        `width` among the rows in their turn; the others are discarded, their picks kept in bounds)."""
        s, B = self.sampler, rows.numel()
        total = _round_up(self.longest + width, s.tp)
        tokens = torch.full((B, total), s.pad_id, dtype=torch.long, device=s.device)
        tokens[:, :self.longest] = self.padded[rows]
        lengths = self.lengths[rows]
        tokens.scatter_(1, lengths[:, None] + torch.arange(width, device=s.device), self.tokens[rows, :width])
        s._at(rows.repeat_interleave(total), torch.arange(total, device=s.device).repeat(B))
        logits = s.model(tokens, positions=s._positions(total))  # [B', total, V], vocab-sharded under TP
        picks = (lengths + cols - 1).clamp_max(total - 1)
        index = torch.arange(B, device=s.device)
        if isinstance(logits, DTensor):  # the rows' own positions, on the local vocab shard
            local_vocab(logits)  # raises for placements the sampler cannot read
            V = logits.shape[-1]
            picked = logits.to_local()[index, picks]
            return DTensor.from_local(picked, logits.device_mesh, _row_placements(logits), run_check=False,
                                      shape=(B, V), stride=(V, 1))
        return logits[index, picks]

    def keep(self, index: torch.Tensor, live: torch.Tensor) -> None:
        pass  # every step reads its rows' whole sequences

    def resume(self, resumed: list[tuple[int, int, int]], filler: list[int]) -> torch.Tensor:
        return torch.tensor([b for b, _, _ in resumed] + filler, device=self.sampler.device)


def _row_placements(logits: DTensor) -> list:
    """A [B, V] row pick's placements from [B, T, V] logits': a vocab shard stays one."""
    return [Shard(1) if isinstance(p, Shard) else p for p in logits.placements]


def build_sampler(model: nn.Module, *, kv_cache: bool, max_new_tokens: int, stop_ids: Sequence[int],
                  temperature: float, pad_id: int, **options) -> Sampler:
    """The cached sampler, or the oracle; `options`: _BaseSampler's max_num_seqs, check_every, autocast, compile_decode."""
    cls = KVCacheSampler if kv_cache else NoCacheSampler
    return cls(model, max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature, pad_id=pad_id,
               **options)
