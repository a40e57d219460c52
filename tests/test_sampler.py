"""The sampler: the KV-cached one draws the oracle's tokens, on 1 rank, TP=2 and FSDP=2, llama3 and qwen3.

Each layout's ranks build the GRPO model as torchtitan's Trainer builds it (conftest.build_model)
with the same seed, so every layout holds the same weights. Stop ids are tokens that the 1-rank
sampler draws part-way through some sequences, so some completions stop and some are truncated.
"""

import contextlib
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from conftest import build_model, run_ranks
from plugin.generation.engine import KVCacheSampler, SlotAttention, build_sampler
from plugin.generation.sampling import (_mix, _mix32, compiled_uniform, gumbel, pick, row_seeds, sample,
                                       shard_candidates)

SEQ_LEN = 48  # the RoPE table: [training] seq_len
N = 12  # max_new_tokens
TEMPERATURE = 0.8
PAD = 0
PROMPT_LENS = (1, 6, 2, 11, 4, 3, 7)  # odd and even, a 1-token prompt (nothing to prefill)
# rows that take an earlier row's prompt: groups, whose members read one prompt entry of the engine's cache (with other
# keys, so other draws); a pair in each data-parallel share below (rows 0-4 and 5-6)
SAME_PROMPT = {2: 1, 6: 5}
KEYS = [random.Random(i).getrandbits(63) for i in range(len(PROMPT_LENS))]
LOGPROB_ATOL = 1e-4  # fp32: cached vs oracle differ only in attention's summation order (seen: ~2e-6)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return [out[SAME_PROMPT.get(i, i)] for i in range(len(out))]


def shared_prefix_prompts() -> tuple[int, list[list[int]]]:
    """Prompts that begin alike (20 ids, a system prompt's part): 3 distinct ones, a group's 2 members among them, one
    whose all but last token is that prefix alone; and the prefix's length."""
    P = prompts()
    common = P[3] + P[1] + P[5]
    return len(common), [common + P[4], common + P[1], common + P[0], common + P[1]]


def shared_prefix_draws(model, stops, rows=None, **options) -> dict:
    """The engine's and the oracle's draws of `rows` (default `shared_prefix_prompts`'), and the engine's prefill
    forwards' shapes."""
    rows = rows or shared_prefix_prompts()[1]
    with prefill_shapes(model) as shapes:
        cached = _sampler(model, stops, **options).generate(rows, KEYS[:len(rows)])
    oracle = build_sampler(model, kv_cache=False, max_new_tokens=N, stop_ids=stops, temperature=TEMPERATURE,
                           pad_id=PAD).generate(rows, KEYS[:len(rows)])
    return dict(cached=cached, oracle=oracle, prefills=shapes)


def build(name: str, tp: int = 1, dp: int = 1, *overrides: str, device: str = "cpu"):
    """The model on a TP x DP layout, holding the 1-rank model's weights (a sharded init draws others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torchtitan.distributed import ParallelDims

    pd = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=tp * dp)
    args = ("--model.name", name, "--training.seq_len", str(SEQ_LEN), "--grpo.beta", "0", *overrides)
    model, *_ = build_model(*args, "--parallelism.tensor_parallel_degree", str(tp),
                            "--parallelism.data_parallel_shard_degree", str(dp), parallel_dims=pd, device=device)
    if tp * dp > 1:
        plain, *_ = build_model(*args, "--parallelism.tensor_parallel_degree", "1")
        set_model_state_dict(model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    return model


def draw(model, stop_ids, kv_cache: bool, share=slice(None), turns=None):
    sampler = build_sampler(model, kv_cache=kv_cache, max_new_tokens=N, stop_ids=stop_ids, temperature=TEMPERATURE,
                            pad_id=PAD)
    return sampler.generate(prompts()[share], KEYS[share], turns)


MARK = 1  # the first id of every appended turn here


class ToolLike:
    """Turns with appended ids made from the completion alone, as a tool's result is (so any layout appends
    the same): after each of a row's first two turns, MARK and 0 to 3 more ids; the calls are recorded."""

    def __init__(self):
        self.calls = []

    def resume(self, rows, completions, room):
        self.calls.append((list(rows), [list(c) for c in completions], list(room)))
        return [[MARK] + [7 + c[-2] % 5 if len(c) > 1 else 7] * (sum(c) % 4) if c.count(MARK) < 2 else None
                for c in completions]


def samples(model, stops, share=slice(None)) -> dict:
    """The four draws each layout is checked on: cached and oracle, in one turn and with ToolLike's turns."""
    return dict(cached=draw(model, stops, True, share), oracle=draw(model, stops, False, share),
                turns_cached=draw(model, stops, True, share, ToolLike()),
                turns_oracle=draw(model, stops, False, share, ToolLike()))


def stop_ids_for(completions: list[list[int]]) -> list[int]:
    """Two tokens drawn part-way through two sequences (and nowhere earlier in them)."""
    picks = []
    for seq, at in ((1, 4), (3, 8)):
        token = completions[seq][at]
        assert token not in completions[seq][:at]
        picks.append(token)
    return picks


@pytest.fixture(scope="module")
def one_rank():
    """1-rank results per model: stop ids, then cached and oracle samples with them."""
    out = {}
    for name in ("grpo_llama3", "grpo_qwen3"):
        model = build(name)
        stops = stop_ids_for(draw(model, [], kv_cache=True).completions)
        out[name] = dict(stops=stops, **samples(model, stops))
    return out


