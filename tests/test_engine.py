"""The built-in engine's scheduler and cache (plugin.generation.engine): continuous batching, a cache allocated once,
decode steps with no host sync between stop checks, and a compiled step compiled once per run.

Its draws are judged against the no-cache oracle in tests/test_sampler.py, on every layout; here the same draws
are the baseline each scheduling change is held to.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_sampler import (KEYS, LOGPROB_ATOL, N, PAD, TEMPERATURE, build, max_logprob_diff, prefill_shapes, prompts,
                          shared_prefix_draws, shared_prefix_prompts)

from plugin.generation import engine
from plugin.generation.engine import KVPool, build_sampler

# ops whose result shape or value the host must read: a host-device sync on a GPU
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}
# Python's ways of reading a tensor on the host
SYNC_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


def _sampler(model, stops=(), **options):
    return build_sampler(model, kv_cache=True, max_new_tokens=N, stop_ids=list(stops), temperature=TEMPERATURE,
                         pad_id=PAD, **options)


@pytest.fixture(scope="module")
def llama():
    """The 1-rank llama3 model, stop ids part-way through some rows, and its draws with every row in a slot."""
    model = build("grpo_llama3")
    first = _sampler(model).generate(prompts(), KEYS).completions
    stops = [first[1][4], first[3][8]]
    return model, stops, _sampler(model, stops).generate(prompts(), KEYS)


class _Log(TorchDispatchMode):
    """Every aten op dispatched, by name, and the allocations of at least `big` elements."""

    def __init__(self, events: list, big: int):
        super().__init__()
        self.events, self.big = events, big

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in SYNC_OPS:
            self.events.append(("sync", name))
        if name in ("empty", "zeros", "full", "new_zeros", "new_empty", "empty_strided", "clone") \
                and isinstance(out, torch.Tensor) and out.numel() >= self.big:
            self.events.append(("alloc", name, tuple(out.shape)))
        return out


@contextlib.contextmanager
def _watch(events: list, big: int):
    """Log host reads (SYNC_METHODS), sync ops and large allocations; each stop check is an event of its own."""
    saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}
    check, step = engine._Run._check, engine._Run._step

    def reader(name):
        def read(self, *args, **kwargs):
            events.append(("sync", name))
            return saved[name](self, *args, **kwargs)
        return read

    def checked(self):
        events.append(("check",))
        return check(self)

    def stepped(self):
        events.append(("step",))
        return step(self)

    try:
        for m in SYNC_METHODS:
            setattr(torch.Tensor, m, reader(m))
        engine._Run._check, engine._Run._step = checked, stepped
        with _Log(events, big):
            yield
    finally:
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)
        engine._Run._check, engine._Run._step = check, step


def test_decode_steps_make_no_host_sync_and_allocate_no_cache_between_checks(llama):
    """From a call's first decode step to its last, only the stop checks read anything back: the steps between two
    checks dispatch no sync op and no Python read of a tensor, and allocate nothing as large as a layer's cache."""
    model, stops, base = llama
    pool = KVPool()
    sampler = _sampler(model, stops, check_every=4, pool=pool)
    sampler.generate(prompts()[:2], KEYS[:2])  # the pool's first allocation
    layer = pool.layers[0][0].numel() + pool.prompts[0][0].numel()  # one layer's K: what a gather of keys makes
    events = []
    with _watch(events, layer):
        got = sampler.generate(prompts(), KEYS)
    assert got.completions == base.completions
    # what a step dispatches follows its marker until the next marker; a check's reads follow the check's
    in_steps, owner, steps, checks = [], None, 0, 0
    for e in events:
        if e in (("step",), ("check",)):
            owner = e[0]
            steps, checks = steps + (owner == "step"), checks + (owner == "check")
        elif owner == "step":
            in_steps.append(e)
    print(f"{steps} steps, {checks} checks")
    assert steps >= 2 * checks > 0
    assert not in_steps, in_steps[:10]


def test_slots_take_queued_rows_as_others_finish(llama):
    """max_num_seqs = 2 over 7 rows: at most 2 rows decode at once, a freed slot takes the next queued row at the next
    check, and the draws are those of every row in a slot of its own."""
    model, stops, base = llama
    rows, admitted = [], []
    handle = model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    admit = engine._Run._admit

    def admitting(self):
        before = len(self.queue)
        admit(self)
        admitted.append(before - len(self.queue))

    engine._Run._admit = admitting
    try:
        got = _sampler(model, stops, max_num_seqs=2, check_every=1).generate(prompts(), KEYS)
    finally:
        engine._Run._admit = admit
        handle.remove()
    assert got.completions == base.completions and got.truncated == base.truncated
    assert max_logprob_diff(got, base) <= LOGPROB_ATOL
    assert max(rows) == 2 and admitted[0] == 2 and sum(admitted) == len(KEYS)
    # a row that stops early hands its slot over: fewer steps than 4 consecutive calls of 2 rows would take
    lengths = [len(c) for c in got.completions]
    consecutive = sum(max(lengths[i:i + 2]) for i in range(0, len(lengths), 2))
    assert len(rows) < consecutive, (len(rows), consecutive)


