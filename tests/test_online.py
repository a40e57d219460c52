"""Online mode's pieces without a model: prompt files, reward functions, and the dataset's batches, replays and resume."""

import math
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
from plugin.data.online import OnlineDataset, load_prompts, sample_key
from plugin.runtime.stats import GRPOStats, OnlineStats
from plugin.data.rewards import RewardError, load_reward_fns, score
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

    def generate(self, prompts, keys):
        self.calls += 1
        comps = [[k % 7 + 10] * (k % 3 + 1) + [self.eos] for k in keys]
        return Samples(comps, [[-0.5] * len(c) for c in comps], [False] * len(comps))


class Policy(torch.nn.Module):
    """Stands in for the policy: the log-probs it scores (the replays' old log-probs) are -0.01 * each input id."""

    def __init__(self):
        super().__init__()
        self.weight, self.calls = torch.nn.Parameter(torch.zeros(())), 0

    def logprobs(self, tokens, labels):
        self.calls += 1
        return tokens.float() * -0.01


def _online_dataset(tmp_path, tokenizer, *, mu=1, grad_accum=2, n_prompts=6, seed=0):
    rows = [{"prompt_ids": [1, 100 + i], "target": i} for i in range(n_prompts)]
    path = write(tmp_path / "prompts.jsonl", rows)
    prompts, _ = load_prompts(path, encoder(tokenizer), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")
    cfg = Online(enable=True, num_generations=2, max_new_tokens=4, reward_funcs=["reward_fns:length"], num_iterations=mu)
    plan = BatchPlan(group_size=2, groups_per_microbatch=1, grad_accum=grad_accum, dp_rank=0, dp_world_size=1)
    fns = load_reward_fns(cfg.reward_funcs, [])
    ds = OnlineDataset(prompts, plan, Collate(16, 0, GRPO(), 2, sampled=True), seed, cfg, fns, tokenizer, 0,
                       [tokenizer.eos_id], 1.0, str(tmp_path), SimpleNamespace(stats=GRPOStats()), OnlineStats(["length"]))
    ds.policy, ds.sampler = Policy(), CountingSampler(tokenizer.eos_id)
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


def test_replays_use_the_policys_logprobs_before_the_update_as_old(tmp_path, tokenizer):
    ds = _online_dataset(tmp_path, tokenizer, mu=3)
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


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5, 6])
def test_resume_mid_replay_continues_the_same_stream(tmp_path, tokenizer, stop_after):
    def run(ds, it, n):
        out = []
        for _ in range(n):
            inputs, _ = next(it)
            r = inputs["rollouts"]
            out.append((inputs["input"].clone(), None if r.old_logprobs is None else r.old_logprobs.clone()))
        return out

    straight_ds = _online_dataset(tmp_path, tokenizer, mu=2)
    straight = run(straight_ds, iter(straight_ds), 12)
    ds = _online_dataset(tmp_path, tokenizer, mu=2)
    head = run(ds, iter(ds), stop_after)
    state = ds.state_dict()
    resumed = _online_dataset(tmp_path, tokenizer, mu=2)
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
    assert built == {"stats": job.stats, "online": job.online_stats} and GRPOJob.of(cfg) is job