def _layout_samples(tp, dp, names, stops) -> tuple[dict, dict]:
    """Each model's samples on this rank, and the models (the later checks reuse the llama3 one)."""
    results, models = {}, {}
    for name in names:
        model = models[name] = build(name, tp, dp)
        # DP ranks split the prompts unevenly: 5 and 2
        share = slice(None) if dp == 1 else [slice(0, 5), slice(5, None)][dist.get_rank() // tp]
        results[name] = dict(**samples(model, stops[name], share),
                             swapped=[type(m).__name__ for m in model.modules() if isinstance(m, SlotAttention)])
    return results, models


def _layouts_worker(rank, world_size, layouts, names, stops, outs):
    """Every multi-rank check of each layout on these ranks, in one spawn (a spawn's start-up, imports and model builds
    were most of each check's time: 9 spawns became 2). What rank 0 keeps for the tests goes to each layout's `out`;
    checks that assert on every rank (the FSDP training step after generation) fail the spawn, naming the rank."""
    for layout, out in zip(layouts, outs):
        _layout_worker(rank, world_size, tuple(layout), names, stops, out)


def _layout_worker(rank, world_size, layout, names, stops, out):
    tp, dp = layout
    results, models = _layout_samples(tp, dp, names, stops)
    extra = {"dtypes": _dtypes(layout)}
    if layout == (2, 1):
        extra["compiled"] = _compiled_tp(models["grpo_llama3"], stops["grpo_llama3"])
        # lockstep off, as the online sampler's without EP: lockstep ranks prefill no shared prefix
        extra["shared_prefix"] = shared_prefix_draws(models["grpo_llama3"], stops["grpo_llama3"], lockstep=False)
        extra["sharded"] = _sharded_sampling(world_size)
    if layout == (1, 2):
        _train_after_generation(rank)
        extra["train_after_generation"] = "passed"
        extra["own_queues"] = _own_queues(models["grpo_llama3"], stops["grpo_llama3"], rank)
    if tp > 1:  # the vLLM sync's tensors on this layout, asserted on every rank (no vLLM needed)
        extra["vllm_shards"] = _vllm_shards(models["grpo_llama3"])
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save({"per_rank": gathered, **extra}, out)


def _own_queues(model, stops, rank) -> dict:
    """FSDP=2 without lockstep (the online sampler's setting without EP): each rank decodes its own share (rank 0
    prompts 0-4, rank 1 prompt 1 alone, which stops after 5 tokens) with no collective after the parameters are
    gathered, so their forwards differ in number; and the compiled decode step, under FSDP's gathered parameters."""
    share = [slice(0, 5), slice(1, 2)][rank]
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, args: forwards.append(args[0].shape[1]))
    own = _sampler(model, stops, lockstep=False, check_every=1).generate(prompts()[share], KEYS[share])
    handle.remove()
    compiled = _sampler(model, stops, compile_decode=True).generate(prompts()[share], KEYS[share])
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(forwards))
    return {"own": own, "compiled": compiled, "forwards": counts}


def _vllm_shards(model) -> dict:
    """[online] use_vllm's sync with the engine as the TP group (plugin.generation.vllm's `_whole_shaped`): each
    parameter whole-shaped, holding this rank's own TP shard where vLLM's loader of TP rank `rank % tp` cuts it,
    and gathered over FSDP only; a parameter TP does not shard, whole. Returns the bytes gathered and in all."""
    from plugin.generation.vllm import _whole_shaped

    counter, expected, total = [0, 0], 0, 0
    for name, p in model.named_parameters():
        full, mesh = p.full_tensor(), p.device_mesh
        i = mesh.mesh_dim_names.index("tp")
        place, size = p.placements[i], full.numel() * full.element_size()
        whole = _whole_shaped(p, True, counter)
        assert whole.shape == full.shape, name
        if place.is_shard():
            d, k, r = place.dim, full.shape[place.dim] // mesh.size(i), mesh.get_local_rank(i)
            assert r == dist.get_rank() % mesh.size(i), "vLLM's TP rank is the global rank modulo its TP size"
            assert torch.equal(whole.narrow(d, r * k, k), full.narrow(d, r * k, k)), name
            expected += size // mesh.size(i) if mesh.ndim > 1 else 0  # FSDP's shards of this rank's TP shard
        else:
            assert torch.equal(whole, full), name
            expected += size if any(not q.is_replicate() for q in p.placements) else 0
        total += size
    assert counter[1] == expected, (counter[1], expected)
    return dict(gathered=counter[1], total=total)


def run_layouts(tmp_path_factory, layouts, names, stops) -> list[dict]:
    """The layouts (each (tp, dp), on as many ranks) one after another in one spawned group: each one's results."""
    (world_size,) = {tp * dp for tp, dp in layouts}
    outs = [tmp_path_factory.mktemp(f"sampler_tp{tp}_dp{dp}") / "results.pt" for tp, dp in layouts]
    run_ranks(world_size, _layouts_worker, layouts, names, stops, [str(out) for out in outs])
    return [_merge(torch.load(out, weights_only=False), tp, dp, names) for (tp, dp), out in zip(layouts, outs)]


def _merge(saved, tp, dp, names):
    per_rank = saved.pop("per_rank")
    merged = {}
    for name in names:
        # TP peers hold the same samples: take one rank per DP rank, in DP order
        firsts = [per_rank[r][name] for r in range(0, tp * dp, tp)]
        merged[name] = {kind: _concat([f[kind] for f in firsts])
                        for kind in ("cached", "oracle", "turns_cached", "turns_oracle")}
        merged[name]["tp_peers_agree"] = all(per_rank[r][name]["cached"] == per_rank[r - r % tp][name]["cached"]
                                             for r in range(tp * dp))
        merged[name]["swapped"] = sum(len(r[name]["swapped"]) for r in per_rank)
    return {**merged, **saved}


