"""The built-in engine: continuous batching over a KV cache allocated once for the run.

A call's rows are a queue. Up to `slots` rows decode together, one token each per step. Each reads its prompt's
entry in the cache's prompt store (one entry per distinct prompt in flight: a group's G members share it) and
writes its own slot of the completion store. The cache is allocated at the first generation and reused by every
later call (training's and evaluation's samplers share it through the job). Every `check_every` steps the host looks
at the stops, the decode loop's only host sync: a row that drew a stop id or reached max_new_tokens leaves, or
with tool turns gets its tool's ids appended and goes on in its slot; the live rows are packed to the front of the
pool (only the moved slots are copied) and the free slots take the next queued rows, a row whose prompt is in
flight joining its entry, each other distinct prompt prefilled once into an entry of its own.

1. Draws: a row's t-th token is a function of its key, t and its logits (plugin.generation.sampling), so its
   slot, its step and its companions change nothing: the no-cache oracle draws the same tokens.
2. A decode step's state lives on the device (each slot's row, last token, start, column, key, done) and the
   step updates it in place: nothing is read back between checks. Its shapes: the live rows rounded up to the
   TP degree (compiled: two at least), the completion columns and prompt positions attended.
3. Attention (`_attend`) reads the prompt entries and the slots in place, up to the longest attended, under two
   additive masks that are the cache's state: an entry's is set when it is prefilled, and a decode step opens one
   element per slot, its own column. Nothing of a step's length is built per step. A resumed row's appended ids
   are one chunk forward into its slot.
4. Ranks: TP peers hold the same rows and draw the same tokens, so they decide alike without talking, and
   data-parallel ranks decode their own queues. `lockstep` (expert parallelism, whose forwards are all-to-alls
   over the data-parallel ranks) makes every rank run the same forwards: an idle rank runs discarded ones.
"""

import heapq
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from plugin.generation.onednn import packed_linears
from plugin.generation.sampler import (NoCacheSampler, Sampler, Samples, Turns, _BaseSampler, _any_rank, _distributed,
                                       _max_rank, _round_up, _to_keys, check_prompts, generation_mode, resume_turns)
from plugin.generation.sampling import compiled_uniform, local_vocab, row_seeds, sample_sharded, uniform
from plugin.model.attention import attention_modules
from plugin.runtime import internals


@dataclass
class StepInputs:
    """Where the next forward's tokens go in the cache and what they attend; the engine sets it before each forward,
    every layer reads it. A decode step's or resumed chunk's token r is a query row; see `_attend`."""

    columns: torch.Tensor | None = None  # [R] each token's completion column; None: a prefill
    slots: torch.Tensor | None = None  # [R] each token's slot; None: token r is slot r's (a decode step)
    seen: torch.Tensor | None = None  # [R or more, C or more] additive over each token's slot's completion columns
    prompt_mask: torch.Tensor | None = None  # [E or more, L or more] additive: each entry's prompt positions
    # the columns C and prompt positions L attended, as the sizes of two index ranges: a compiled step reads the masks
    # whole and slices them itself (a slice made outside would be contiguous at the first call only: a second graph)
    span: torch.Tensor | None = None
    prompt_span: torch.Tensor | None = None
    by_prompt: torch.Tensor | None = None  # [E, G] the query rows of entry e (padding: row 0)
    where: torch.Tensor | None = None  # [R] each row's cell in by_prompt, flattened
    entries: torch.Tensor | None = None  # prefill: the entry each prefilled prompt goes to
    # prefill: the positions every entry of `entries` holds already (their shared prefix), where its tokens start
    prefilled: int = 0


