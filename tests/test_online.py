"""Online mode's pieces without a model: prompt files, reward functions, and the dataset's batches, replays and resume."""

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO, parse_config
from plugin.data.batch import BatchPlan, Collate, advantages
from plugin.config import GRPO, Online
from plugin.job import GRPOJob
from plugin.runtime.metrics import GRPOMetricsProcessor
from plugin.data.online import OnlineDataset, sample_key
from plugin.data.prompts import load_prompts
from plugin.runtime.stats import GRPOStats, OnlineStats
from plugin.data.rewards import RewardError, load_reward_fns, score, score_once
from plugin.data.rollouts import Encoder, RolloutError
from plugin.generation.sampler import Samples
from test_data import VOCAB, write


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))


def encoder(tokenizer, seq_len=16):
    return Encoder(tokenizer, VOCAB, seq_len)


# --- reward functions -----------------------------------------------------------------------------

def test_reward_fn_that_cannot_be_imported_names_the_key_and_module():
    with pytest.raises(ValueError, match=r"\[online\] reward_funcs\[1\] = 'no_such_module:f': cannot import module 'no_such_module'"):
        load_reward_fns(["reward_fns:length", "no_such_module:f"], [])
    with pytest.raises(ValueError, match=r"reward_funcs\[0\] = 'reward_fns:nope': module 'reward_fns' \(.*reward_fns.py\) has no function 'nope'"):
        load_reward_fns(["reward_fns:nope"], [])


def _score(specs, prompts, weights=(), columns=None):
    fns = load_reward_fns(specs, list(weights))
    completion_ids = [[1] * (i + 1) for i in range(len(prompts))]
    where = [f"p.jsonl:{i + 1}" for i in range(len(prompts))]
    return score(fns, prompts, ["c"] * len(prompts), completion_ids, columns or {}, where)


def test_rewards_are_weighted_and_columns_reach_the_function():
    totals, per_fn = _score(["reward_fns:length", "reward_fns:echo_columns"], ["a", "b"], weights=(2.0, -1.0),
                            columns={"target": [10, 20]})
    assert per_fn == [[1.0, 2.0], [10.0, 20.0]]
    assert totals == [2 * 1 - 10, 2 * 2 - 20]


def test_none_means_the_function_does_not_apply():
    totals, per_fn = _score(["reward_fns:none_on_seven", "reward_fns:length"], ["a", "7"], weights=(3.0, 1.0))
    assert math.isnan(per_fn[0][1]) and totals == [3.0 + 1.0, 2.0]
    with pytest.raises(RewardError, match=r"every reward function returned None for completion 1 of the prompt at p.jsonl:2"):
        _score(["reward_fns:none_on_seven"], ["a", "7"])


def test_reward_fn_that_raises_names_the_prompt_row():
    with pytest.raises(RewardError, match=r"reward_funcs\[0\] = 'reward_fns:raises_on_seven' raised on the prompt at "
                                          r"p.jsonl:3: ZeroDivisionError: seven"):
        _score(["reward_fns:raises_on_seven"], ["a", "b", "7", "d"])


def test_wrong_count_and_nan_name_the_function_and_row():
    with pytest.raises(RewardError, match=r"reward_fns:one_short' returned 2 rewards for 3 completions \(prompts at p.jsonl:1 .. p.jsonl:3\)"):
        _score(["reward_fns:one_short"], ["a", "b", "c"])
    with pytest.raises(RewardError, match=r"reward_fns:nan_on_seven' returned nan for completion 1 of the prompt at p.jsonl:2"):
        _score(["reward_fns:nan_on_seven"], ["a", "7"])