def _concat(parts):
    from plugin.generation.sampler import Samples

    fields = ("completions", "logprobs", "truncated", "tool_mask")
    return Samples(*(None if parts[0].tool_mask is None and f == "tool_mask" else sum((getattr(p, f) for p in parts), [])
                     for f in fields))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, one_rank):
    """TP=2, then FSDP=2, on the same 2 spawned ranks."""
    return run_layouts(tmp_path_factory, [(2, 1), (1, 2)], ("grpo_llama3", "grpo_qwen3"),
                       {n: r["stops"] for n, r in one_rank.items()})


@pytest.fixture(scope="module")
def tp2(two_ranks):
    return two_ranks[0]


@pytest.fixture(scope="module")
def fsdp2(two_ranks):
    return two_ranks[1]


@pytest.fixture(scope="module")
def tp2_fsdp2(tmp_path_factory, one_rank):
    (results,) = run_layouts(tmp_path_factory, [(2, 2)], ("grpo_llama3",),
                             {"grpo_llama3": one_rank["grpo_llama3"]["stops"]})
    return results


def max_logprob_diff(a, b) -> float:
    """Over the tokens both drew alike."""
    return max(abs(x - y) for ca, cb, la, lb in zip(a.completions, b.completions, a.logprobs, b.logprobs)
               for x, y, s, t in zip(la, lb, ca, cb) if s == t)


def assert_cached_matches_oracle(results, stops, what):
    cached, oracle = results["cached"], results["oracle"]
    assert cached.completions == oracle.completions, what
    assert cached.truncated == oracle.truncated, what
    assert [len(lp) for lp in cached.logprobs] == [len(c) for c in cached.completions]
    diff = max_logprob_diff(cached, oracle)
    print(f"{what}: max |cached - oracle| log-prob = {diff:.2e}")
    assert diff <= LOGPROB_ATOL, what
    for c, truncated in zip(cached.completions, cached.truncated):
        # a completion ends at its first stop id, else runs to max_new_tokens
        assert truncated == (c[-1] not in stops) and (len(c) == N if truncated else not set(c[:-1]) & set(stops))
    assert any(cached.truncated) and not all(cached.truncated), f"{what}: want both stopped and truncated sequences"