class KVPool:
    """Each attention layer's keys and values of this rank's KV heads, in two stores, allocated once.

    - Prompts: `entries` entries of `prompt_length` positions, one per distinct prompt in flight. A group's G members
      read their prompt's entry: no G copies of it.
    - Completions: `slots` slots of `columns` positions, one per row in flight: the row's last prompt token (its
      first decode input), what it drew and the tool turns appended to it.
    Two additive masks are the cache's state, not rebuilt per step: `prompt_mask` [entries, prompt_length] (0 up to
    an entry's prompt length, set when it is prefilled) and `seen` [slots, columns] (0 up to what a slot holds, one
    element opened per decode step).

    K/V are allocated at the first prefill of each layer, in its dtype, and kept: a call that needs more of a dimension
    (the prompt loader caps rows at [training] seq_len + 1 positions) drops them, and its first prefill allocates the
    larger ones. `bytes()` is what they hold."""

    def __init__(self):
        self.slots = self.columns = self.entries = self.prompt_length = 0
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # completions: [slots, H_kv, columns, hd]
        self.prompts: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # [entries, H_kv, prompt_length, hd]
        self.seen = self.prompt_mask = self.ids = None

    def reserve(self, slots: int, columns: int, entries: int, prompt_length: int, layers: int,
                device: torch.device) -> None:
        """At least `slots` x `columns` and `entries` x `prompt_length` for a call."""
        want = (slots, columns, entries, prompt_length)
        have = (self.slots, self.columns, self.entries, self.prompt_length)
        if any(w > h for w, h in zip(want, have)) or len(self.layers) != layers or self.seen is None \
                or self.seen.device != device:
            grown = tuple(max(w, h) for w, h in zip(want, have))
            if self.slots:
                logger.info(f"KV cache: {have} -> {grown} (slots x columns, prompt entries x positions)")
            self.slots, self.columns, self.entries, self.prompt_length = grown
            self.layers, self.prompts = [None] * layers, [None] * layers
            self.seen = torch.full((self.slots, self.columns), -torch.inf, device=device)
            self.prompt_mask = torch.full((self.entries, self.prompt_length), -torch.inf, device=device)
            self.ids = torch.arange(max(self.columns, self.prompt_length), device=device)

    def buffers(self, layer: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s prompt K, V and completion K, V; `like` ([B, H_kv, T, hd]) allocates them if needed."""
        kv = self.layers[layer]
        if like is not None and (kv is None or kv[0].dtype != like.dtype or kv[0].shape[1] != like.shape[1]):
            _, H_kv, _, hd = like.shape
            kv = self.layers[layer] = tuple(like.new_zeros(self.slots, H_kv, self.columns, hd) for _ in "kv")
            self.prompts[layer] = tuple(like.new_zeros(self.entries, H_kv, self.prompt_length, hd) for _ in "kv")
            # a compiled step traces the stores' sizes: a pool grown for a larger call compiles nothing
            internals.lengths_vary(*((t, d) for t in (*kv, *self.prompts[layer]) for d in (0, 2)))
        return (*self.prompts[layer], *kv)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in (*self.layers, *self.prompts) if kv is not None for t in kv)

    def move(self, sources: list[int], targets: list[int], columns: int) -> None:
        """Slots `sources`' first `columns` completion columns (and their masks) to slots `targets`, in every layer."""
        src, dst = (torch.tensor(x, device=self.seen.device) for x in (sources, targets))
        self.seen[dst] = self.seen[src]
        for k, v in self.layers:
            k[dst, :, :columns] = k[src, :, :columns]
            v[dst, :, :columns] = v[src, :, :columns]


class SlotAttention(nn.Module):
    """An Attention's `inner_attention` during generation: writes this layer's K/V into the pool and attends to it.

    Prefill ([U, H, P, hd], the new distinct prompts from position 0, all but their last token): causal SDPA over
    them, their K/V into their prompt entries. Decode ([1, H, R, hd], the rows folded into the sequence dim): token r
    writes slot r's (or `slots[r]`'s) completion column `columns[r]` and attends its prompt's entry and its slot
    (`_attend`). The query heads of each KV head are folded into the query-length dim ([R, H_kv, H / H_kv, hd]), so
    grouped-query attention reads K/V in place, without `enable_gqa`'s copy.
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
        if step.columns is None:
            prompt_keys, prompt_values, _, _ = self.pool.buffers(self.layer, like=k)
            U, P, at = step.entries.shape[0], k.shape[2], step.prefilled
            # an idle peer's discarded prompt goes nowhere; a shared prefix (one row) goes to every entry
            prompt_keys[step.entries, :, at:at + P] = k[:U]
            prompt_values[step.entries, :, at:at + P] = v[:U]
            if at:  # the prompts' own tokens after their shared prefix: they attend it and themselves, causally
                k = torch.cat([prompt_keys[step.entries, :, :at], k], dim=2)
                v = torch.cat([prompt_values[step.entries, :, :at], v], dim=2)
                mask = torch.ones(P, at + P, dtype=torch.bool, device=q.device).tril(at)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        else:
            prompt_keys, prompt_values, keys, values = self.pool.buffers(self.layer)
            _, H, R, hd = q.shape
            write = torch.arange(R, device=q.device) if step.slots is None else step.slots
            keys[write, :, step.columns] = k[0].transpose(0, 1)  # [R, H_kv, hd]
            values[write, :, step.columns] = v[0].transpose(0, 1)
            H_kv = keys.shape[1]
            grouped = q[0].transpose(0, 1).reshape(R, H_kv, H // H_kv, hd)  # query head h reads KV head h // (H / H_kv)
            # compiled: dynamic sizes of the graph's inputs
            E, length, columns = step.by_prompt.shape[0], step.prompt_span.shape[0], step.span.shape[0]
            if step.slots is None:  # slots 0..R-1 in place
                keys, values = keys[:R, :, :columns], values[:R, :, :columns]
            else:  # a chunk of appended ids: copies of their slots
                keys, values = keys[step.slots, :, :columns], values[step.slots, :, :columns]
            out = _attend(grouped, keys, values, step.seen[:R, :columns], prompt_keys[:E, :, :length],
                          prompt_values[:E, :, :length], step.prompt_mask[:E, :length], step.by_prompt, step.where, scale)
            out = out.reshape(R, H, hd).transpose(0, 1)[None]  # [1, H, R, hd]
        if mesh is not None:
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, prompt_keys: torch.Tensor,
            prompt_values: torch.Tensor, prompt_mask: torch.Tensor, by_prompt: torch.Tensor, where: torch.Tensor,
            scale: float | None) -> torch.Tensor:
    """Queries [R, H_kv, G, hd] over their prompt's entry and their own slot: one softmax over both.

    - Their slots: `keys`/`values` [R, H_kv, C, hd] under `seen` [R, C], two batched matmuls.
    - Their prompts: entry e's queries are gathered to `by_prompt[e]` and meet its keys [E, H_kv, L, hd] in one
      product per entry, so a prompt's keys are read once for its G members and never gathered; row r's scores are
      cell `where[r]` of the result. Only scores and probabilities (no keys) are gathered.
    The scores are fp32 whatever the cache's dtype. On CPU fp32 batched matmuls beat SDPA's flash kernel 1.5x at decode
    shapes (its blocking is made for long queries; these have G query rows). SDPA cannot share one softmax between
    two key sets (it returns no log-sum-exp), so this serves every device."""
    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        # a CPU without native bf16 (AVX2) ran bf16 batched matmuls 4-5x slower than SDPA, batch by batch; fp32 copies
        # of what a step attends match SDPA's time (its kernel converts its blocks alike)
        q, keys, values, prompt_keys, prompt_values = (x.float() for x in (q, keys, values, prompt_keys, prompt_values))
    with torch.autocast(q.device.type, enabled=False):  # the trainer's autocast would cast them back to bf16
        return _attend_parts(q, keys, values, seen, prompt_keys, prompt_values, prompt_mask, by_prompt, where,
                             scale).to(dtype)


def _attend_parts(q, keys, values, seen, prompt_keys, prompt_values, prompt_mask, by_prompt, where, scale):
    """`_attend` in the queries' dtype."""
    R, H_kv, G, hd = q.shape
    E, members = by_prompt.shape
    scale = hd ** -0.5 if scale is None else scale
    cells = by_prompt.flatten()

    def by_entry(x):  # [R, H_kv, G, n] -> [E, H_kv, members * G, n], each entry's members' rows
        return x[cells].view(E, members, H_kv, G, -1).transpose(1, 2).reshape(E, H_kv, members * G, x.shape[-1])

    def by_row(x):  # the inverse: [E, H_kv, members * G, n] -> [R, H_kv, G, n]
        return x.view(E, H_kv, members, G, -1).transpose(1, 2).reshape(E * members, H_kv, G, x.shape[-1])[where]

    prompt = torch.matmul(by_entry(q), prompt_keys.transpose(-1, -2)).float().mul_(scale)
    prompt = by_row(prompt.add_(prompt_mask[:, None, None, :]))
    own = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale).add_(seen[:, None, None, :])
    probs = torch.cat([prompt, own], dim=-1).softmax(dim=-1).to(q.dtype)
    length = prompt.shape[-1]
    out = torch.matmul(probs[..., length:], values)
    return out.add_(by_row(torch.matmul(by_entry(probs[..., :length]), prompt_values)))