# --- prompt files -----------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_prompts_keep_their_columns_and_location(tmp_path, tokenizer, suffix):
    path = write(tmp_path / f"p{suffix}", [{"prompt": "Q: 1+2=", "answer": 3}, {"prompt_ids": [1, 5, 6], "answer": 4}])
    prompts, skipped = load_prompts(path, encoder(tokenizer), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")
    assert skipped == 0 and [p.columns for p in prompts] == [{"answer": 3}, {"answer": 4}]
    assert prompts[0].text == "Q: 1+2=" and prompts[0].ids[0] == tokenizer.bos_id
    assert prompts[1].ids == [1, 5, 6]
    assert prompts[1].where == (f"{path}:2" if suffix == ".jsonl" else f"{path}: row 1")


def test_prompt_too_long_for_the_new_tokens_names_file_and_line(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", [{"prompt_ids": [1] * 10}, {"prompt_ids": [1] * 14}])
    with pytest.raises(RolloutError, match=rf"{path}:2: the prompt is 14 tokens; with \[online\] max_new_tokens = 4 "
                                           r"a prompt may have at most \[training\] seq_len \+ 1 - max_new_tokens = 13"):
        load_prompts(path, encoder(tokenizer), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")
    prompts, skipped = load_prompts(path, encoder(tokenizer), tokenizer, fmt="auto", max_new_tokens=4, on_error="skip")
    assert (len(prompts), skipped) == (1, 1)


def test_bad_prompt_rows_name_file_line_and_field(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"question": "x"}])
    with pytest.raises(RolloutError, match=rf"{path}:2: missing field 'prompt' \(or 'prompt_ids'\)"):
        load_prompts(path, encoder(tokenizer), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")


# --- the dataset, with a stand-in sampler ---------------------------------------------------------

class CountingSampler:
    """Completion of sequence i: [key % 7 + 10] * (key % 3 + 1), then EOS; log-probs -0.5 each."""

    def __init__(self, eos):
        self.eos, self.calls = eos, 0

    def generate(self, prompts, keys, turns=None):
        self.calls += 1
        comps = [[k % 7 + 10] * (k % 3 + 1) + [self.eos] for k in keys]
        return Samples(comps, [[-0.5] * len(c) for c in comps], [False] * len(comps))


class TruncatingSampler(CountingSampler):
    """CountingSampler, but a key with key % 3 == 2 reaches max_new_tokens = 4 without EOS (truncated)."""

    def generate(self, prompts, keys, turns=None):
        self.calls += 1
        comps = [[k % 7 + 10] * 4 if k % 3 == 2 else [k % 7 + 10] * (k % 3 + 1) + [self.eos] for k in keys]
        return Samples(comps, [[-0.5] * len(c) for c in comps], [k % 3 == 2 for k in keys])


class Policy(torch.nn.Module):
    """Stands in for the policy: the log-probs it scores (the replays' old log-probs) are -0.01 * each input id."""

    def __init__(self):
        super().__init__()
        self.weight, self.calls = torch.nn.Parameter(torch.zeros(())), 0

    def logprobs(self, tokens, labels, **layout):
        self.calls += 1
        return tokens.float() * -0.01


def _online_dataset(tmp_path, tokenizer, *, mu=1, grad_accum=2, n_prompts=6, seed=0, G=2, sampler=CountingSampler,
                    grpo=None, dp=(0, 1), padding_free=False, **online):
    """The online dataset over a stand-in sampler and policy; padded rows (row m completion m) unless `padding_free`."""
    rows = [{"prompt_ids": [1, 100 + i], "target": i} for i in range(n_prompts)]
    path = write(tmp_path / "prompts.jsonl", rows)
    prompts, _ = load_prompts(path, encoder(tokenizer), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")
    cfg = Online(**{**dict(enable=True, num_generations=G, max_new_tokens=4, reward_funcs=["reward_fns:length"],
                           num_iterations=mu), **online})
    plan = BatchPlan(group_size=G, groups_per_microbatch=1, grad_accum=grad_accum, dp_rank=dp[0], dp_world_size=dp[1])
    fns = load_reward_fns(cfg.reward_funcs, [])
    ds = OnlineDataset(prompts, plan, Collate(16, 0, grpo or GRPO(padding_free=padding_free), G, sampled=True), seed, cfg, fns, tokenizer, 0,
                       [tokenizer.eos_id], 1.0, str(tmp_path), SimpleNamespace(stats=GRPOStats()),
                       OnlineStats([f.name for f in fns], cfg.filter_groups))
    ds.policy, ds.sampler = Policy(), sampler(tokenizer.eos_id)
    return ds


def test_batches_carry_the_samples_rewards_and_sampler_logprobs(tmp_path, tokenizer):
    ds = _online_dataset(tmp_path, tokenizer)
    it = iter(ds)
    inputs, labels = next(it)
    prompt_ids = ds.stream.step_groups(0)
    G = 2
    for m in range(G):
        key = sample_key(0, 0, 0, m)
        completion = [key % 7 + 10] * (key % 3 + 1) + [tokenizer.eos_id]
        seq = [1, 100 + int(prompt_ids[0])] + completion
        assert inputs["input"][m, : len(seq) - 1].tolist() == seq[:-1]
        assert labels[m, 1 : len(seq) - 1].tolist() == completion and labels[m, 0] == IGNORE_INDEX
        assert (labels[m, len(seq) - 1 :] == IGNORE_INDEX).all()
        r = inputs["rollouts"]
        assert r.rewards[m] == len(completion)
        s = r.sampler_logprobs[m]
        assert s[1 : len(seq) - 1].eq(-0.5).all() and s[0].isnan() and s[len(seq) - 1 :].isnan().all()
    assert inputs["rollouts"].old_logprobs is None and ds.policy.calls == 0  # mu = 1: on-policy, no scoring pass
    # advantages come from the whole global batch's rewards (both microbatches)
    inputs2, _ = next(it)
    rewards = torch.cat([inputs["rollouts"].rewards, inputs2["rollouts"].rewards])
    assert torch.cat([inputs["rollouts"].advantages, inputs2["rollouts"].advantages]).tolist() == \
        advantages(rewards, G, "group_std", 1e-4).tolist()
    assert ds.sampler.calls == 1  # one generate call per batch, all microbatches at once
    figures = ds.stats.take()
    assert figures["online/completion_length_mean"] == pytest.approx(rewards.mean().item())
    assert figures["online/reward/length_mean"] == pytest.approx(rewards.mean().item())


def _pull(it, n):
    out = []
    for _ in range(n):
        inputs, _ = next(it)
        r = inputs["rollouts"]
        out.append((inputs["input"].clone(), r.old_logprobs, r.sampler_logprobs is not None))
    return out


@pytest.mark.parametrize("padding_free", [False, True])
def test_replays_use_the_policys_logprobs_before_the_update_as_old(tmp_path, tokenizer, padding_free):
    ds = _online_dataset(tmp_path, tokenizer, mu=3, padding_free=padding_free)
    it = iter(ds)
    first = _pull(it, 2)  # iteration 0: on-policy, with the sampler's log-probs for the mismatch metric
    assert all(old is None and has_sampler for _, old, has_sampler in first)
    assert ds.policy.calls == 2  # each microbatch scored once, when the batch was sampled
    for _ in range(2):  # iterations 1 and 2: the same microbatches, the policy's log-probs, no sampler metric
        replay = _pull(it, 2)
        for (x0, *_), (x, old, has_sampler) in zip(first, replay):
            assert torch.equal(x, x0) and not has_sampler and torch.equal(old, x0.float() * -0.01)
    assert ds.sampler.calls == 1 and ds.policy.calls == 2
    nxt = _pull(it, 1)[0]  # a new batch: sampled and scored again
    assert ds.sampler.calls == 2 and ds.policy.calls == 4 and nxt[1] is None


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5, 6])
def test_resume_mid_replay_continues_the_same_stream(tmp_path, tokenizer, stop_after, padding_free):
    def run(ds, it, n):
        out = []
        for _ in range(n):
            inputs, _ = next(it)
            r = inputs["rollouts"]
            out.append((inputs["input"].clone(), None if r.old_logprobs is None else r.old_logprobs.clone()))
        return out

    straight_ds = _online_dataset(tmp_path, tokenizer, mu=2, padding_free=padding_free)
    straight = run(straight_ds, iter(straight_ds), 12)
    ds = _online_dataset(tmp_path, tokenizer, mu=2, padding_free=padding_free)
    head = run(ds, iter(ds), stop_after)
    state = ds.state_dict()
    resumed = _online_dataset(tmp_path, tokenizer, mu=2, padding_free=padding_free)
    resumed.load_state_dict(state)
    tail = run(resumed, iter(resumed), 12 - stop_after)
    for (x, old), (y, old2) in zip(head + tail, straight):
        assert torch.equal(x, y)
        assert (old is None) == (old2 is None) and (old is None or torch.equal(old, old2))
    # a replay resumed from the checkpoint, not re-sampled: only new batches call the sampler
    # a replay resumes from the checkpoint, not re-sampled: only batches not yet begun call the sampler
    assert resumed.sampler.calls == len([first for first in (0, 4, 8) if first >= stop_after])


def test_sample_keys_depend_on_seed_batch_group_and_member_only():
    keys = {sample_key(s, b, g, m) for s in (0, 1) for b in (0, 1) for g in (0, 1) for m in (0, 1)}
    assert len(keys) == 16 and all(0 <= k < 2**63 for k in keys)
    assert sample_key(3, 4, 5, 6) == sample_key(3, 4, 5, 6)


def test_online_stats_share_and_rates():
    stats = OnlineStats(["a"])
    stats.record(2.0, 3 << 30, [3, 5], [False, True], [[1.0, math.nan]])
    stats.record(2.0, 1 << 30, [3, 5], [False, True], [[1.0, math.nan]])
    out = stats.take()
    assert out["online/generation_peak_memory(GiB)"] == 3.0  # the largest batch's
    assert out["online/generated_tokens_per_s"] == 4.0 and out["online/completion_length_max"] == 5
    assert out["online/truncated_fraction"] == 0.5 and out["online/reward/a_mean"] == 1.0
    assert 0 < out["online/generation_share"]
    assert stats.take() == {}  # a replay-only stretch logs no generation figures


def test_the_metrics_processor_gets_the_jobs_statistics(monkeypatch):
    """The online dataset's builder and the metrics processor's share the job's OnlineStats; the loss, its GRPOStats."""
    from plugin.runtime.metrics import build_grpo_metrics_processor

    built = {}
    monkeypatch.setattr(GRPOMetricsProcessor, "__init__", lambda self, *a, **kw: built.update(kw))
    cfg = parse_config()
    job = GRPOJob.of(cfg)
    job.online_stats = OnlineStats(["a"])
    build_grpo_metrics_processor(cfg, None)
    assert built == {"job": job} and GRPOJob.of(cfg) is job


def test_ranks_leave_together_after_a_run_that_ended_well_only(monkeypatch):
    """Trainer.close meets the other ranks at a barrier after a good run; while an error propagates, a peer may be
    gone, so it does not wait for them."""
    import torch.distributed as dist

    from plugin.runtime.metrics import leave_together

    barriers = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: barriers.append("ok"))
    leave_together()
    assert barriers == ["ok"]
    try:
        raise RuntimeError("a failed step")
    except RuntimeError:
        leave_together()  # as torchtitan's main calls Trainer.close in its `except` block
    assert barriers == ["ok"]