@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_cached_matches_oracle_one_rank(one_rank, name):
    assert_cached_matches_oracle(one_rank[name], one_rank[name]["stops"], f"1 rank {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_cached_matches_oracle_on_cuda(name):
    """On CUDA (its SDPA kernels, the KV cache on the device) the cached sampler draws the oracle's tokens, in one turn
    and in several; and both draw what the CPU draws from the same weights and keys, since the Gumbel noise is a hash
    of (key, token index, vocab id) computed alike on every device (fp32: only a near-tie of logits could differ)."""
    cpu, cuda = build(name), build(name, device="cuda")
    assert next(cuda.parameters()).is_cuda
    stops = stop_ids_for(draw(cuda, [], kv_cache=True).completions)
    results = samples(cuda, stops)
    assert_cached_matches_oracle(results, stops, f"cuda {name}")
    assert_turns_match_oracle(results, stops, f"cuda {name}")
    on_cpu = draw(cpu, stops, True)
    assert on_cpu.completions == results["cached"].completions
    diff = max_logprob_diff(on_cpu, results["cached"])
    print(f"cuda {name}: max |cuda - cpu| log-prob = {diff:.2e}")
    assert diff <= LOGPROB_ATOL


def assert_turns_match_oracle(results, stops, what):
    """Multi-turn (ToolLike): cached and oracle draw the same trajectories; the appended ids sit right after a
    stop id, masked, without log-probs; a trajectory's first turn is the single-turn completion."""
    cached, oracle, single = results["turns_cached"], results["turns_oracle"], results["cached"]
    assert cached.completions == oracle.completions, what
    assert cached.truncated == oracle.truncated and cached.tool_mask == oracle.tool_mask, what
    resumed = 0
    for c, lp, olp, mask, truncated, one in zip(cached.completions, cached.logprobs, oracle.logprobs,
                                                cached.tool_mask, cached.truncated, single.completions):
        assert len(lp) == len(mask) == len(c) <= N
        assert [math.isnan(x) for x in lp] == [m == 0 for m in mask]
        assert max((abs(x - y) for x, y, m in zip(lp, olp, mask) if m), default=0) <= LOGPROB_ATOL, what
        runs = [j for j in range(len(c)) if mask[j] == 0 and (j == 0 or mask[j - 1])]
        assert len(runs) <= 2 and all(c[j] == MARK and c[j - 1] in stops for j in runs)
        resumed += bool(runs)
        first_turn = next((j + 1 for j, x in enumerate(c) if x in stops), len(c))
        assert c[:first_turn] == one[:first_turn]  # the first round draws what a single turn draws
        if not truncated:
            assert c[-1] in stops and c.count(MARK) - c[:len(one)].count(MARK) >= 0
    assert resumed >= 2 and any(len(c) == N for c in cached.completions), f"{what}: want resumed and budget-cut rows"


@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_turns_cached_match_oracle_one_rank(one_rank, name):
    assert_turns_match_oracle(one_rank[name], one_rank[name]["stops"], f"1 rank {name}")


@pytest.mark.parametrize("check_every", [1, 3, 8])
def test_turns_many_stops(check_every):
    """A stop set of 700 ids: rows end turns often, are resumed, park and return in every order."""
    model = build("grpo_llama3")
    stops = list(range(1000, 1700))
    runs = {}
    for kv_cache in (True, False):
        sampler = build_sampler(model, kv_cache=kv_cache, max_new_tokens=N, stop_ids=stops, temperature=TEMPERATURE,
                                pad_id=PAD, check_every=check_every)
        runs[kv_cache] = sampler.generate(prompts(), KEYS, ToolLike())
    cached, oracle = runs[True], runs[False]
    assert cached.completions == oracle.completions and cached.tool_mask == oracle.tool_mask
    assert cached.truncated == oracle.truncated
    diff = max(abs(x - y) for a, b in zip(cached.logprobs, oracle.logprobs) for x, y in zip(a, b) if x == x)
    assert diff <= LOGPROB_ATOL
    # in several decode calls ([online] max_num_seqs), `turns` still sees the rows of the whole generate
    split = ToolLike()
    sampler = build_sampler(model, kv_cache=True, max_new_tokens=N, stop_ids=stops, temperature=TEMPERATURE,
                            pad_id=PAD, check_every=check_every, max_num_seqs=3)
    assert sampler.generate(prompts(), KEYS, split).completions == cached.completions
    assert {b for rows, _, _ in split.calls for b in rows} > {0, 1, 2, 3}
    twice = sum(c.count(MARK) >= 2 for c in cached.completions)
    print(f"check_every {check_every}: {twice} rows resumed twice; masks {cached.tool_mask}")
    assert twice >= 2


def test_turns_record_and_room(one_rank):
    """The rows handed to resume ended their turn with a stop id, with the room the budget leaves."""
    model = build("grpo_llama3")
    turns = ToolLike()
    stops = one_rank["grpo_llama3"]["stops"]
    out = draw(model, stops, True, turns=turns)
    assert turns.calls
    for rows, completions, room in turns.calls:
        for b, c, r in zip(rows, completions, room):
            assert c[-1] in stops and r == N - 1 - len(c)
            assert out.completions[b][:len(c)] == c


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_cached_matches_oracle_tp2(tp2, one_rank, name):
    assert_cached_matches_oracle(tp2[name], one_rank[name]["stops"], f"TP=2 {name}")
    assert_turns_match_oracle(tp2[name], one_rank[name]["stops"], f"TP=2 {name}")
    assert tp2[name]["tp_peers_agree"]
    assert tp2[name]["swapped"] == 0  # every inner_attention restored


@pytest.mark.slow
def test_fsdp2_ranks_decode_their_own_queues_and_compile(fsdp2, one_rank):
    """FSDP=2, llama3, rank 0's share: without lockstep the ranks ran different numbers of forwards (each its own
    queue) and drew the 1-rank tokens; the compiled decode step under FSDP drew them too."""
    got, base = fsdp2["own_queues"], one_rank["grpo_llama3"]["cached"]
    assert got["forwards"][0] != got["forwards"][1], got["forwards"]
    for what in ("own", "compiled"):
        assert got[what].completions == base.completions[:5], what
        assert max_logprob_diff(got[what], _part(base, slice(0, 5))) <= LOGPROB_ATOL, what


def _part(samples, share):
    return type(samples)(samples.completions[share], samples.logprobs[share], samples.truncated[share])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_cached_matches_oracle_fsdp2(fsdp2, one_rank, name):
    """Each DP rank samples its own share (5 and 2 prompts): their step counts differ, their collectives match."""
    assert_cached_matches_oracle(fsdp2[name], one_rank[name]["stops"], f"FSDP=2 {name}")
    assert_turns_match_oracle(fsdp2[name], one_rank[name]["stops"], f"FSDP=2 {name}")
    assert fsdp2[name]["swapped"] == 0


def mismatch_fraction(a, b) -> float:
    return sum(x != y for x, y in zip(a.completions, b.completions)) / len(a.completions)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_layout_invariance(one_rank, tp2, fsdp2, name):
    """The same prompts and keys draw the same completions on 1 rank, TP=2 and FSDP=2.

    FSDP computes exactly what one rank does; TP sums partial products in another order,
    which could flip a near-tie in Gumbel-max: allowed for at most one sequence in seven.
    """
    base = one_rank[name]["cached"]
    fsdp, tp = mismatch_fraction(base, fsdp2[name]["cached"]), mismatch_fraction(base, tp2[name]["cached"])
    lp_fsdp, lp_tp = (max_logprob_diff(base, r[name]["cached"]) for r in (fsdp2, tp2))
    print(f"{name}: completions differing from 1 rank: FSDP=2 {fsdp:.3f}, TP=2 {tp:.3f}; "
          f"max log-prob diff FSDP=2 {lp_fsdp:.2e}, TP=2 {lp_tp:.2e}")
    assert fsdp == 0
    assert tp <= 1 / len(PROMPT_LENS)
    # multi-turn trajectories, appended turns included
    turns = one_rank[name]["turns_cached"]
    assert mismatch_fraction(turns, fsdp2[name]["turns_cached"]) == 0
    assert mismatch_fraction(turns, tp2[name]["turns_cached"]) <= 1 / len(PROMPT_LENS)


@pytest.mark.slow
def test_tp2_fsdp2(tp2_fsdp2, one_rank):
    """4 ranks, TP=2 x FSDP=2 (llama3): cached matches the oracle and the 1-rank samples."""
    stops = {"grpo_llama3": one_rank["grpo_llama3"]["stops"]}
    results = tp2_fsdp2["grpo_llama3"]
    assert_cached_matches_oracle(results, stops["grpo_llama3"], "TP=2 x FSDP=2 grpo_llama3")
    assert_turns_match_oracle(results, stops["grpo_llama3"], "TP=2 x FSDP=2 grpo_llama3")
    assert mismatch_fraction(one_rank["grpo_llama3"]["turns_cached"], results["turns_cached"]) <= 1 / len(PROMPT_LENS)
    assert results["tp_peers_agree"] and results["swapped"] == 0
    assert mismatch_fraction(one_rank["grpo_llama3"]["cached"], results["cached"]) <= 1 / len(PROMPT_LENS)
    # the vLLM sync gathers FSDP's shards of each rank's own TP shards only: half the TP-sharded weights and the
    # norms (TP leaves them whole), not the model
    shards = tp2_fsdp2["vllm_shards"]
    assert 0 < shards["gathered"] < shards["total"] / 2 + 1e5, shards


@pytest.mark.slow
def test_the_vllm_sync_on_tp2_hands_over_each_ranks_own_shards_ungathered(tp2):
    """(plugin.generation.vllm, checked in this layout's spawn): every rank asserted its tensors hold its own TP
    shard where vLLM cuts it; with TP alone nothing is gathered."""
    assert tp2["vllm_shards"]["gathered"] == 0 and tp2["vllm_shards"]["total"] > 0


# --- the noise --------------------------------------------------------------------------------------

def splitmix64_finalizer(x: int) -> int:
    """The reference: splitmix64's finalizer on Python ints mod 2**64."""
    mask = (1 << 64) - 1
    x &= mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_mix_is_splitmix64():
    rng = random.Random(0)
    values = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1] + [rng.getrandbits(64) for _ in range(1000)]
    signed = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)
    got = [v & ((1 << 64) - 1) for v in _mix(signed).tolist()]
    assert got == [splitmix64_finalizer(v) for v in values]


