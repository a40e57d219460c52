"""The built-in engine: continuous batching over a KV cache of slots allocated once for the run.

A call's rows are a queue. Up to `slots` rows decode together, one token each per step, each against its own
slot of a cache allocated at the first generation and reused by every later call (training's and evaluation's
samplers share it through the job). Every `check_every` steps the host looks at the stops, the decode loop's
only host sync: a row that drew a stop id or reached max_new_tokens leaves, or with tool turns gets its
tool's ids appended and goes on in its slot; the live rows are packed to the front of the pool (only the
moved slots are copied) and the free slots take the next queued rows, a group's prompt prefilled once.

1. Draws: a row's t-th token is a function of its key, t and its logits (plugin.generation.sampling), so its
   slot, its step and its companions change nothing: the no-cache oracle draws the same tokens.
2. A decode step's state lives on the device (each slot's row, last token, start, column, key, done) and the
   step updates it in place: nothing is read back between checks. Its shapes: the live rows rounded up to the
   TP degree (compiled: a power of two), and the cache positions attended.
3. Attention reads its rows' slots in place, up to the longest position attended, through an additive
   [M, 1, 1, length] mask made once per step for every layer. A resumed row's appended ids are one chunk forward
   into its slot.
4. Ranks: TP peers hold the same rows and draw the same tokens, so they decide alike without talking, and
   data-parallel ranks decode their own queues. `lockstep` (expert parallelism, whose forwards are all-to-alls
   over the data-parallel ranks) makes every rank run the same forwards: an idle rank runs discarded ones.
"""

from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from plugin.generation.onednn import packed_linears
from plugin.generation.sampler import (NoCacheSampler, Sampler, Samples, Turns, _BaseSampler, _any_rank, _max_rank,
                                       _round_up, _to_keys, check_prompts, generation_mode, resume_turns)
from plugin.generation.sampling import compiled_uniform, local_vocab, row_seeds, sample_sharded, uniform
from plugin.model.attention import attention_modules
from plugin.runtime import internals


@dataclass
class StepInputs:
    """Where the next forward's tokens go in the cache; the engine sets it before each forward, every layer reads it."""

    positions: torch.Tensor | None = None  # [M] each input token's position; None: a prefill from position 0
    slots: torch.Tensor | None = None  # [M] each token's slot; None: token i is slot i's (a decode step)
    mask: torch.Tensor | None = None  # [M, 1, 1, length] additive, over the cache positions attended: each token
    # sees its slot up to its position
    members: torch.Tensor | None = None  # prefill: the slot of each member row
    member_prompt: torch.Tensor | None = None  # prefill: each member's row of the prefilled (distinct) prompts