# --- mask_truncated_completions ---------------------------------------------------------------------

def trl_aggregate(per_token_loss, completion_mask, loss_type, max_completion_length):
    """TRL GRPOTrainer._compute_loss's aggregation (trl/trainer/grpo_trainer.py), on the whole batch at once:
    with mask_truncated_completions TRL zeroes a truncated completion's row of completion_mask."""
    m = completion_mask.double()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * max_completion_length)
    raise ValueError(loss_type)


@pytest.mark.parametrize("mode, loss_type", [("token_mean", "bnpo"), ("seq_mean_token_mean", "grpo"),
                                             ("fixed_horizon", "dr_grpo")])
def test_truncated_completions_leave_the_loss_but_count_in_advantages(tmp_path, tokenizer, mode, loss_type):
    horizon = 4  # Dr. GRPO's max completion length: [online] max_new_tokens
    ds = _online_dataset(tmp_path, tokenizer, G=4, n_prompts=4, sampler=TruncatingSampler,
                         grpo=GRPO(loss_aggregation=mode, horizon=horizon, padding_free=False), mask_truncated_completions=True)
    it = iter(ds)
    batch = [next(it) for _ in range(2)]
    labels = torch.cat([lab for _, lab in batch])
    r = [inputs["rollouts"] for inputs, _ in batch]
    rewards, adv, w = (torch.cat([getattr(x, k) for x in r]) for k in ("rewards", "advantages", "loss_weights"))
    keys = [sample_key(0, 0, i, m) for i in range(2) for m in range(4)]
    truncated = torch.tensor([k % 3 == 2 for k in keys])
    assert 0 < truncated.sum() < len(keys)  # the batch holds both kinds
    # a truncated completion is sampled and rewarded (length 4), but has no loss token
    assert rewards[truncated].eq(4).all()
    assert (labels[truncated] == IGNORE_INDEX).all() and (labels[~truncated] != IGNORE_INDEX).any(dim=1).all()
    # advantages from every completion's reward, as TRL computes them before masking
    g = rewards.double().view(-1, 4)
    assert torch.allclose(adv.double(), ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten(),
                          atol=1e-6)
    # what torchtitan computes with the weights, sum(w * L * m) / sum(m), is TRL's aggregation with the masked rows
    mask = labels != IGNORE_INDEX
    L = torch.randn(labels.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = (w.double()[:, None] * L * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, trl_aggregate(L, mask, loss_type, horizon), rtol=1e-6, atol=1e-9)


class AlwaysTruncatingSampler(CountingSampler):
    def generate(self, prompts, keys, turns=None):
        self.calls += 1
        comps = [[k % 7 + 10] * 4 for k in keys]
        return Samples(comps, [[-0.5] * 4 for _ in comps], [True] * len(keys))


def test_a_batch_of_truncated_completions_makes_no_update(tmp_path, tokenizer):
    """TRL's loss is 0 when every completion is masked; torchtitan would divide by 0 tokens: the tokens stay, weighted 0."""
    ds = _online_dataset(tmp_path, tokenizer, sampler=AlwaysTruncatingSampler, mask_truncated_completions=True)
    inputs, labels = next(iter(ds))
    assert (labels != IGNORE_INDEX).sum() > 0 and (inputs["rollouts"].loss_weights == 0).all()


def test_truncated_completions_stay_in_the_loss_by_default(tmp_path, tokenizer):
    ds = _online_dataset(tmp_path, tokenizer, G=4, n_prompts=4, sampler=TruncatingSampler)
    labels = torch.cat([next(iter(ds))[1]])
    assert (labels != IGNORE_INDEX).any(dim=1).all()


# --- rewards run once: async functions together, TP ranks share the work --------------------------

def test_async_reward_fns_are_awaited_together():
    totals, per_fn = _score(["reward_fns:async_first", "reward_fns:async_second", "reward_fns:length"], ["a", "b"],
                            weights=(1.0, 0.5, 1.0))
    assert per_fn == [[1.0, 1.0], [2.0, 4.0], [1.0, 2.0]]
    assert totals == [1 + 1 + 1, 1 + 2 + 2]


def test_async_reward_fn_that_raises_names_the_prompt_row():
    with pytest.raises(RewardError, match=r"reward_funcs\[0\] = 'reward_fns:async_raises_on_seven' raised on the "
                                          r"prompt at p.jsonl:3: ZeroDivisionError: seven"):
        _score(["reward_fns:async_raises_on_seven"], ["a", "b", "7", "d"])


def _tp_rewards(rank, world_size, tmp):
    import torch.distributed as dist

    tmp = Path(tmp)
    os.environ["REWARD_CALLS"] = str(tmp / f"calls-{rank}.jsonl")
    tok = HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))
    folder = tmp / f"rank{rank}"
    folder.mkdir()
    ds = _online_dataset(folder, tok, G=3, reward_funcs=["reward_fns:logged_length"])
    ds.tp_group = dist.group.WORLD  # the two ranks are one DP rank's TP peers: they sample the same completions
    it = iter(ds)
    batch = [next(it)[0]["rollouts"] for _ in range(2)]
    torch.save([(r.rewards, r.advantages) for r in batch], tmp / f"batch-{rank}.pt")
    fns = load_reward_fns(["reward_fns:raises_on_rank_1"], [])
    with pytest.raises(RewardError) as failure:  # rank 1's failure stops rank 0 too, which would wait for it
        score_once(fns, dist.group.WORLD, ["p"] * 4, ["c"] * 4, [[1]] * 4, {}, ["p.jsonl:1"] * 4)
    assert "sandbox unreachable" in str(failure.value)