def fmix32(x: int) -> int:
    """The reference: murmur3's fmix32 on Python ints mod 2**32."""
    mask = (1 << 32) - 1
    x &= mask
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & mask
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & mask
    return x ^ (x >> 16)


def test_mix32_is_fmix32():
    """int32 products wrap as uint32's do (the noise's hash relies on it, on every device)."""
    rng = random.Random(1)
    values = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1] + [rng.getrandbits(32) for _ in range(1000)]
    signed = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)
    assert [v & ((1 << 32) - 1) for v in _mix32(signed).tolist()] == [fmix32(v) for v in values]


def test_noise_is_a_function_of_key_token_index_and_vocab_id():
    keys = torch.tensor([5, 6, -3, 2**62], dtype=torch.int64)

    def noise(keys, t, start, count):
        return gumbel(row_seeds(keys, t), start, count)

    g = noise(keys, 3, 0, 1271)
    assert g.shape == (4, 1271) and g.dtype == torch.float32 and torch.isfinite(g).all()
    assert torch.equal(g, noise(keys, 3, 0, 1271))
    assert torch.equal(g[2:3], noise(keys[2:3], 3, 0, 1271))  # the rest of the batch plays no part
    assert torch.equal(g[:, :100], noise(keys, 3, 0, 100))  # nor the vocab size
    assert torch.equal(g[:, 700:], noise(keys, 3, 700, 571))  # a vocab shard draws the full vocabulary's noise
    for other in (noise(keys, 4, 0, 1271), noise(keys + 1, 3, 0, 1271)):
        assert (g != other).float().mean() > 0.999  # another token index or key: other draws (float32 may tie)


@pytest.mark.slow  # inductor compiles the hash
def test_compiled_noise_is_the_eager_noise_bit_for_bit():
    """compile_decode's hash (compiled_uniform) against the eager one: rows of 1, 3 and 17 keys (1 specializes, the
    others share a graph), shard offsets, a column count that is no multiple of a vector's width."""
    compiled = compiled_uniform()
    for rows, t, start, count in [(3, 0, 0, 1271), (17, 5, 700, 49_152), (1, 2, 123, 77), (17, 9, 151_000, 936)]:
        seeds = row_seeds(torch.arange(rows, dtype=torch.int64) * 7919 - 5, t)
        assert torch.equal(gumbel(seeds, start, count, compiled), gumbel(seeds, start, count))


