"""End to end: torchrun + torchtitan's own train.py on CPU, with the bundled config and data.

All runs start from one seed checkpoint (torchtitan's --checkpoint.create_seed_checkpoint), so
1 rank, TP=2 and FSDP=2 train the same weights on the same global batch.
"""

import glob
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import torchrun
from plugin.model import REFERENCE_PREFIX

CONFIG = "train_configs/debug_cpu.toml"
STEPS = 3
# fp32 everywhere; TP and FSDP only reorder reductions (seen: 1e-5 relative on grad_norm)
RTOL = 1e-4

RUNS = {
    "single": (1, ["--parallelism.tensor_parallel_degree", "1"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    # half the local batch on each of 2 ranks: the same 16-completion global batch
    "fsdp2": (2, ["--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "2",
                  "--training.local_batch_size", "8"]),
}


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def scalars(dump: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = glob.glob(str(dump / "tb" / "*"))
    acc = EventAccumulator(run_dir)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def checkpoint(path: Path) -> dict:
    out = path.with_suffix(".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("seed")
    _ok(torchrun(1, CONFIG, "--job.dump_folder", str(dump), "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint", "--parallelism.tensor_parallel_degree", "1"))
    return dump / "checkpoint" / "step-0"


def train(tmp_path_factory, seed, name, nproc, extra, env=None) -> Path:
    dump = tmp_path_factory.mktemp(name)
    _ok(torchrun(nproc, CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
                 "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
                 "--checkpoint.no-last-save-model-only", "--checkpoint.interval", "1000", *extra, env=env))
    return dump


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed) -> dict[str, Path]:
    return {name: train(tmp_path_factory, seed, name, n, extra) for name, (n, extra) in RUNS.items()}


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
    tb = {name: scalars(dump) for name, dump in runs.items()}
    single = tb["single"]
    for name in ("tp2", "fsdp2"):
        # step 1's loss is -mean(A) on-policy; grad_norm and later losses depend on the weights
        assert tb[name]["loss_metrics/global_avg_loss"] == pytest.approx(single["loss_metrics/global_avg_loss"], rel=RTOL)
        assert tb[name]["grad_norm"] == pytest.approx(single["grad_norm"], rel=RTOL)
        assert tb[name]["grpo/kl"][1:] == pytest.approx(single["grpo/kl"][1:], rel=1e-3)


@pytest.mark.parametrize("name", ["tp2", "fsdp2"])
def test_reference_frozen_policy_trained(runs, seed, name):
    start = checkpoint(seed)
    end = checkpoint(runs[name] / "checkpoint" / f"step-{STEPS}")
    reference = {k[len(REFERENCE_PREFIX):]: v for k, v in end["optimizer"].items() if k.startswith(REFERENCE_PREFIX)}
    assert set(reference) == set(start)
    for key, initial in start.items():
        assert torch.equal(reference[key], initial), key
        assert not torch.equal(end[key], initial), key


def test_compiled_tp_shares_a_cache_and_matches_eager(runs, seed, tmp_path_factory):
    """TP=2 with compiled blocks, policy loss and reference log-probs, twice on one inductor cache.

    Without the per-rank cache guard the second (warm) run reuses one rank's graph on the
    other rank, with the wrong vocab range baked in, and its losses are silently wrong.
    """
    cache = tmp_path_factory.mktemp("inductor_cache")
    flags = ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.components", "model,loss",
             "--reference_model.compile"]
    eager = scalars(runs["tp2"])
    for name in ("compiled_cold", "compiled_warm"):
        tb = scalars(train(tmp_path_factory, seed, name, 2, flags, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}))
        for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/kl"):
            # inductor fuses and reorders fp32 math: agreement to 1e-4, not bitwise
            assert tb[tag] == pytest.approx(eager[tag], rel=1e-4, abs=1e-7), (name, tag)
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("rank_")) == ["rank_0", "rank_1"]