def test_tp_peers_run_each_reward_once_and_share_it(tmp_path, tokenizer):
    from conftest import run_ranks

    run_ranks(2, _tp_rewards, str(tmp_path))
    calls = [json.loads(line) for rank in (0, 1) for line in (tmp_path / f"calls-{rank}.jsonl").read_text().splitlines()]
    assert len(calls) == 2 * 3  # one batch: 2 groups of 3, each completion scored once in the job
    assert all((tmp_path / f"calls-{rank}.jsonl").read_text() for rank in (0, 1))  # and the work is shared
    one, two = (torch.load(tmp_path / f"batch-{rank}.pt") for rank in (0, 1))
    os.environ["REWARD_CALLS"] = str(tmp_path / "calls-single.jsonl")
    single = _online_dataset(tmp_path, tokenizer, G=3, reward_funcs=["reward_fns:logged_length"])
    it = iter(single)
    want = [(r.rewards, r.advantages) for r in (next(it)[0]["rollouts"] for _ in range(2))]
    for got in (one, two):
        for (rewards, adv), (want_rewards, want_adv) in zip(got, want):
            assert torch.equal(rewards, want_rewards) and torch.equal(adv, want_adv)
    assert sorted(calls) == sorted(map(json.loads, (tmp_path / "calls-single.jsonl").read_text().splitlines()))