def test_noise_is_gumbel():
    """Mean (Euler's gamma) and variance (pi^2 / 6) of 2M draws, and the far tail the winners come from."""
    g = gumbel(row_seeds(torch.arange(64), 0), 0, 1 << 15).double()
    assert abs(g.mean().item() - 0.5772156649) < 5e-3
    assert abs(g.var().item() - math.pi**2 / 6) < 1e-2
    # P(g > x) = 1 - exp(-exp(-x)): at x = 8, 3.35e-4 of 2M draws, about 703
    assert abs((g > 8).double().mean().item() / -math.expm1(-math.exp(-8)) - 1) < 0.15


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_the_softmax(temperature):
    """20,000 keys on fixed logits: a chi-square test against softmax(logits / temperature)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20_000
    keys = torch.tensor(random.Random(7).sample(range(1 << 62), n), dtype=torch.int64)
    tokens, logprobs = sample(logits.expand(n, -1), keys, 0, temperature)
    probs = torch.softmax(logits / temperature, -1)
    torch.testing.assert_close(logprobs, probs.log()[tokens], rtol=0, atol=1e-6)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum().item()
    assert chi2 < 30  # 6 degrees of freedom: P(chi2 > 30) ~ 4e-5
    # the token index draws afresh: step 1 agrees with step 0 about as often as chance says
    again, _ = sample(logits.expand(n, -1), keys, 1, temperature)
    assert abs((again == tokens).double().mean().item() - (probs**2).sum().item()) < 0.02


# --- errors and cleanliness, 1 rank ------------------------------------------------------------------

def test_prompt_too_long_for_rope_table_names_it():
    model = build("grpo_llama3")
    sampler = KVCacheSampler(model, max_new_tokens=N, stop_ids=[], temperature=1.0, pad_id=PAD)
    fits = [1] * (SEQ_LEN + 1 - N)  # its last new token is drawn from position SEQ_LEN - 1
    assert len(sampler.generate([fits], [0]).completions[0]) == N
    with pytest.raises(ValueError, match=r"prompt 2 has 38 tokens: it needs 1 to 37 .* max_seq_len"):
        sampler.generate([[1, 2], fits, fits + [1]], [0, 1, 2])
    with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
        sampler.generate([[]], [0])
    with pytest.raises(ValueError, match="2 prompts but 1 keys"):
        sampler.generate([[1], [2]], [0])


def test_modules_restored_after_a_failed_step():
    model = build("grpo_llama3")
    inner = [type(b.attention.inner_attention) for b in model.layers.values()]
    modules = [(name, type(m)) for name, m in model.named_modules()]  # the packed linears (CPU) go back too
    calls = 0

    def fail_at_third_step(module, args, kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")

    handle = model.register_forward_pre_hook(fail_at_third_step, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        draw(model, [], kv_cache=True)
    handle.remove()
    assert [type(b.attention.inner_attention) for b in model.layers.values()] == inner
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    assert torch.is_grad_enabled()


def test_compiled_blocks_generate_eagerly(one_rank):
    """fullgraph-compiled blocks: no tracing during generation, the same samples as the uncompiled model."""
    from torch._dynamo.utils import counters

    model = build("grpo_llama3", 1, 1, "--compile.enable", "--compile.components", "model", "--compile.backend",
                  "eager")
    assert type(model.layers["0"]).__name__ == "OptimizedModule"
    torch._dynamo.reset()
    frames = counters["stats"]["unique_graphs"]
    got = draw(model, one_rank["grpo_llama3"]["stops"], kv_cache=True)
    assert counters["stats"]["unique_graphs"] == frames
    assert got.completions == one_rank["grpo_llama3"]["cached"].completions


# --- FSDP: the training step after generation ----------------------------------------------------------

def _train_after_generation(rank):
    # "always": the head's group (on two modules) reshards after forward too, a setting to restore
    model = build("grpo_llama3", 1, 2, "--parallelism.fsdp_reshard_after_forward", "always")
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 2048, (2, 16), generator=g)

    def grads():
        model.zero_grad()
        model(tokens).float().logsumexp(-1).mean().backward()
        return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    def policies():
        return [[g.post_forward_mesh_info for g in m._get_fsdp_state()._fsdp_param_groups]
                for m in model.modules() if isinstance(m, FSDPModule)]

    before, policy = grads(), policies()
    assert all(info is not None for infos in policy for info in infos)
    draw(model, [], kv_cache=True, share=slice(rank * 3, rank * 3 + 3))
    draw(model, [], kv_cache=False, share=slice(0, 2 if rank == 0 else 0))  # rank 1 has no prompts at all
    assert policies() == policy
    assert len(model._get_fsdp_state()._comm_ctx.post_forward_order) == 0
    # every parameter is back to its shard
    assert all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())
    after = grads()
    assert all(torch.equal(before[n], after[n]) for n in before)
    # a prompt on rank 1 too long for the table: both ranks raise instead of waiting on each other
    bad = [[1] * (SEQ_LEN if rank == 1 else 2)]
    with pytest.raises(ValueError, match="prompt 0 has 48" if rank == 1 else "another rank"):
        KVCacheSampler(model, max_new_tokens=N, stop_ids=[], temperature=1.0, pad_id=PAD).generate(bad, [0])


@pytest.mark.slow
def test_fsdp_training_step_unchanged_by_generation(fsdp2):
    """After generating (cached, then uncached with one rank empty), FSDP's state is as before: same gradients.
    The checks assert on each rank in fsdp2's spawn (_layout_worker)."""
    assert fsdp2["train_after_generation"] == "passed"


# --- the engine: sharded sampling, finished rows out, shared prefill, the cap, compiled decode ----------

def _sharded_sampling(world_size):
    """Logits split over a 2-rank vocab mesh (1271 ids: shards of 636 and 635), sampled where they lie; a gather
    of the logits fails the check."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from plugin.generation import sampling

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 1271, generator=g) * 3
    keys = torch.tensor([random.Random(i).getrandbits(63) for i in range(9)], dtype=torch.int64)
    sharded = distribute_tensor(logits, mesh, [Shard(-1)])

    def no_gather(*args, **kwargs):
        raise AssertionError("the sampler gathered the vocabulary")

    # a gather of the logits would go through one of these; restored after, for the spawn's other checks
    saved = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor")}
    full_tensor = DTensor.full_tensor
    try:
        for name in saved:
            setattr(dist, name, no_gather)
        DTensor.full_tensor = no_gather
        local, shard = sampling.local_vocab(sharded)
        assert (shard.start, local.shape[1]) == ((0, 636), (636, 635))[dist.get_rank()]
        return [sampling.sample_sharded(local, shard, sampling.row_seeds(keys, t), 0.7) for t in range(5)]
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        DTensor.full_tensor = full_tensor


@pytest.mark.slow
def test_sharded_sampling_draws_the_full_vocabularys_tokens(tp2):
    """Each rank scores only its vocab shard; one all-reduce of per-row candidates, no gather: 1 rank's tokens,
    and log-probs within fp32 rounding of a log-softmax (rank 0's draws, in tp2's spawn)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 1271, generator=g) * 3
    keys = torch.tensor([random.Random(i).getrandbits(63) for i in range(9)], dtype=torch.int64)
    for t, (tokens, logprobs) in enumerate(tp2["sharded"]):
        want, _ = sample(logits, keys, t, 0.7)
        assert torch.equal(tokens, want)
        exact = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=2e-6)