# the prefill's tokens a shared prefix must save ((prompts - 1) x its length) to go through the model on its own: a
# forward's fixed cost was about 28 tokens' compute (SmolLM2 on 2 CPU cores: 50 ms for 1 token, +1.7 ms a token)
_SHARED_PREFIX_SAVES = 32


def _visible(columns: torch.Tensor, length: int) -> torch.Tensor:
    """[R, length] additive: each token's slot up to its own column (a resumed chunk's tokens, made at a check)."""
    seen = torch.arange(length, device=columns.device)
    return torch.zeros((), device=columns.device).expand(columns.shape[0], length).masked_fill(
        seen > columns[:, None], -torch.inf)


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
        slots = _round_up(max(self.max_num_seqs or n, 1), self.tp)
        # a row's decode inputs sit at completion columns 0..max_new_tokens (its draws past its end included); the
        # columns after are scratch, for writes that are discarded. Two entries and positions at least: a compiled
        # step's sizes are never 1 (a size of 1 would be a graph of its own). A prompt entry has a position more than
        # a prefill writes, never read: an attended span as long as the store would be a graph of its own too.
        self.pool.reserve(slots, self.max_new_tokens + self.tp + 1, max(min(slots, len(set(map(tuple, prompts)))), 2),
                          max(_round_up(max(max(map(len, prompts), default=1) - 1, 1), self.tp), 2) + 1,
                          len(attention_modules(self.model)), self.device)
        routing = getattr(self.model, "routing", None)
        captures = routing is not None and routing.captures_samples
        # row n takes the draws of free slots (discarded); positions reach the last scratch column's
        length = max(map(len, prompts), default=1) + self.pool.columns
        capturing = routing.capturing(n + 1, length, self.device) if captures else nullcontext()
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
                internals.lengths_vary((tokens, 1), (positions, 1), (step.columns, 0), (step.seen, 0), (step.seen, 1),
                                       (step.prompt_mask, 0), (step.prompt_mask, 1), (step.by_prompt, 0),
                                       (step.by_prompt, 1), (step.where, 0), (step.span, 0), (step.prompt_span, 0))
                # generation_mode's force_eager is lifted for it; llama3's RoPE without complex numbers (entry 13)
                with torch.compiler.set_stance("default"), internals.llama3_real_rope():
                    return compiled(tokens, positions=positions)

            self._compiled = forward
        return self._compiled