def test_a_row_joins_its_prompts_entry_while_a_member_is_in_flight(llama):
    """A group's members read one prompt entry, also across admissions: 2 slots over [P3, P1, P3]; row 1 (P1) stops
    after 5 tokens and row 2 takes its slot while row 0 (P3) still decodes, so it reads row 0's entry, with no second
    prefill. The draws are each row's alone. The cache holds 2 prompt entries, not a prompt per slot."""
    model, stops, base = llama
    P = prompts()
    rows, keys = [P[3], P[1], P[3]], [KEYS[3], KEYS[1], KEYS[0]]
    assert len(base.completions[1]) < len(base.completions[3])  # row 1 frees its slot first
    pool = KVPool()
    with prefill_shapes(model) as prefills:
        got = _sampler(model, stops, max_num_seqs=2, check_every=1, pool=pool).generate(rows, keys)
    assert [n for n, _ in prefills] == [2]  # the first admission's two distinct prompts; row 2 joined P3's entry
    assert pool.entries == 2 and pool.prompts[0][0].shape[0] == 2
    assert got.completions[:2] == [base.completions[3], base.completions[1]]
    alone = _sampler(model, stops).generate([P[3]], [KEYS[0]])
    assert got.completions[2] == alone.completions[0]
    assert max(abs(x - y) for x, y in zip(alone.logprobs[0], got.logprobs[2])) <= LOGPROB_ATOL


def test_prompts_admitted_together_prefill_their_shared_prefix_once(llama):
    """Distinct prompts admitted together that begin alike: their shared ids go through the model once, as one row,
    into every entry, then each prompt's own ids attend them; the draws are the oracle's. Prompts that differ in
    their last id alone (the decode's first input) need no second forward; two prompts sharing 20 ids save too little
    for a forward of their own (engine._SHARED_PREFIX_SAVES)."""
    model, stops, _ = llama
    shared, rows = shared_prefix_prompts()
    got = shared_prefix_draws(model, stops)
    assert got["prefills"] == [(1, shared), (3, 5)]  # the third prompt's own ids: its last one alone
    assert got["cached"].completions == got["oracle"].completions
    assert max_logprob_diff(got["cached"], got["oracle"]) <= LOGPROB_ATOL
    common = rows[0][:shared]
    for tails, forwards in (([[5], [6], [7]], [(1, shared)]), ([[5, 8], [6, 8]], [(2, shared + 1)])):
        got = shared_prefix_draws(model, stops, [common + t for t in tails])
        assert got["prefills"] == forwards
        assert got["cached"].completions == got["oracle"].completions
        assert max_logprob_diff(got["cached"], got["oracle"]) <= LOGPROB_ATOL


def test_a_cpu_that_cannot_pack_bf16_generates_with_its_linears_unpacked(llama, monkeypatch):
    """oneDNN's bf16 reorder needs avx512bw/vl/dq or avx_ne_convert (an AVX2-only host raised at the first bf16
    call): there the bf16 layers stay F.linear's and the fp32 ones are packed still."""
    from plugin.generation.onednn import packed_linears
    from plugin.runtime import internals

    model, stops, base = llama
    monkeypatch.setattr(internals, "onednn_packs", lambda dtype: dtype == torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model) as packed:
        assert packed == 0
    with packed_linears(model) as packed:
        assert packed > 0
    bf16 = _sampler(model, stops, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    got = bf16.generate(prompts(), KEYS)
    assert len(got.completions) == len(KEYS) and all(len(c) >= 1 for c in got.completions)


def test_one_cache_for_every_call_and_sampler(llama):
    """The pool is allocated at the first generation and reused: a later call, and another sampler on the same pool
    (evaluation's, at another temperature), write into the same tensors."""
    model, stops, base = llama
    pool = KVPool()
    first = _sampler(model, stops, pool=pool).generate(prompts(), KEYS)
    addresses = [(k.data_ptr(), v.data_ptr()) for k, v in pool.layers + pool.prompts]
    assert pool.bytes() > 0
    again = _sampler(model, stops, pool=pool).generate(prompts()[:3], KEYS[:3])
    greedy = build_sampler(model, kv_cache=True, max_new_tokens=N, stop_ids=stops, temperature=0.0, pad_id=PAD,
                           pool=pool).generate(prompts(), KEYS)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in pool.layers + pool.prompts] == addresses
    assert first.completions == base.completions and again.completions == base.completions[:3]
    assert len(greedy.completions) == len(KEYS)


@pytest.mark.slow  # inductor compiles the decode step once per row-count bucket
def test_compiled_decode_compiles_once_per_run(llama):
    """compile_decode: the first call compiles two graphs, the decode forward and the sampling noise's hash, for any
    row count and attended length; later calls (the first has 2 rows, so the pool grows for the second), and
    another sampler over the same pool, compile nothing. The compiled hash draws the eager one's bits: the same
    noise, so the same tokens."""
    from torch._dynamo.utils import counters

    model, stops, base = llama
    pool = KVPool()
    sampler = _sampler(model, stops, pool=pool, compile_decode=True)
    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    sampler.generate(prompts()[:2], KEYS[:2])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == start + 2
    got = sampler.generate(prompts(), KEYS)
    again = sampler.generate(prompts(), KEYS)
    other = _sampler(model, stops, pool=pool, compile_decode=True).generate(prompts(), KEYS)
    assert counters["stats"]["unique_graphs"] == graphs
    assert got.completions == again.completions == other.completions == base.completions
    assert max_logprob_diff(got, base) <= LOGPROB_ATOL