# --- dynamic sampling (filter_groups) ---------------------------------------------------------------

FILTER = dict(reward_funcs=["reward_fns:equal_on_even_target"], filter_groups=True)


def expected_batches(n_batches, *, n_prompts=6, K=2, G=2, seed=0, cap=10):
    """Independently of the dataset: walk the prompt stream round by round, reward each group as the stand-in sampler
    and reward_fns.equal_on_even_target would, keep the first K groups whose rewards differ.
    Returns per batch (prompt ids kept, groups dropped, extra rounds)."""
    from plugin.data.batch import GroupStream

    stream, pos, out = GroupStream(n_prompts, K, seed), 0, []
    for b in range(n_batches):
        kept, dropped, rounds = [], [], 0
        while len(kept) < K and rounds < cap:
            for i, prompt in enumerate(stream.groups(pos, K)):
                lengths = [sample_key(seed, b, rounds * K + i, m) % 3 + 2 for m in range(G)]
                rewards = [1.0] * G if prompt % 2 == 0 else lengths
                (kept if len(set(rewards)) > 1 else dropped).append(int(prompt))
            pos, rounds = pos + K, rounds + 1
        out.append((kept[:K], len(dropped), rounds - 1))
    return out


def _prompts_of(inputs):
    return [int(x) - 100 for x in inputs["input"][::2, 1]]  # prompt ids [1, 100 + i], one group per microbatch


