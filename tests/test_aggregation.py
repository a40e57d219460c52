"""Every loss aggregation gives the same loss and gradients on one global batch, however it is split.

One global batch of 16 completions (4 groups) per step, from the same seed weights: 1 rank with
padded rows ([grpo] padding_free = false) against padding-free FSDP=2 (8 per rank), TP=2, and 1
rank with 2 gradient-accumulation microbatches of 8, whose completions are balanced by tokens
over ranks and microbatches. torchtitan divides each microbatch's loss sum by the global
completion-token count; the per-completion weights built by the data pipeline make that exact
for every mode, whichever microbatch a completion lands in.
"""

import pytest

from conftest import scalars, train

SETUPS = {
    "fsdp2": (2, ["--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "2",
                  "--training.local_batch_size", "8"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "grad_accum2": (1, ["--parallelism.tensor_parallel_degree", "1", "--training.local_batch_size", "8",
                        "--training.global_batch_size", "16"]),
}
# fp32; the set-ups differ only in reduction order (seen: <2e-5 relative)
RTOL = 1e-4


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"])
def test_aggregation_is_exact_across_parallelisms(mode, seed_checkpoint, tmp_path_factory):
    flags = ["--grpo.loss_aggregation", mode, "--grpo.advantage_norm", "batch_std"]
    one = scalars(train(tmp_path_factory, seed_checkpoint, f"{mode}_1rank", 1,
                        "--parallelism.tensor_parallel_degree", "1", "--grpo.no_padding_free", *flags, steps=2))
    for name, (nproc, extra) in SETUPS.items():
        tb = scalars(train(tmp_path_factory, seed_checkpoint, f"{mode}_{name}", nproc, *extra, *flags, steps=2))
        # on-policy, step 1's loss is -mean(A) (0 for the seq modes); grad norms and step 2's loss
        # (KL > 0 by then) check the gradients
        assert tb["loss_metrics/global_avg_loss"] == pytest.approx(one["loss_metrics/global_avg_loss"], rel=RTOL, abs=1e-7), name
        assert tb["grad_norm"] == pytest.approx(one["grad_norm"], rel=RTOL), name