def test_sampled_logprobs_are_a_log_softmax():
    """Over blocks of the vocabulary (B=3 reads V=151,936 in several), within fp32 rounding of a log-softmax."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 151_936, generator=g) * 4
    tokens, logprobs = sample(logits, torch.tensor([1, 2, 3]), 0, 1.0)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=1e-5)
    assert torch.equal(tokens, (logits.double() + gumbel(row_seeds(torch.tensor([1, 2, 3]), 0), 0, 151_936)
                                .double()).argmax(-1))


def test_temperature_zero_is_the_argmax_and_its_log_softmax():
    """Greedy (temperature 0, evaluation's default) over several blocks and vocab shards: the largest logit, the lower
    id of equal ones across blocks and shards, whatever the key; its log-prob is the log-softmax at temperature 1."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 151_936, generator=g) * 4
    logits[0, [7, 100_000]] = 50.0  # a tie across blocks (B=4 reads blocks of 65,536) and across the shards below
    logits[1, 140_000] = 50.0
    want = logits.argmax(-1)
    assert want[0] == 7
    exact = torch.log_softmax(logits.double(), -1).gather(-1, want[:, None]).squeeze(-1)
    for keys in (torch.tensor([1, 2, 3, 4]), torch.tensor([9, 9, 9, 9])):
        for t in (0, 5):
            tokens, logprobs = sample(logits, keys, t, 0.0)
            assert torch.equal(tokens, want)
            torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=1e-5)
    # what sample_sharded picks from two shards' candidates after its all-reduce
    seeds, half = row_seeds(torch.tensor([1, 2, 3, 4]), 0), 75_968
    candidates = torch.stack([shard_candidates(logits[:, :half], seeds, 0, 0.0),
                              shard_candidates(logits[:, half:], seeds, half, 0.0)])
    tokens, logprobs = pick(candidates)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=1e-5)


def _sampler(model, stops, **options):
    return build_sampler(model, kv_cache=True, max_new_tokens=N, stop_ids=stops, temperature=TEMPERATURE, pad_id=PAD,
                         **options)


@pytest.fixture(scope="module")
def llama(one_rank):
    return build("grpo_llama3"), one_rank["grpo_llama3"]


def test_finished_rows_leave_without_changing_completions(llama):
    """Rows dropped at every step's check, or never (one check after the last step): the same samples."""
    model, base = llama
    for every in (1, 3, N + 1):
        got = _sampler(model, base["stops"], check_every=every).generate(prompts(), KEYS)
        assert got.completions == base["cached"].completions, every
        assert got.truncated == base["cached"].truncated
        assert max_logprob_diff(got, base["cached"]) <= LOGPROB_ATOL


def test_rows_leave_the_batch(llama):
    """With a check every step, a decode step's batch shrinks as sequences stop."""
    model, base = llama
    rows = []
    handle = model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    _sampler(model, base["stops"], check_every=1).generate(prompts(), KEYS)
    handle.remove()
    stopped = sum(not t for t in base["cached"].truncated)
    assert rows[0] == len(PROMPT_LENS) and rows[-1] == len(PROMPT_LENS) - stopped
    assert rows == sorted(rows, reverse=True)


def test_a_groups_members_share_one_prefill(llama):
    """G copies of each prompt: each distinct prompt is prefilled once, and each member draws what it draws alone."""
    model, base = llama
    group = [prompts()[i] for i in (0, 1, 3) for _ in range(3)]
    keys = [KEYS[i] + m for i in range(3) for m in range(3)]
    with prefill_shapes(model) as prefills:
        together = _sampler(model, base["stops"]).generate(group, keys)
    assert [rows for rows, _ in prefills] == [3]  # one prefill, of the distinct prompts
    for p, k, c, lp in zip(group, keys, together.completions, together.logprobs):
        alone = _sampler(model, base["stops"]).generate([p], [k])
        assert alone.completions[0] == c
        assert max(abs(x - y) for x, y in zip(alone.logprobs[0], lp)) <= LOGPROB_ATOL


@contextlib.contextmanager
def prefill_shapes(model):
    """The shapes of the token batches `model.hidden_states` (the engine's prefill) takes inside the block."""
    seen, method = [], model.hidden_states

    def hidden_states(tokens, *args, **kwargs):
        seen.append(tuple(tokens.shape))
        return method(tokens, *args, **kwargs)

    model.hidden_states = hidden_states  # an instance attribute over the method
    try:
        yield seen
    finally:
        del model.hidden_states


def test_the_cap_splits_calls_with_the_same_samples(llama):
    model, base = llama
    rows = []
    handle = model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    got = _sampler(model, base["stops"], max_num_seqs=3).generate(prompts(), KEYS)
    handle.remove()
    assert max(rows) == 3
    assert got.completions == base["cached"].completions and got.truncated == base["cached"].truncated
    assert max_logprob_diff(got, base["cached"]) <= LOGPROB_ATOL