class KVPool:
    """Each attention layer's K and V for `slots` rows of `length` positions, this rank's KV heads.

    Allocated at the first prefill of each layer, in its dtype, and kept: a call that needs more slots or longer
    rows (at most [training] seq_len + 1 positions) drops it, and its first prefill allocates the larger one.
    `bytes()` is what it holds."""

    def __init__(self):
        self.length = self.slots = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def reserve(self, slots: int, length: int, layers: int) -> None:
        """At least `slots` slots of `length` positions for a call."""
        if slots > self.slots or length > self.length or len(self.layers) != layers:
            if self.slots:
                logger.info(f"KV cache: {self.slots} x {self.length} -> {max(slots, self.slots)} x "
                            f"{max(length, self.length)} (slots x positions)")
            self.slots, self.length = max(slots, self.slots), max(length, self.length)
            self.layers = [None] * layers

    def buffers(self, layer: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V [slots, H_kv, length, hd]; `like` ([B, H_kv, T, hd]) allocates them if needed."""
        kv = self.layers[layer]
        if like is not None and (kv is None or kv[0].dtype != like.dtype or kv[0].shape[1] != like.shape[1]):
            shape = (self.slots, like.shape[1], self.length, like.shape[3])
            kv = self.layers[layer] = (like.new_zeros(shape), like.new_zeros(shape))
            # a compiled step traces the slots and positions as sizes: a pool grown for a larger call compiles nothing
            internals.lengths_vary((kv[0], 0), (kv[1], 0), (kv[0], 2), (kv[1], 2))
        return kv

    def bytes(self) -> int:
        return sum(2 * kv[0].numel() * kv[0].element_size() for kv in self.layers if kv is not None)

    def move(self, sources: list[int], targets: list[int], length: int) -> None:
        """Slots `sources`' first `length` positions to slots `targets`, in every layer."""
        src, dst = (torch.tensor(x, device=self.layers[0][0].device) for x in (sources, targets))
        for k, v in self.layers:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


class SlotAttention(nn.Module):
    """An Attention's `inner_attention` during generation: writes this layer's K/V into the pool and attends to it.

    Prefill ([U, H, P, hd], distinct prompts from position 0): causal SDPA over the prompts, whose K/V go to
    each member's slot. Decode ([1, H, M, hd], the rows folded into the sequence dim): token m writes slot m's
    (or `slots[m]`'s) position `positions[m]` and attends to that slot up to it. The query heads of each KV
    head are folded into SDPA's query-length dim ([M, H_kv, H / H_kv, hd]), so grouped-query attention reads
    K/V in place, without `enable_gqa`'s copy.
    """

    def __init__(self, step: StepInputs, pool: KVPool, layer: int):
        super().__init__()
        self.step, self.pool, self.layer = step, pool, layer

    def forward(self, q, k, v, *, scale=None, enable_gqa: bool = False, **_):
        mesh = placements = None
        if isinstance(q, DTensor):  # qwen3's TP plan hands head-sharded DTensors; attention never mixes heads
            mesh, placements = q.device_mesh, q.placements
            q, k, v = q.to_local(), k.to_local(), v.to_local()
        step = self.step
        if step.positions is None:
            keys, values = self.pool.buffers(self.layer, like=k)
            P = k.shape[2]
            keys[step.members, :, :P] = k[step.member_prompt]
            values[step.members, :, :P] = v[step.member_prompt]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        else:
            keys, values = self.pool.buffers(self.layer)
            _, H, M, hd = q.shape
            write = torch.arange(M, device=q.device) if step.slots is None else step.slots
            keys[write, :, step.positions] = k[0].transpose(0, 1)  # [M, H_kv, hd]
            values[write, :, step.positions] = v[0].transpose(0, 1)
            H_kv = keys.shape[1]
            grouped = q[0].transpose(0, 1).reshape(M, H_kv, H // H_kv, hd)  # query head h reads KV head h // (H / H_kv)
            length = step.mask.shape[-1]  # compiled: a dynamic size of the graph's input
            if step.slots is None:  # slots 0..M-1 in place
                keys, values = keys[:M, :, :length], values[:M, :, :length]
            else:  # a chunk of appended ids: copies of their slots
                keys, values = keys[step.slots, :, :length], values[step.slots, :, :length]
            out = _decode_attention(grouped, keys, values, step.mask.to(q.dtype), scale)
            out = out.reshape(M, H, hd).transpose(0, 1)[None]  # [1, H, M, hd]
        if mesh is not None:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """[M, H_kv, G, hd] queries over [M, H_kv, length, hd] keys and values under an additive mask.

    CPU fp32: two batched matmuls and a softmax, 1.5x SDPA's flash kernel at decode shapes here (its blocking is
    made for long queries; these have G rows); elsewhere SDPA (benchmarks/engine_speed.py)."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5 if scale is None else scale).add_(mask)
    return torch.matmul(scores.softmax(dim=-1), v)


def _mask(positions: torch.Tensor, length: int) -> torch.Tensor:
    """[M, 1, 1, length] additive: each token's slot up to its own position; made once per forward for every layer."""
    seen = torch.arange(length, device=positions.device)
    return torch.zeros((), device=positions.device).expand(positions.shape[0], length).masked_fill(
        seen > positions[:, None], -torch.inf)[:, None, None, :]


class KVCacheSampler(_BaseSampler):
    """The built-in engine (the module's docstring): `pool` is the run's cache (one is made if None), `lockstep`
    whether every rank of the default group runs the same forwards (the safe default; off where only TP peers'
    forwards talk, which hold the same rows anyway)."""

    def __init__(self, model: nn.Module, *, pool: KVPool | None = None, lockstep: bool = True, **options):
        super().__init__(model, **options)
        self.pool = pool if pool is not None else KVPool()
        self.lockstep = lockstep
        self.step_inputs = StepInputs()
        self._compiled = None  # the compiled decode forward, made once (compile_decode)

    def generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None = None) -> Samples:
        """Sample a completion for each prompt; every rank calls this at the same time (see the module's docstring)."""
        check_prompts(prompts, keys, self.max_seq_len, self.max_new_tokens, self.device)
        n = len(prompts)
        # a row's inputs sit at positions up to len(prompt) - 1 + max_new_tokens (its draws past its end included);
        # the position after the longest row's is scratch, for writes that are discarded
        self.pool.reserve(_round_up(max(self.max_num_seqs or n, 1), self.tp),
                          max(map(len, prompts), default=1) + self.max_new_tokens + self.tp + 1,
                          len(attention_modules(self.model)))
        routing = getattr(self.model, "routing", None)
        captures = routing is not None and routing.captures_samples
        # row n takes the draws of free slots (discarded); positions reach the pool's length
        capturing = routing.capturing(n + 1, self.pool.length, self.device) if captures else nullcontext()
        with generation_mode(self.model), self.autocast(), self._attached(), capturing as capture:
            self._capture = capture
            try:
                run = _Run(self, prompts, keys, turns)
                run.decode()
            finally:
                self._capture = None
        out = run.samples()
        if captures:  # each sequence's input positions: its prompt and completion but the last token
            out.routed_experts = [capture.row(b, len(p) + len(c) - 1)
                                  for b, (p, c) in enumerate(zip(prompts, out.completions))]
        return out

    @contextmanager
    def _attached(self):
        """Every attention's inner_attention a SlotAttention over the pool; on CPU eager, linears on packed weights."""
        swapped = [(m, m.inner_attention, m.attn_type) for m in attention_modules(self.model)]
        for i, (m, _, _) in enumerate(swapped):
            # torchtitan calls it SDPA's way, also where padding-free training set "varlen" (plugin.model.attention)
            m.inner_attention, m.attn_type = SlotAttention(self.step_inputs, self.pool, i), "sdpa"
        try:
            with packed_linears(self.model):
                yield
        finally:
            for m, inner, attn_type in swapped:
                m.inner_attention, m.attn_type = inner, attn_type

    def _rows(self, count: int) -> int:
        """Rows a decode step of `count` live ones holds: a multiple of the TP degree (which shards them);
        compiled, two at least: dynamo specializes a size of 1, which would be a second graph."""
        return _round_up(max(count, 2 if self.compile_decode else 1), self.tp)

    def decode_forward(self):
        """The model's forward for decode steps: compiled once for the run with compile_decode."""
        if not self.compile_decode:
            return self.model
        if self._compiled is None:
            compiled = torch.compile(self.model.forward)
            step = self.step_inputs

            def forward(tokens, positions):
                # one graph for any row count and attended length: they are traced as sizes, not constants
                internals.lengths_vary((tokens, 1), (positions, 1), (step.positions, 0), (step.mask, 0),
                                       (step.mask, 3))
                with torch.compiler.set_stance("default"):  # generation_mode's force_eager is lifted for it
                    return compiled(tokens, positions=positions)

            self._compiled = forward
        return self._compiled


class _Run:
    """One generate call's queue, slots and outputs (slot i of the live ones holds row `live[i]`)."""

    def __init__(self, engine: KVCacheSampler, prompts: list[list[int]], keys: list[int], turns: Turns | None):
        self.engine, self.prompts, self.turns = engine, prompts, turns
        e, dev = engine, engine.device
        n, N, S = len(prompts), engine.max_new_tokens, engine.pool.slots
        self.n, self.N, self.S = n, N, S
        # row n: where free slots' draws go (discarded); column N: finished rows' draws until the next check
        self.tokens = torch.full((n + 1, N + 1), e.pad_id, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros((n + 1, N + 1), dtype=torch.float32, device=dev)
        self.appended = torch.zeros((n + 1, N + 1), dtype=torch.bool, device=dev)  # a tool turn's ids
        self.keys = _to_keys(list(keys) + [0], dev)
        self.starts = [len(p) - 1 for p in prompts]  # host: the position of each row's first decode input
        self.stops = torch.tensor(e.stop_ids, dtype=torch.long, device=dev)
        # each slot's state on the device, updated by the decode step in place
        self.row = torch.full((S,), n, dtype=torch.long, device=dev)
        self.start = torch.zeros(S, dtype=torch.long, device=dev)
        self.col = torch.zeros(S, dtype=torch.long, device=dev)
        self.last = torch.full((S,), e.pad_id, dtype=torch.long, device=dev)
        self.key = torch.zeros(S, dtype=torch.long, device=dev)
        self.done = torch.ones(S, dtype=torch.bool, device=dev)
        self.queue = deque(range(n))
        self.live: list[int] = []  # host: the row of each live slot, slots 0..m-1
        self.cols: list[int] = []  # host: each live slot's column (it knows every step's)
        self.turn_start, self.ended, self.truncated = [0] * n, [None] * n, [False] * n
        self.forward = engine.decode_forward()
        self.uniform = compiled_uniform() if engine.compile_decode else uniform

    def decode(self) -> None:
        self._admit()
        while True:
            # the steps until the next check: no live row needs more than N - its column
            steps = min(self.engine.check_every, max((self.N - c for c in self.cols), default=0))
            if self.engine.lockstep:
                steps = _max_rank(steps, self.engine.device)
            if steps == 0:
                return
            for _ in range(steps):
                self._step()
            self._check()

    def _anyone(self, flag: bool) -> bool:
        """`flag` on this rank, or with lockstep on any rank (whose forward this one must then join)."""
        return _any_rank(flag, self.engine.device) if self.engine.lockstep else flag

    def _step(self) -> None:
        """One token for every live slot, and for free slots up to the step's row count (discarded)."""
        e, m = self.engine, len(self.live)
        M = min(e._rows(m), self.S)
        rows, col = self.row[:M], self.col[:M]
        positions = self.start[:M] + col
        length = max((self.starts[b] + c for b, c in zip(self.live, self.cols)), default=0) + 1
        step = e.step_inputs
        step.positions, step.slots, step.mask = positions, None, _mask(positions, length)
        e._at(rows, positions)
        # a finished row's discarded draw at column N sits at most at position max_seq_len, past the RoPE table
        logits = self.forward(self.last[:M][None], positions=positions.clamp_max(e.max_seq_len - 1)[None])
        local, shard = local_vocab(logits)
        token, logprob = sample_sharded(local.reshape(-1, local.shape[-1]), shard, row_seeds(self.key[:M], col),
                                        e.temperature, self.uniform)
        self.tokens[rows, col], self.logprobs[rows, col] = token, logprob
        self.done[:M] |= torch.isin(token, self.stops) | (col + 1 >= self.N)
        self.last[:M] = token
        self.col[:M] = (col + 1).clamp_max(self.N)
        self.cols = [min(c + 1, self.N) for c in self.cols]

    def _check(self) -> None:
        """The host sync: finished rows leave (or go on after a tool turn), the live ones move to the front, the
        free slots take queued rows."""
        m = len(self.live)
        finished = [i for i, d in enumerate(self.done[:m].tolist()) if d]
        resumed = self._turns_end([self.live[i] for i in finished]) if finished and self.turns is not None else {}
        self._resume(resumed, {self.live.index(b): b for b in resumed})
        leaving = [i for i in finished if self.live[i] not in resumed]
        if leaving:
            self._free(leaving)
        self._admit()

    def _turns_end(self, rows: list[int]) -> dict[int, list[int]]:
        """Where each finished row's turn ended (its first stop id from the turn's start; None: the budget), and the
        rows that `turns` resumes, with the ids appended after their stop id."""
        N, stop_ids = self.N, set(self.engine.stop_ids)
        ids = self.tokens[rows].tolist()
        for b, row in zip(rows, ids):
            self.ended[b] = next((j + 1 for j in range(self.turn_start[b], N) if row[j] in stop_ids), None)
        stopped = [b for b in rows if self.ended[b] is not None]
        outcome = resume_turns(self.turns, stopped, [ids[rows.index(b)][:self.ended[b]] for b in stopped], N)
        for b in outcome.truncated:
            self.truncated[b] = True
        return outcome.resumed

    def _resume(self, resumed: dict[int, list[int]], slots: dict[int, int]) -> None:
        """The resumed rows' appended ids into their cache: the stop id and the appended ids but the last run through
        the model at once (the last is the next step's input); their slots decode on from after them."""
        e, dev = self.engine, self.engine.device
        if not self._anyone(bool(resumed)):
            return
        at, where, ids = [], [], []  # each appended input's slot, position and token
        for i, b in slots.items():
            end, more = self.ended[b], resumed[b]
            self.tokens[b, end:end + len(more)] = torch.tensor(more, device=dev)
            self.logprobs[b, end:end + len(more)] = float("nan")
            self.appended[b, end:end + len(more)] = True
            at += [i] * len(more)
            where += range(self.starts[b] + end, self.starts[b] + end + len(more))  # column c's token: start + 1 + c
            ids += self.tokens[b, end - 1:end + len(more) - 1].tolist()
            self.turn_start[b], self.ended[b] = end + len(more), None
            self.cols[i] = end + len(more)
        # to a multiple of the TP degree (and one at least: a forward every peer runs), writes that are discarded:
        # at a resumed row's next position, which its next step overwrites, or past every row's last position
        pad = _round_up(max(len(ids), 1), e.tp) - len(ids)
        if slots:
            i, b = next(reversed(slots.items()))
            at, where = at + [i] * pad, where + [self.starts[b] + self.cols[i]] * pad
        else:
            at, where = at + [0] * pad, where + [self.engine.pool.length - 1] * pad
        ids += [e.pad_id] * pad
        step = e.step_inputs
        step.slots = torch.tensor(at, device=dev)
        step.positions = torch.tensor(where, device=dev)
        step.mask = _mask(step.positions, max(where) + 1)
        e._at(self.row[step.slots], step.positions)
        e.model.hidden_states(torch.tensor([ids], device=dev),
                              positions=step.positions.clamp_max(e.max_seq_len - 1)[None])
        step.slots = None
        if slots:
            index = torch.tensor(list(slots), device=dev)
            self.col[index] = torch.tensor([self.cols[i] for i in slots], device=dev)
            self.last[index] = self.tokens[torch.tensor(list(slots.values()), device=dev), self.col[index] - 1]
            self.done[index] = False

    def _free(self, leaving: list[int]) -> None:
        """Slots `leaving` are free: the live slots after the last kept one move into the holes."""
        m, gone = len(self.live), set(leaving)
        kept = m - len(leaving)
        holes = [i for i in range(kept) if i in gone]
        movers = [i for i in range(kept, m) if i not in gone]
        if holes:
            length = max(self.starts[self.live[i]] + self.cols[i] for i in movers) + 1
            self.engine.pool.move(movers, holes, length)
            src, dst = (torch.tensor(x, device=self.engine.device) for x in (movers, holes))
            for state in (self.row, self.start, self.col, self.last, self.key, self.done):
                state[dst] = state[src]
            for h, s in zip(holes, movers):
                self.live[h], self.cols[h] = self.live[s], self.cols[s]
        del self.live[kept:], self.cols[kept:]
        self.row[kept:m], self.col[kept:m], self.start[kept:m], self.done[kept:m] = self.n, 0, 0, True

    def _admit(self) -> None:
        """Queued rows into the free slots: each distinct prompt among them prefilled once, into each member's slot."""
        e, dev = self.engine, self.engine.device
        rows = [self.queue.popleft() for _ in range(min(self.S - len(self.live), len(self.queue)))]
        if not self._anyone(bool(rows)):
            return
        prompts = [self.prompts[b] for b in rows] or [[e.pad_id]]  # an idle peer prefills a discarded prompt
        distinct: dict[tuple, int] = {}
        member_prompt = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=dev)
        firsts = [list(p) for p in distinct]
        P = _round_up(max(max(map(len, firsts)) - 1, 1), e.tp)  # all but each prompt's last token
        slots = list(range(len(self.live), len(self.live) + len(rows)))
        step = e.step_inputs
        step.positions, step.members = None, torch.tensor(slots, dtype=torch.long, device=dev)
        step.member_prompt = member_prompt[:len(rows)]
        cols = torch.arange(P, device=dev)
        e._at(torch.tensor(rows or [self.n], device=dev).repeat_interleave(P), cols.repeat(max(len(rows), 1)),
              (member_prompt[:, None] * P + cols).flatten())  # a distinct prompt's tokens, for each of its rows
        e.model.hidden_states(e._padded([p[:-1] for p in firsts], P), positions=e._positions(P))
        step.members = step.member_prompt = None
        if not rows:
            return
        index = torch.tensor(slots, device=dev)
        self.row[index] = torch.tensor(rows, device=dev)
        self.start[index] = torch.tensor([self.starts[b] for b in rows], device=dev)
        self.col[index] = 0
        self.last[index] = torch.tensor([self.prompts[b][-1] for b in rows], device=dev)
        self.key[index] = self.keys[rows]
        self.done[index] = False
        self.live += rows
        self.cols += [0] * len(rows)

    def samples(self) -> Samples:
        n, N, multi_turn = self.n, self.N, self.turns is not None
        out = Samples([], [], [], [] if multi_turn else None)
        stop_ids = set(self.engine.stop_ids)
        for b, (ids, lps, tool) in enumerate(zip(self.tokens[:n].tolist(), self.logprobs[:n].tolist(),
                                                  self.appended[:n].tolist())):
            end = self.ended[b] if multi_turn else next((j + 1 for j, x in enumerate(ids[:N]) if x in stop_ids), None)
            out.completions.append(ids[:end or N])
            out.logprobs.append(lps[:end or N])
            out.truncated.append(end is None or self.truncated[b])
            if multi_turn:
                out.tool_mask.append([int(not x) for x in tool[:end or N]])
        return out


def build_sampler(model: nn.Module, *, kv_cache: bool, max_new_tokens: int, stop_ids, temperature: float,
                  pad_id: int, pool: KVPool | None = None, lockstep: bool = True, **options) -> Sampler:
    """The built-in engine, or with kv_cache False the no-cache oracle; `options`: max_num_seqs, check_every,
    autocast, compile_decode (_BaseSampler)."""
    common = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, temperature=temperature, pad_id=pad_id, **options)
    if not kv_cache:
        return NoCacheSampler(model, **common)
    return KVCacheSampler(model, pool=pool, lockstep=lockstep, **common)