class _Run:
    """One generate call's queue, slots, prompt entries and outputs (slot i of the live ones holds row `live[i]`, whose
    prompt is in entry `entry[i]`)."""

    def __init__(self, engine: KVCacheSampler, prompts: list[list[int]], keys: list[int], turns: Turns | None):
        self.engine, self.prompts, self.turns = engine, prompts, turns
        e, dev, pool = engine, engine.device, engine.pool
        n, N, S = len(prompts), engine.max_new_tokens, pool.slots
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
        self.slot_ids = torch.arange(S, device=dev)
        self.queue = deque(range(n))
        self.live: list[int] = []  # host: the row of each live slot, slots 0..m-1
        self.cols: list[int] = []  # host: each live slot's column (it knows every step's)
        self.entry: list[int] = []  # host: each live slot's prompt entry
        # the prompt entries: those in flight by prompt, and each one's prompt, live slots, prompt positions (all but
        # the prompt's last token) and the row whose prefill routed it (R3); the free ones lowest first, so those in
        # use stay low and a step reads few
        self.entry_of: dict[tuple, int] = {}
        U = pool.entries
        self.prompt_of, self.users, self.prefix, self.first_row = [()] * U, [0] * U, [0] * U, [0] * U
        self.free_entries = list(range(U))
        self.grouping = None  # the decode steps' (prompt_span, by_prompt, where) until the next check
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
            M = min(self.engine._rows(len(self.live)), self.S)
            self.grouping = self._grouped(self.entry + [None] * (M - len(self.live)))
            for _ in range(steps):
                self._step()
            self._check()

    def _anyone(self, flag: bool) -> bool:
        """`flag` on this rank, or with lockstep on any rank (whose forward this one must then join)."""
        return _any_rank(flag, self.engine.device) if self.engine.lockstep else flag

    def _grouped(self, entries: list[int | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For query rows reading prompt entries `entries` (None: none, a discarded row): the prompt positions that
        entries 0..E-1 hold (a span of them), each entry's rows (by_prompt [E, G], padded with row 0) and each row's
        cell in it (where [R]). Made at a check, for the steps until the next. Every size two at least, as `_rows`'s."""
        groups: dict[int, list[int]] = {}
        for r, u in enumerate(entries):
            if u is not None:
                groups.setdefault(u, []).append(r)
        E, G = max(max(groups, default=0) + 1, 2), max(max(map(len, groups.values()), default=0), 2)
        by_prompt, where = [[0] * G for _ in range(E)], [0] * len(entries)
        for u, rows in groups.items():
            for j, r in enumerate(rows):
                by_prompt[u][j], where[r] = r, u * G + j
        length = max(max((self.prefix[u] for u in groups), default=0), 2)
        dev = self.engine.device
        return self.engine.pool.ids[:length], torch.tensor(by_prompt, device=dev), torch.tensor(where, device=dev)

    def _step(self) -> None:
        """One token for every live slot, and for free slots up to the step's row count (discarded)."""
        e, m = self.engine, len(self.live)
        M = min(e._rows(m), self.S)
        rows, col = self.row[:M], self.col[:M]
        positions = self.start[:M] + col
        seen = e.pool.seen
        seen[self.slot_ids[:M], col] = 0.0  # each slot's column this step: its mask's one change
        step = e.step_inputs
        step.columns, step.slots = col, None
        step.seen, step.span = seen, e.pool.ids[:max(max(self.cols, default=0) + 1, 2)]
        step.prompt_mask, (step.prompt_span, step.by_prompt, step.where) = e.pool.prompt_mask, self.grouping
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
        at, columns, ids = [], [], []  # each appended input's slot, completion column and token
        for i, b in slots.items():
            end, more = self.ended[b], resumed[b]
            self.tokens[b, end:end + len(more)] = torch.tensor(more, device=dev)
            self.logprobs[b, end:end + len(more)] = float("nan")
            self.appended[b, end:end + len(more)] = True
            at += [i] * len(more)
            columns += range(end, end + len(more))  # column c's input is the token drawn at column c - 1
            ids += self.tokens[b, end - 1:end + len(more) - 1].tolist()
            self.turn_start[b], self.ended[b] = end + len(more), None
            self.cols[i] = end + len(more)
        # to a multiple of the TP degree (and one at least: a forward every peer runs), writes that are discarded:
        # at a resumed row's next column, which its next step overwrites, or at slot 0's last scratch column
        pad = _round_up(max(len(ids), 1), e.tp) - len(ids)
        if slots:
            i = next(reversed(slots))
            at, columns = at + [i] * pad, columns + [self.cols[i]] * pad
        else:
            at, columns = at + [0] * pad, columns + [e.pool.columns - 1] * pad
        ids += [e.pad_id] * pad
        step = e.step_inputs
        step.slots, step.columns = torch.tensor(at, device=dev), torch.tensor(columns, device=dev)
        step.span = e.pool.ids[:max(max(columns) + 1, 2)]
        step.seen = _visible(step.columns, step.span.shape[0])
        step.prompt_mask, (step.prompt_span, step.by_prompt, step.where) = e.pool.prompt_mask, self._grouped(
            [self.entry[i] if i < len(self.entry) else None for i in at])
        positions = self.start[step.slots] + step.columns
        e._at(self.row[step.slots], positions)
        e.model.hidden_states(torch.tensor([ids], device=dev), positions=positions.clamp_max(e.max_seq_len - 1)[None])
        step.slots = None
        if slots:
            index = torch.tensor(list(slots), device=dev)
            self.col[index] = torch.tensor([self.cols[i] for i in slots], device=dev)
            self.last[index] = self.tokens[torch.tensor(list(slots.values()), device=dev), self.col[index] - 1]
            self.done[index] = False
            # a resumed slot holds the columns before its next input's; its discarded draws' past them are hidden
            e.pool.seen[index] = _visible(self.col[index] - 1, e.pool.columns)

    def _free(self, leaving: list[int]) -> None:
        """Slots `leaving` are free (and their prompt entries, if no slot reads them): the live slots after the last
        kept one move into the holes."""
        m, gone = len(self.live), set(leaving)
        for i in leaving:
            u = self.entry[i]
            self.users[u] -= 1
            if not self.users[u]:
                del self.entry_of[self.prompt_of[u]]
                heapq.heappush(self.free_entries, u)
        kept = m - len(leaving)
        holes = [i for i in range(kept) if i in gone]
        movers = [i for i in range(kept, m) if i not in gone]
        if holes:
            self.engine.pool.move(movers, holes, max(self.cols[i] for i in movers) + 1)
            src, dst = (torch.tensor(x, device=self.engine.device) for x in (movers, holes))
            for state in (self.row, self.start, self.col, self.last, self.key, self.done):
                state[dst] = state[src]
            for h, s in zip(holes, movers):
                self.live[h], self.cols[h], self.entry[h] = self.live[s], self.cols[s], self.entry[s]
        del self.live[kept:], self.cols[kept:], self.entry[kept:]
        self.row[kept:m], self.col[kept:m], self.start[kept:m], self.done[kept:m] = self.n, 0, 0, True

    def _admit(self) -> None:
        """Queued rows into the free slots. A row whose prompt is in flight reads its entry; each other distinct prompt
        among them is prefilled once, into an entry of its own."""
        e, dev = self.engine, self.engine.device
        rows = [self.queue.popleft() for _ in range(min(self.S - len(self.live), len(self.queue)))]
        entries, new = [], []  # each row's entry; the entries to prefill
        for b in rows:
            prompt = tuple(self.prompts[b])
            u = self.entry_of.get(prompt)
            if u is None:  # a free entry is there: those in use are at most the distinct prompts, and the slots
                u = self.entry_of[prompt] = heapq.heappop(self.free_entries)
                self.prompt_of[u], self.prefix[u], self.first_row[u] = prompt, len(prompt) - 1, b
                new.append(u)
            self.users[u] += 1
            entries.append(u)
        if self._anyone(bool(new)):
            self._prefill(new, rows, entries)
        joined = [(b, u) for b, u in zip(rows, entries) if u not in new]
        if joined and e._capture is not None:  # their prompt's routing is the row's that prefilled it
            e._capture.copy([b for b, _ in joined], [self.first_row[u] for _, u in joined],
                            [self.prefix[u] for _, u in joined])
        if not rows:
            return
        index = self.slot_ids[len(self.live):len(self.live) + len(rows)]
        self.row[index] = torch.tensor(rows, device=dev)
        self.start[index] = torch.tensor([self.starts[b] for b in rows], device=dev)
        self.col[index] = 0
        self.last[index] = torch.tensor([self.prompts[b][-1] for b in rows], device=dev)
        self.key[index] = self.keys[rows]
        self.done[index] = False
        e.pool.seen[index] = -torch.inf  # a slot holds nothing until its first step writes column 0
        self.live += rows
        self.cols += [0] * len(rows)
        self.entry += entries

    def _prefill(self, new: list[int], rows: list[int], entries: list[int]) -> None:
        """Entries `new`'s prompts (all but each one's last token) through the model at once, their K/V into their
        entries; an idle peer prefills a discarded prompt. A prefix they all share (`_shared_prefix`) goes through
        the model once, as one row, into every entry; then their own tokens, which attend it."""
        e, dev, pool = self.engine, self.engine.device, self.engine.pool
        firsts = [list(self.prompt_of[u])[:-1] for u in new] or [[e.pad_id]]
        step = e.step_inputs
        step.columns, step.entries = None, torch.tensor(new, dtype=torch.long, device=dev)
        shared = self._shared_prefix(firsts)
        if shared:
            e.model.hidden_states(torch.tensor([firsts[0][:shared]], device=dev), positions=e._positions(shared))
            step.prefilled, firsts = shared, [p[shared:] for p in firsts]
        P = _round_up(max(max(map(len, firsts)), 1), e.tp)
        if not shared:  # a routing capture shares no prefix: each row's routing is its prompt's (moe.Routing)
            order = {u: k for k, u in enumerate(new)}
            routed = [(b, order[u]) for b, u in zip(rows, entries) if u in order] or [(self.n, 0)]
            cols = torch.arange(P, device=dev)
            e._at(torch.tensor([b for b, _ in routed], device=dev).repeat_interleave(P), cols.repeat(len(routed)),
                  (torch.tensor([k for _, k in routed], device=dev)[:, None] * P + cols).flatten())
        if max(map(len, firsts)) or not shared:  # none left where the prompts differ in their last token alone
            e.model.hidden_states(e._padded(firsts, P), positions=e._positions(P, shared))
        if new:
            pool.prompt_mask[step.entries] = _visible(torch.tensor([self.prefix[u] for u in new], device=dev) - 1,
                                                      pool.prompt_length)
        step.entries, step.prefilled = None, 0

    def _shared_prefix(self, prompts: list[list[int]]) -> int:
        """The positions that the prompts to prefill all begin with, when worth a forward of their own (0: none):
        cut to a multiple of the TP degree (which shards a forward's sequence), saving `_SHARED_PREFIX_SAVES` tokens.
        None under a routing capture (R3 records each row's own prompt's routing) or lockstep ranks (whose forwards
        must be the same in number on every rank)."""
        e = self.engine
        if len(prompts) < 2 or e._capture is not None or (e.lockstep and _distributed()):
            return 0
        shortest = min(map(len, prompts))
        n = next((i for i in range(shortest) if any(p[i] != prompts[0][i] for p in prompts)), shortest)
        n -= n % e.tp
        return n if (len(prompts) - 1) * n >= _SHARED_PREFIX_SAVES else 0

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