def test_filter_groups_keeps_groups_whose_rewards_differ(tmp_path, tokenizer):
    ds = _online_dataset(tmp_path, tokenizer, **FILTER)
    it = iter(ds)
    want = expected_batches(4)
    assert sum(d for _, d, _ in want) > 0 and sum(r for _, _, r in want) > 0  # the walk drops and resamples
    for b, (prompts, dropped, extra) in enumerate(want):
        batch = [next(it)[0] for _ in range(2)]
        assert [p for inputs in batch for p in _prompts_of(inputs)] == prompts, b
        for inputs in batch:
            r = inputs["rollouts"]
            assert r.rewards[0] != r.rewards[1] and (r.advantages != 0).all()
        figures = ds.stats.take()
        assert figures["online/groups_dropped"] == dropped and figures["online/extra_rounds"] == extra, b


def test_filter_groups_cap_fills_the_batch_and_says_so(tmp_path, tokenizer):
    ds = _online_dataset(tmp_path, tokenizer, reward_funcs=["reward_fns:constant"], filter_groups=True,
                         max_num_gen_batches=3)
    it = iter(ds)
    batch = [next(it)[0] for _ in range(2)]
    assert ds.stream_pos == 3 * 2 and ds.sampler.calls == 3  # three rounds of K = 2 prompts
    assert all((inputs["rollouts"].advantages == 0).all() for inputs in batch)  # filled with equal-reward groups
    figures = ds.stats.take()
    assert figures["online/extra_rounds"] == 2 and figures["online/groups_dropped"] == 6 - 2


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])
def test_filter_groups_resume_continues_the_same_stream(tmp_path, tokenizer, stop_after):
    def run(ds, n):
        it = iter(ds)
        return [next(it)[0]["input"].clone() for _ in range(n)]

    straight = run(_online_dataset(tmp_path, tokenizer, mu=2, **FILTER), 12)
    ds = _online_dataset(tmp_path, tokenizer, mu=2, **FILTER)
    head = run(ds, stop_after)
    resumed = _online_dataset(tmp_path, tokenizer, mu=2, **FILTER)
    resumed.load_state_dict(ds.state_dict())
    tail = run(resumed, 12 - stop_after)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, straight))
    assert ds.state_dict()["stream_pos"] > 2  # batch 0 alone took more than its K = 2 stream positions


