"""Every loss aggregation gives the same loss and gradients on one global batch, however it is split.

One global batch of 16 completions (4 groups) per step, from the same seed weights: 1 rank with
padded rows ([grpo] padding_free = false) against padding-free FSDP=2 (8 per rank), TP=2, and 1
rank with 2 gradient-accumulation microbatches of 8, whose completions are balanced by tokens
over ranks and microbatches. torchtitan divides each microbatch's loss sum by the global
completion-token count; the per-completion weights built by the data pipeline make that exact
for every mode, whichever microbatch a completion lands in.
"""

import pytest

from conftest import run, scalars, train_runs

SETUPS = {
    "fsdp2": (2, ["--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "2",
                  "--training.local_batch_size", "8"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "grad_accum2": (1, ["--parallelism.tensor_parallel_degree", "1", "--training.local_batch_size", "8",
                        "--training.global_batch_size", "16"]),
}
# fp32; the set-ups differ only in reduction order (seen: <2e-5 relative)
RTOL = 1e-4


MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"]


@pytest.fixture(scope="module")
def aggregation_runs(seed_checkpoint, tmp_path_factory):
    """Every mode on every set-up: the 1-rank runs share one launch, the 2-rank runs another."""
    runs = {}
    for mode in MODES:
        flags = ["--grpo.loss_aggregation", mode, "--grpo.advantage_norm", "batch_std"]
        runs[mode, "1rank"] = run(seed_checkpoint, 1, "--parallelism.tensor_parallel_degree", "1",
                                  "--grpo.no_padding_free", *flags, steps=2)
        for name, (nproc, extra) in SETUPS.items():
            runs[mode, name] = run(seed_checkpoint, nproc, *extra, *flags, steps=2)
    dumps = train_runs(tmp_path_factory, {f"{mode}_{name}": r for (mode, name), r in runs.items()})
    return {key: scalars(dumps[f"{key[0]}_{key[1]}"]) for key in runs}


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_is_exact_across_parallelisms(mode, aggregation_runs):
    one = aggregation_runs[mode, "1rank"]
    assert len(one["loss_metrics/global_avg_loss"]) == 2
    for name in SETUPS:
        tb = aggregation_runs[mode, name]
        # on-policy, step 1's loss is -mean(A) (0 for the seq modes); grad norms and step 2's loss
        # (KL > 0 by then) check the gradients
        assert tb["loss_metrics/global_avg_loss"] == pytest.approx(one["loss_metrics/global_avg_loss"], rel=RTOL, abs=1e-7), name
        assert tb["grad_norm"] == pytest.approx(one["grad_norm"], rel=RTOL), name
