"""End to end: torchrun + torchtitan's own train.py on CPU, with the bundled config and data.

All runs start from one seed checkpoint (torchtitan's --checkpoint.create_seed_checkpoint), so
1 rank, TP=2 and FSDP=2 train the same weights on the same global batch. The `runs` share one
launch (conftest's train_runs: the 1-rank runs on rank 0 of the 2-rank launch); the compiled runs have
launches of their own, since what they check is about a launch. The bad inputs that stop any layout are
failing 1-rank jobs and pipeline parallelism, which needs 2 ranks to reach the plugin's check, a failing
2-rank job, all in the same launch.
"""

from pathlib import Path

import pytest
import torch

from conftest import CONFIG, read_checkpoint, run, scalars, train, train_runs
from plugin.model.reference import reference_entries

STEPS = 3
# fp32 everywhere; TP and FSDP only reorder reductions (seen: 1e-5 relative on grad_norm)
RTOL = 1e-4

# in launch order: tp2 runs first in the launch, so its memory figures are a fresh process's; fsdp2's
# (the process's RSS) include what the job before took, which the only check on them (> 0) does not mind;
# the 1-rank runs come after the 2-rank ones
RUNS = {
    "single": (1, ["--parallelism.tensor_parallel_degree", "1"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    # half the local batch on each of 2 ranks: the same 16-completion global batch
    "fsdp2": (2, ["--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "2",
                  "--training.local_batch_size", "8"]),
    # the runs above are padding-free (the default); this one pads every sequence to seq_len
    "padded": (1, ["--parallelism.tensor_parallel_degree", "1", "--grpo.no_padding_free"]),
}


# on 1 rank, torchtitan's check that the degrees multiply to the world size comes before the plugin's
PIPELINE = ["--job.config_file", CONFIG, "--training.steps", "1", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.tensor_parallel_degree", "1"]


BAD_INPUTS = [
    (["--grpo.kl_estimator", "k4"], "invalid choice 'k4' for argument '--grpo.kl-estimator'"),
    (["--training.dataset_path", "data/missing.jsonl"], "[training] dataset_path = 'data/missing.jsonl': no such rollout file"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoint) -> dict[str, Path]:
    """One launch: tp2 and fsdp2, pipeline parallelism, which must fail, then on rank 0 alone single and padded and
    the bad inputs, which must fail."""
    bad = {f"bad_input{i}": (1, ["--job.config_file", CONFIG, "--training.steps", "1",
                                 "--parallelism.tensor_parallel_degree", "1", *overrides])
           for i, (overrides, _) in enumerate(BAD_INPUTS)}
    return train_runs(tmp_path_factory, {name: run(seed_checkpoint, n, *extra, steps=STEPS)
                                         for name, (n, extra) in RUNS.items()},
                      failing={"pipeline": (2, PIPELINE), **bad})


@pytest.mark.parametrize("name", ["tp2", "fsdp2"])
def test_tensorboard_has_grpo_and_memory_tags(runs, name):
    tb = scalars(runs[name])
    for tag in ("grpo/kl", "grpo/clip_fraction", "grpo/reward_mean", "grpo/advantage_std", "grpo/entropy",
                "grpo/ref_peak_memory(GiB)", "grpo/ref_time(s)", "memory/max_active(GiB)",
                "memory/max_reserved(GiB)", "loss_metrics/global_avg_loss", "grad_norm"):
        assert len(tb[tag]) == STEPS, tag
    assert all(v > 0 for v in tb["memory/max_active(GiB)"] + tb["grpo/ref_peak_memory(GiB)"])
    assert tb["grpo/kl"][0] == 0  # the reference starts as the policy
    assert tb["grpo/kl"][-1] > 0  # and stays put while the policy moves
    assert tb["grpo/ratio_mean"] == pytest.approx([1.0] * STEPS)  # on-policy


def test_same_losses_across_parallelisms(runs):
    tb = {name: scalars(runs[name]) for name in RUNS}
    single = tb["single"]
    assert all(len(t["loss_metrics/global_avg_loss"]) == STEPS for t in tb.values())
    for name in ("tp2", "fsdp2", "padded"):
        # step 1's loss is -mean(A) on-policy; grad_norm and later losses depend on the weights
        assert tb[name]["loss_metrics/global_avg_loss"] == pytest.approx(single["loss_metrics/global_avg_loss"], rel=RTOL)
        assert tb[name]["grad_norm"] == pytest.approx(single["grad_norm"], rel=RTOL)
        assert tb[name]["grpo/kl"][1:] == pytest.approx(single["grpo/kl"][1:], rel=1e-3)


def test_real_token_metrics_count_what_the_passes_compute(runs):
    """grpo/real_token_fraction: the bundled rows fill 8-15 of seq_len 16 positions, all of a padding-free row
    (TP=2 rounds it up by at most one token); grpo/real_tps is torchtitan's tps times that fraction."""
    padded, free, tp2 = (scalars(runs[name]) for name in ("padded", "single", "tp2"))
    assert all(0.5 < f < 0.95 for f in padded["grpo/real_token_fraction"])
    assert free["grpo/real_token_fraction"] == pytest.approx([1.0] * STEPS)
    assert all(f > 0.99 for f in tp2["grpo/real_token_fraction"])
    for tb in (padded, free):
        want = [t * f for t, f in zip(tb["throughput(tps)"], tb["grpo/real_token_fraction"])]
        assert tb["grpo/real_tps"] == pytest.approx(want, rel=0.05)  # the two read the clock a moment apart


@pytest.mark.parametrize("name", ["tp2", "fsdp2"])
def test_reference_frozen_policy_trained(runs, seed_checkpoint, name):
    start = read_checkpoint(seed_checkpoint)
    end = read_checkpoint(runs[name] / "checkpoint" / f"step-{STEPS}")
    reference = reference_entries(end["optimizer"])
    assert set(reference) == set(start)
    for key, initial in start.items():
        assert torch.equal(reference[key], initial), key
        assert not torch.equal(end[key], initial), key


def test_compiled_tp_shares_a_cache_and_matches_eager(runs, seed_checkpoint, tmp_path_factory):
    """TP=2 with compiled blocks, policy loss and reference log-probs, twice on one inductor cache; and the unfused
    pass compiled, which scores its vocab-sharded logits eagerly.

    The ranks share the cache folder under per-rank cache key tags (plugin.model.parallelize.tag_compile_caches).
    These runs' graphs (the fused pass, the reference's blocks) bake in no rank's vocab range: with the tags
    removed they matched eager too (2026-12-05); tests/test_logprobs.py shows the graph that does, compiled
    log-probs of DTensor logits, which the policy now scores eagerly. The cold and the warm run are launches of
    their own (the unfused run follows the cold one in its launch): the warm one must start with nothing compiled
    but what the cold launch left on disk.
    """
    cache = tmp_path_factory.mktemp("inductor_cache")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    flags = ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.components", "model,loss",
             "--reference_model.compile"]
    # in the cold launch, after it: the unfused pass with 24-token chunks, whose vocab-sharded log-probs failed to
    # compile at step 2 (RecursionError) before they were scored eagerly
    unfused = [*flags, "--grpo.no_fused_policy_pass", "--grpo.logprob_chunk_tokens", "24", "--grpo.logprob_chunk_mib", "0"]
    dumps = train_runs(tmp_path_factory, {"compiled_cold": run(seed_checkpoint, 2, *flags, steps=STEPS, env=env),
                                          "compiled_unfused": run(seed_checkpoint, 2, *unfused, steps=STEPS, env=env)})
    cold_kernels = set(cache.rglob("*.so"))  # keyed by their source, shared by the ranks
    dumps["compiled_warm"] = train(tmp_path_factory, seed_checkpoint, "compiled_warm", 2, *flags, steps=STEPS, env=env)
    assert cold_kernels and set(cache.rglob("*.so")) == cold_kernels  # the warm run ran what the cold launch left
    eager = scalars(runs["tp2"])
    for name, dump in dumps.items():
        tb = scalars(dump)
        for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/kl"):
            # inductor fuses and reorders fp32 math: agreement to 1e-4, not bitwise
            assert tb[tag] == pytest.approx(eager[tag], rel=1e-4, abs=1e-7), (name, tag)
    assert any((cache / "fxgraph").iterdir())  # the ranks' graphs, each under its own key
    assert not any(p.name.startswith("rank_") for p in cache.iterdir())  # one folder for both ranks


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", BAD_INPUTS)
def test_bad_input_stops_torchrun_at_start_up(runs, overrides, message):
    log = runs[f"bad_input{BAD_INPUTS.index((overrides, message))}"]
    assert "failed, as it should" in log.read_text()
    # the parser writes its error to stderr, which the job's log (rank 0's stdout) does not hold
    assert message in log.read_text() + (log.parent / "stderr.log").read_text()


def test_pipeline_parallelism_stops_torchrun_at_start_up(runs):
    log = runs["pipeline"].read_text()
    assert "failed, as it should" in log and "pipeline parallelism is not supported" in log