def _filter_layouts(rank, world_size, tmp):
    """Batch 0 and 1 on two DP ranks, then on two TP peers: each rank's microbatches' inputs."""
    import torch.distributed as dist

    tmp = Path(tmp)
    tok = HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))
    out = {}
    for layout in ("dp2", "tp2"):
        folder = tmp / f"{layout}-{rank}"
        folder.mkdir()
        if layout == "dp2":  # one group per rank and step: K = 2 as with one rank and 2 microbatches
            ds = _online_dataset(folder, tok, grad_accum=1, dp=(rank, 2), **FILTER)
            ds.dp_group = dist.group.WORLD
        else:
            ds = _online_dataset(folder, tok, **FILTER)
            ds.tp_group = dist.group.WORLD
        it = iter(ds)
        out[layout] = [next(it)[0]["input"] for _ in range(2 if layout == "dp2" else 4)]
    torch.save(out, tmp / f"rank{rank}.pt")


def test_filter_groups_batches_do_not_depend_on_the_layout(tmp_path, tokenizer):
    from conftest import run_ranks

    run_ranks(2, _filter_layouts, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    ds = _online_dataset(tmp_path, tokenizer, **FILTER)
    it = iter(ds)
    one_rank = [next(it)[0]["input"] for _ in range(4)]  # batches 0 and 1, 2 microbatches each
    # DP: batch b's position p is rank p's microbatch of that batch
    dp = [ranks[p]["dp2"][b] for b in range(2) for p in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(dp, one_rank))
    for r in (0, 1):
        assert all(torch.equal(x, y) for x, y in zip(ranks[r]["tp2"], one_rank))


# --- TRL's ready-made rewards -------------------------------------------------------------------------

def test_trls_soft_overlong_punishment_rewards_the_batch(tmp_path, tokenizer):
    """trl.rewards.get_soft_overlong_punishment (or its copy without TRL) named in reward_funcs as it is."""
    import reward_fns

    print("TRL's own" if reward_fns.get_soft_overlong_punishment.__module__.startswith("trl") else "the copy")
    ds = _online_dataset(tmp_path, tokenizer, G=4, reward_funcs=["reward_fns:short_soft_overlong"])
    it = iter(ds)
    seen = set()
    for inputs, labels in (next(it) for _ in range(4)):
        lengths = (labels != IGNORE_INDEX).sum(1).tolist()  # the stand-in sampler's: 2, 3 or 4, EOS included
        seen.update(lengths)
        # DAPO's eq. 13 with L_max = 4, L_cache = 2: 0 up to 2 tokens, then -1/2 per token over
        assert inputs["rollouts"].rewards.tolist() == [{2: 0.0, 3: -0.5, 4: -1.0}[n] for n in lengths]
    assert seen == {2, 3, 4}
    assert "online/reward/short_soft_overlong_mean" in ds.stats.take()


def test_the_copy_of_trls_soft_overlong_punishment_is_trls():
    trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is not installed: the copy in tests/reward_fns.py "
                                                            "stands in for it")
    import reward_fns

    ids = [[1] * n for n in range(12)]
    for max_len, cache in [(6, 3), (4, 2), (10, 1)]:
        assert reward_fns.soft_overlong_copy(max_len, cache)(completion_ids=ids) == \
            trl_rewards.get_soft_overlong_punishment(max_len, cache)(completion_ids=ids)


