import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from plugin.runtime.stats import GRPOStats

SYNCING = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def microbatch(seed: int, B: int = 3, T: int = 11):
    """The (terms, mask, pred) that grpo_loss hands to record_tokens, with random contents."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.4
    ratio = torch.exp(torch.randn(B, T, generator=g) * 0.3)
    adv = torch.randn(B, generator=g)
    terms = SimpleNamespace(
        kl=torch.rand(B, T, generator=g) * mask, ratio=ratio,
        clipped_low=(ratio < 0.8) & (adv[:, None] < 0) & mask, clipped_high=(ratio > 1.2) & (adv[:, None] > 0) & mask,
    )
    pred = SimpleNamespace(entropy=torch.rand(B, T, generator=g) * 4, rewards=torch.rand(B, generator=g), advantages=adv,
                           sampler_logprobs=None)
    return terms, mask, pred


def to_device(batch, device):
    terms, mask, pred = batch
    move = lambda ns: SimpleNamespace(**{k: v if v is None else v.to(device) for k, v in vars(ns).items()})  # noqa: E731
    return move(terms), mask.to(device), move(pred)


def reference_metrics(batches) -> dict[str, float]:
    """The grpo/* token metrics, straight from their definitions over all microbatches' tokens and completions."""
    tok = lambda f: [float(x) for terms, mask, pred in batches for x in f(terms, pred)[mask]]  # noqa: E731
    seq = lambda f: [float(x) for terms, mask, pred in batches for x in f(pred)]  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    std = lambda xs: math.sqrt(mean([(x - mean(xs)) ** 2 for x in xs]))  # noqa: E731
    low, high = tok(lambda t, p: t.clipped_low.double()), tok(lambda t, p: t.clipped_high.double())
    rewards, adv = seq(lambda p: p.rewards), seq(lambda p: p.advantages)
    return {
        "grpo/kl": mean(tok(lambda t, p: t.kl)),
        "grpo/ratio_mean": mean(tok(lambda t, p: t.ratio)),
        "grpo/clip_fraction_low": mean(low),
        "grpo/clip_fraction_high": mean(high),
        "grpo/clip_fraction": mean(low) + mean(high),
        "grpo/entropy": mean(tok(lambda t, p: p.entropy)),
        "grpo/reward_mean": mean(rewards),
        "grpo/reward_std": std(rewards),
        "grpo/advantage_mean": mean(adv),
        "grpo/advantage_std": std(adv),
        "grpo/completion_length_mean": len(low) / len(rewards),
    }


def no_host_sync(monkeypatch):
    """Make every Tensor method that copies a value to the host raise."""
    def refuse(*args, **kwargs):
        raise AssertionError("host sync in record_tokens")

    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_record_tokens_and_reduce_match_reference_without_host_sync(monkeypatch):
    batches = [microbatch(seed, B=2 + seed) for seed in range(3)]
    stats = GRPOStats()
    with monkeypatch.context() as m:
        no_host_sync(m)
        for batch in batches:
            stats.record_tokens(*batch)
    got = stats.reduce(None, torch.device("cpu"))
    want = reference_metrics(batches)
    assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert "grpo/ref_time(s)" not in got  # no reference pass recorded
    stats.reset()
    assert stats.reduce(None, torch.device("cpu"))["grpo/kl"] == 0


def test_reference_pass_on_cpu_times_and_counts():
    stats = GRPOStats()
    for _ in range(2):
        with stats.reference_pass(torch.device("cpu")):
            torch.ones(1 << 20).sum()
    assert stats.sums["ref_passes"] == 2
    got = stats.reduce(None, torch.device("cpu"))
    assert got["grpo/ref_time(s)"] > 0
    assert got["grpo/ref_peak_memory(GiB)"] > 0 and "grpo/ref_peak_growth(GiB)" in got


def _two_ranks(rank, world_size):
    stats = GRPOStats()
    mine = [microbatch(rank * 10 + i) for i in range(rank + 1)]
    for batch in mine:
        stats.record_tokens(*batch)
    stats.sums["ref_passes"], stats.sums["ref_time"] = 1, 0.5 * (rank + 1)
    stats.peaks.update(ref_peak_mem=float(rank + 1), ref_peak_growth=2.0 - rank)
    got = stats.reduce(dist.group.WORLD, torch.device("cpu"))
    want = reference_metrics([microbatch(r * 10 + i) for r in range(world_size) for i in range(r + 1)])
    assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert got["grpo/ref_time(s)"] == pytest.approx(0.75)
    assert (got["grpo/ref_peak_memory(GiB)"], got["grpo/ref_peak_growth(GiB)"]) == (2.0, 2.0)


def test_reduce_over_two_ranks_sums_and_maxes():
    run_ranks(2, _two_ranks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_record_tokens_and_reference_pass_do_not_synchronize():
    device = torch.device("cuda", torch.cuda.current_device())
    batches = [microbatch(seed) for seed in range(2)]
    on_device = [to_device(batch, device) for batch in batches]
    stats = GRPOStats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in on_device:
            with stats.reference_pass(device):
                torch.cuda._sleep(1_000_000)  # ~ms of device work the events must time
            stats.record_tokens(*batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = stats.reduce(None, device)
    want = reference_metrics(batches)
    assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert got["grpo/ref_time(s)"] > 1e-4 and stats.sums["ref_passes"] == 2