@pytest.mark.slow  # inductor compiles the decode step for each row count: a minute or two on 2 cores
def test_compiled_decode_equals_eager(llama):
    """torch.compile's inductor on the CPU: the decode step's tokens and log-probs as eager's."""
    model, base = llama
    got = _sampler(model, base["stops"], compile_decode=True).generate(prompts(), KEYS)
    assert got.completions == base["cached"].completions and got.truncated == base["cached"].truncated
    assert max_logprob_diff(got, base["cached"]) <= LOGPROB_ATOL


def test_generation_runs_in_the_trainers_autocast_dtype(llama):
    """With the training forward's autocast (bf16 on one device) the layers, the KV cache and the logits are bf16;
    the cached sampler still follows the oracle under it."""
    model, base = llama
    seen = []
    handles = [model.register_forward_hook(lambda m, a, out: seen.append(("logits", out.dtype))),
               model.layers["0"].attention.register_forward_pre_hook(
                   lambda m, a: seen.append(("cache", _cache_dtype(m))))]
    bf16 = dict(autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    try:
        cached = _sampler(model, base["stops"], **bf16).generate(prompts(), KEYS)
    finally:
        for h in handles:
            h.remove()
    assert {d for what, d in seen if what == "logits"} == {torch.bfloat16}
    assert {d for what, d in seen if what == "cache" and d is not False} == {torch.bfloat16}
    oracle = build_sampler(model, kv_cache=False, max_new_tokens=N, stop_ids=base["stops"], temperature=TEMPERATURE,
                           pad_id=PAD, **bf16).generate(prompts(), KEYS)
    # bf16 rounds cached and full forwards differently: a near-tie may flip, the log-probs differ by bf16's rounding
    assert mismatch_fraction(cached, oracle) <= 2 / len(PROMPT_LENS)
    assert max_logprob_diff(cached, oracle) <= 0.05


def _cache_dtype(attention) -> torch.dtype | bool:
    """The dtype of an attention's KV cache while the engine generates (False: none allocated, or not generating)."""
    inner = attention.inner_attention
    if not isinstance(inner, SlotAttention) or inner.pool.layers[inner.layer] is None:
        return False
    return inner.pool.layers[inner.layer][0].dtype


def _dtypes(layout):
    """The dtype of the last layer's output and of the KV cache while the [online] sampler generates, and of the last
    layer's output in a training forward, under [training] mixed_precision_param = "bfloat16"."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import maybe_enable_amp

    from conftest import parse_config
    from plugin.data.online import online_sampler

    tp, dp = layout
    pd = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=tp * dp)
    flags = ("--training.mixed_precision_param", "bfloat16", "--training.seq_len", str(SEQ_LEN), "--grpo.beta", "0",
             "--parallelism.tensor_parallel_degree", str(tp), "--parallelism.data_parallel_shard_degree", str(dp))
    model, *_ = build_model(*flags, parallel_dims=pd)
    seen = []
    last = model.layers[str(len(model.layers) - 1)]
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    last.register_forward_hook(lambda m, a, o: seen.append(("layer", local(o).dtype)))
    last.attention.register_forward_pre_hook(
        lambda m, a: seen.append(("cache", _cache_dtype(m))))
    cfg = parse_config(*flags)
    sampler = online_sampler(model, cfg, pd, stop_ids=[], temperature=TEMPERATURE, pad_id=PAD)
    sampler.generate(prompts()[:3], KEYS[:3])
    generation, seen[:] = list(seen), []
    with maybe_enable_amp(pd, "bfloat16", "cpu"):
        model(torch.tensor(prompts()[1:2]))  # torchtitan's forward: the trunk as training runs it (6 tokens: TP splits them)
    return {"generation": generation, "training": list(seen)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_fsdp2"])
def test_generation_computes_in_the_trainers_dtype_on_every_layout(request, layout):
    """bf16 mixed precision: FSDP's bf16 parameters (FSDP=2, TP=2 x FSDP=2) or, where torchtitan turns mixed precision
    off (TP alone), fp32; the online sampler's layers and KV cache compute in what the training forward does."""
    seen = request.getfixturevalue(layout)["dtypes"]  # rank 0's, in the layout's spawn
    training = {d for what, d in seen["training"] if what == "layer"}
    assert training == ({torch.float32} if layout == "tp2" else {torch.bfloat16})
    assert {d for what, d in seen["generation"] if what == "layer"} == training
    assert {d for what, d in seen["generation"] if what == "cache" and d is not False} == training


def _compiled_tp(model, stops):
    eager = _sampler(model, stops).generate(prompts(), KEYS)
    compiled = _sampler(model, stops, compile_decode=True).generate(prompts(), KEYS)
    return {"eager": eager, "compiled": compiled}


def test_a_shared_prefix_is_prefilled_once_under_tp2(tp2):
    """TP=2 (head-sharded DTensors in the prefill's attention): the prompts' shared 20 ids are one forward's row, then
    their own ids (padded to the TP degree) attend it; the draws are the oracle's (rank 0's, in tp2's spawn)."""
    got = tp2["shared_prefix"]
    assert got["prefills"] == [(1, 20), (3, 6)]
    assert got["cached"].completions == got["oracle"].completions
    assert max_logprob_diff(got["cached"], got["oracle"]) <= LOGPROB_ATOL


@pytest.mark.slow  # each rank compiles the decode step for each row count
def test_compiled_decode_equals_eager_tp2(tp2):
    """TP=2: the compiled decode step (DTensor layers, the vocab-sharded head and sampling) draws eager's tokens
    (rank 0's, in tp2's spawn)."""
    got = tp2["compiled"]
    assert got["compiled"].completions == got["eager"].completions
    assert got["compiled"].truncated == got["eager"].truncated
    assert max_logprob_diff(got["compiled"], got["eager"]) <= LOGPROB_ATOL