# --- the sampler's log-probs as behaviour log-probs -----------------------------------------------------

def test_sampler_logprobs_are_every_passs_behaviour_logprobs(tmp_path, tokenizer):
    ds = _online_dataset(tmp_path, tokenizer, mu=2, behavior_logprobs="sampler")
    it = iter(ds)
    for iteration in range(2):
        for _ in range(2):
            inputs, labels = next(it)
            r = inputs["rollouts"]
            completion = labels != IGNORE_INDEX
            # the stand-in sampler's log-prob is -0.5 per token: the loss's l_old there, NaN (on-policy) elsewhere
            assert r.old_logprobs[completion].eq(-0.5).all() and r.old_logprobs[~completion].isnan().all()
            assert (r.sampler_logprobs is not None) == (iteration == 0)  # the mismatch metric, once per batch
    assert ds.policy.calls == 0  # no pre-update pass: the replays need none


def test_the_loss_truncates_the_ratio_to_the_sampler():
    """What the loss does with those rollouts: r = min(exp(l - l_sampler), behavior_ratio_cap), then clipped."""
    from plugin.model.policy import PolicyOutput
    from plugin.scoring.loss import build_grpo_loss

    cfg = parse_config("--grpo.behavior_ratio_cap", "1.5", "--grpo.beta", "0", "--grpo.clip_high", "10")
    lp = torch.tensor([[-1.0, -0.2, -3.0, -0.5]], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([[float("nan"), -1.0, -2.9, -0.5]], dtype=torch.float64)
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, 7]])
    one = torch.ones(1, dtype=torch.float64)
    pred = PolicyOutput(lp, torch.zeros_like(lp), None, sampler, one, one, one, sampler)
    loss = build_grpo_loss(cfg)(pred, labels)
    ratios = [min(math.exp(-0.2 + 1.0), 1.5), math.exp(-3.0 + 2.9), 1.0]  # A = 1: -sum of the ratios
    assert loss.item() == pytest.approx(-sum(ratios), rel=1e-12)
