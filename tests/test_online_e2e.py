"""Online GRPO end to end under torchrun: layouts draw the same completions, replays clip, resume is exact."""

import json
import math
import os
from pathlib import Path

import pytest

from conftest import REPO, check, job_logs, scalars_by_step, torchrun_jobs

CONFIG = "train_configs/online_cpu.toml"
# a graded reward from tests/reward_fns.py: a random policy's groups already differ, so the loss is not 0
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
SMALL = ("--online.reward_funcs", "reward_fns:even_ids", "--online.num_generations", "4",
         "--online.max_new_tokens", "6", "--training.seq_len", "20", "--online.log_completions")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"Q: {a} {b} + {c} =", "answer": a * 10 + b + c} for a, b, c in
            [(1, 2, 3), (4, 5, 6), (7, 8, 9), (2, 4, 6), (3, 5, 7), (9, 1, 2), (8, 6, 4), (5, 5, 5)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job(dump: Path, seed: Path, prompts: Path, steps: int, *extra: str) -> list[str]:
    """A run's arguments: the online config on the test prompts, from the seed weights."""
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--training.dataset_path", str(prompts), "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
            "--checkpoint.interval", "1000", *SMALL, *extra]


def completions(dump: Path, batch: int = 0) -> dict[tuple[str, int], list[int]]:
    """(prompt row, member) -> completion ids of one sampled batch, over every DP rank's log."""
    out = {}
    for f in sorted((dump / "completions").glob(f"batch-{batch:06d}-dp*.jsonl")):
        seen: dict[str, int] = {}
        for line in f.read_text().splitlines():
            row = json.loads(line)
            m = seen[row["where"]] = seen.get(row["where"], -1) + 1
            out[row["where"], m] = row["completion_ids"]
    return out


LAYOUTS = {
    "1 rank": (1, "--parallelism.tensor_parallel_degree", "1"),
    "TP=2": (2,),
    "FSDP=2": (2, "--parallelism.tensor_parallel_degree", "1", "--training.local_batch_size", "16",
               "--training.global_batch_size", "32"),
    "1 rank, grad accumulation 2": (1, "--parallelism.tensor_parallel_degree", "1", "--training.local_batch_size",
                                    "16", "--training.global_batch_size", "32"),
}


MU_STEPS, MU_AT = 4, 3  # num_iterations = 2: batch 1's first step is step 3, its replay step 4
MU = ("--online.num_iterations", "2", "--optimizer.lr", "1e-2", "--lr_scheduler.total_steps", str(MU_STEPS),
      "--checkpoint.interval", str(MU_AT), "--checkpoint.no-last-save-model-only",
      "--parallelism.tensor_parallel_degree", "2", "--grpo.beta", "0.04")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    """A tiny random Qwen3ForSequenceClassification on the bundled tokenizer (tests/test_reward_models.py)."""
    from test_reward_models import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("reward_model") / "rm", "qwen3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoint, prompts, reward_model) -> dict[str, Path]:
    """Every run of this file, in one launch per rank count (2 launches): the 1-rank runs first in the 2-rank launch,
    on its rank 0 (tests/run_jobs.py's `nproc`), the bad inputs' runs, which must fail, last of them, each with its
    log in a file (`bad_input_logs`)."""
    dumps = {name: tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", "").replace("=", ""))
             for name in [*LAYOUTS, "mu_straight", "mu_split", "variants", "eval", "bf16", "reward_model"]}
    jobs = {1: [], 2: [], 4: []}
    for name, (nproc, *flags) in LAYOUTS.items():
        # 8 groups of 4 = 32 completions per batch; one step
        jobs[nproc].append(job(dumps[name], seed_checkpoint, prompts, 1, "--training.local_batch_size", "32", *flags))
    jobs[1].append(job(dumps["variants"], seed_checkpoint, prompts, 2, *VARIANTS))
    # the resumed half of mu_split runs last, after other runs: state left in the process by the straight run
    # could not stand in for a checkpoint that lacks it
    jobs[2][:0] = [job(dumps["mu_straight"], seed_checkpoint, prompts, MU_STEPS, *MU),
                   job(dumps["mu_split"], seed_checkpoint, prompts, MU_AT, *MU)]
    jobs[2].append(eval_job(dumps["eval"], prompts))
    jobs[2].append(eval_job(dumps["reward_model"], prompts) + [
        "--online.reward_funcs", f"reward_fns:even_ids,{reward_model}", "--online.reward_weights", "1", "0.5"])
    jobs[2].append(job(dumps["mu_split"], seed_checkpoint, prompts, MU_STEPS, *MU))
    jobs[4].append(job(dumps["bf16"], seed_checkpoint, prompts, 2, *BF16))
    jobs[1] += [{"argv": ["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path_factory.mktemp("bad_input")),
                          "--training.steps", "1", "--training.dataset_path", str(prompts),
                          "--parallelism.tensor_parallel_degree", "1", "--checkpoint.no-enable",  # no warm-up weights
                          *SMALL, *flags], "fails": True} for flags, _ in BAD_INPUTS]
    jobs[2][:0] = [{**(argv if isinstance(argv, dict) else {"argv": argv}), "nproc": 1} for argv in jobs.pop(1)]
    for nproc, argvs in jobs.items():
        proc = torchrun_jobs(nproc, argvs, env=ENV)
        check(proc)
        if nproc == 2:
            logs = job_logs(proc)
            assert len(logs) == len(argvs), proc.stdout[-4000:]
            bad = [log for argv, log in zip(argvs, logs) if isinstance(argv, dict) and argv.get("fails")]
            assert len(bad) == len(BAD_INPUTS)
            for i, log in enumerate(bad):
                dumps[f"bad_input{i}"] = tmp_path_factory.mktemp("bad_input_log") / "job.log"
                dumps[f"bad_input{i}"].write_text(log)
    return dumps


@pytest.fixture(scope="module")
def layout_runs(runs) -> dict[str, Path]:
    return {name: runs[name] for name in LAYOUTS}


def test_every_layout_draws_the_same_completions_and_loss(layout_runs):
    base = completions(layout_runs["1 rank"])
    assert len(base) == 32
    base_tags = scalars_by_step(layout_runs["1 rank"])
    assert base_tags["online/reward/even_ids_std"][1] > 0  # the groups differ: the loss has something to do
    for name, dump in layout_runs.items():
        other = completions(dump)
        assert set(other) == set(base), name
        same = sum(other[k] == base[k] for k in base) / len(base)
        print(f"{name}: {same:.0%} of completions identical to 1 rank")
        assert same == 1.0, name
        tags = scalars_by_step(dump)
        for tag in ("loss_metrics/global_avg_loss", "grpo/reward_mean", "grpo/advantage_std"):
            assert tags[tag][1] == pytest.approx(base_tags[tag][1], rel=1e-4, abs=1e-7), (name, tag)


def test_online_metrics_are_logged(layout_runs):
    tags = scalars_by_step(layout_runs["TP=2"])
    for tag in ("online/generation_time(s)", "online/generation_share", "online/generated_tokens_per_s",
                "online/completion_length_mean", "online/completion_length_max", "online/truncated_fraction",
                "online/reward/even_ids_mean", "online/reward/even_ids_std", "online/logprob_mismatch",
                "online/reward_time(s)", "online/reward_share"):
        assert tag in tags, tag
    assert 0 < tags["online/generation_share"][1] < 1
    assert tags["online/completion_length_max"][1] <= 6
    assert tags["online/logprob_mismatch"][1] < 1e-4  # fp32: the sampler and the trainer agree


@pytest.fixture(scope="module")
def mu_runs(runs) -> dict[str, Path]:
    return {"straight": runs["mu_straight"], "split": runs["mu_split"]}


def test_replays_start_at_ratio_one_and_then_clip(mu_runs):
    tags = scalars_by_step(mu_runs["straight"])
    for step in (1, 3):  # a batch's first step: old log-probs are this very pass's
        assert tags["grpo/ratio_mean"][step] == 1.0 and tags["grpo/clip_fraction"][step] == 0.0
        assert "online/generation_time(s)" in {t for t, v in tags.items() if step in v}
    for step in (2, 4):  # the replay: the policy moved, and the clip is active
        assert tags["grpo/ratio_mean"][step] != 1.0 and tags["grpo/clip_fraction"][step] > 0
        assert step not in tags.get("online/generation_time(s)", {})  # nothing sampled
    assert sorted(p.name for p in (mu_runs["straight"] / "completions").iterdir()) == \
        ["batch-000000-dp0.jsonl", "batch-000001-dp0.jsonl"]


def test_resume_mid_replay_is_bitwise(mu_runs):
    straight, split = (scalars_by_step(mu_runs[k]) for k in ("straight", "split"))
    assert sorted(split["loss_metrics/global_avg_loss"]) == list(range(1, MU_STEPS + 1))
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/kl", "grpo/reward_mean", "grpo/ratio_mean",
                "grpo/clip_fraction"):
        assert split[tag] == straight[tag], tag
    assert straight["grpo/kl"][4] > 0
    # the resumed launch replayed the saved batch: it sampled nothing before step 4
    assert not (mu_runs["split"] / "completions" / "batch-000002-dp0.jsonl").exists()


BAD_INPUTS = [
    (("--online.reward_funcs", "no_such_module:reward"),
     "[online] reward_funcs[0] = 'no_such_module:reward': cannot import module 'no_such_module'"),
    (("--online.max_new_tokens", "18"), "prompts.jsonl:1: the prompt is"),
    (("--online.reward_funcs", "reward_fns:raises_on_seven"), "raised on the prompt at "),
    # the bundled tokenizer has no chat template to show tools in
    (("--online.tools", "reward_fns:tool_like"), "set [rollout_data] chat_template_path to a template with tool support"),
    (("--online.tools", "reward_fns:no_such_tool"), "[online] tools[0] = \"reward_fns:no_such_tool\""),
]


@pytest.fixture(scope="module")
def bad_input_logs(runs) -> list[str]:
    """Each bad input's log: its run, which must stop with an error, is a 1-rank job of `runs`'s 2-rank launch."""
    return [runs[f"bad_input{i}"].read_text() for i in range(len(BAD_INPUTS))]


@pytest.mark.parametrize("flags, message", BAD_INPUTS)
def test_bad_input_stops_the_run_with_a_named_error(bad_input_logs, flags, message):
    log = bad_input_logs[BAD_INPUTS.index((flags, message))]
    assert "failed, as it should" in log
    assert message in log


def eval_job(dump: Path, prompts: Path) -> list[str]:
    """5 held-out prompts on 2 FSDP ranks, 2 per call, from random weights."""
    heldout = dump / "heldout.jsonl"
    heldout.write_text("".join(l + "\n" for l in prompts.read_text().splitlines()[:5]))
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", "2",
            "--training.dataset_path", str(prompts), "--parallelism.tensor_parallel_degree", "1",
            "--training.local_batch_size", "8", "--checkpoint.no-enable", *SMALL,
            "--validation.enable", "--validation.dataset_path", str(heldout), "--validation.local_batch_size", "2",
            "--online.num_generations_eval", "2", "--online.eval_temperature", "1.0", "--online.eval_log_completions"]


def test_evaluation_splits_prompts_over_fsdp_ranks_and_logs_eval_figures(runs):
    """5 held-out prompts on 2 FSDP ranks, 2 per call: rank 1's second call has none and still joins the collectives."""
    dump = runs["eval"]
    heldout = dump / "heldout.jsonl"
    tags = scalars_by_step(dump)
    assert sorted(tags["eval/reward_mean"]) == [1, 2]  # after step 1 and after the last
    for step in (1, 2):
        rows = [json.loads(l) for r in (0, 1)
                for l in (dump / "eval" / f"step-{step:06d}-dp{r}.jsonl").read_text().splitlines()]
        assert sorted(r["where"] for r in rows) == sorted(f"{heldout}:{i}" for i in range(1, 6) for _ in range(2))
        rewards = [r["reward"] for r in rows]
        assert tags["eval/reward_mean"][step] == pytest.approx(sum(rewards) / 10, rel=1e-6)
        assert tags["eval/reward/even_ids_mean"][step] == pytest.approx(sum(rewards) / 10, rel=1e-6)
        full = sum(r["rewards"]["even_ids"] >= 1 for r in rows) / 10
        assert tags["eval/full_reward_share"][step] == pytest.approx(full)


def test_a_reward_model_scores_training_and_evaluation_on_fsdp(runs, reward_model):
    """reward_funcs = [even_ids, a reward model folder], weights 1 and 0.5, on 2 FSDP ranks with evaluation (whose rank
    1 has no prompts in its second call and still joins the reward model's forwards): every logged completion's
    reward is the weighted sum, and the model's scores are transformers' on the prompt + completion text."""
    from test_reward_models import oracle

    from plugin.data.prompts import Prompt

    dump = runs["reward_model"]
    tags = scalars_by_step(dump)
    for tag in ("online/reward/rm_mean", "online/reward/rm_std", "eval/reward/rm_mean"):
        assert tag in tags, tag
    rows = [json.loads(line) for f in sorted((dump / "completions").glob("batch-000000-dp*.jsonl"))
            for line in f.read_text().splitlines()]
    rows += [json.loads(line) for f in sorted((dump / "eval").glob("step-000002-dp*.jsonl"))
             for line in f.read_text().splitlines()]
    assert len(rows) == 16 + 10  # a batch of 4 groups of 4, and 5 held-out prompts x 2
    for r in rows:
        assert r["reward"] == pytest.approx(r["rewards"]["even_ids"] + 0.5 * r["rewards"]["rm"], abs=1e-6)
    some = rows[:3] + rows[-3:]
    expected = oracle(reward_model, [Prompt([], r["prompt"], {}, "") for r in some], [r["completion"] for r in some])
    assert [r["rewards"]["rm"] for r in some] == pytest.approx(expected, abs=1e-5)


VARIANTS = ("--parallelism.tensor_parallel_degree", "1", "--training.local_batch_size", "32",
            "--online.reward_funcs", "reward_fns:soft_overlong,reward_fns:even_ids", "--online.filter_groups",
            "--grpo.importance_sampling_level", "sequence", "--grpo.fused_policy_pass", "--online.num_iterations", "2")


def test_variants_train_together_with_trls_soft_overlong_reward(runs):
    """TRL's soft overlong punishment (tests/reward_fns.py: TRL's own, or its copy) with the issue-19 variants on:
    dynamic sampling, GSPO's sequence ratio in the fused pass, two steps per batch. (mask_truncated_completions is
    tested in tests/test_online.py: the random debug model rarely samples EOS, so it would mask every completion.)"""
    dump = runs["variants"]
    tags = scalars_by_step(dump)
    assert "online/reward/soft_overlong_mean" in tags and tags["online/groups_dropped"][1] >= 0
    assert tags["online/extra_rounds"][1] >= 0
    assert tags["grpo/ratio_mean"][1] == 1.0 and tags["grpo/ratio_mean"][2] != 1.0  # the replay's sequence ratios
    rows = [json.loads(line) for line in (dump / "completions" / "batch-000000-dp0.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(r["rewards"]["soft_overlong"] <= 0 for r in rows)
    groups = [[r["reward"] for r in rows[i : i + 4]] for i in range(0, 32, 4)]
    assert all(len(set(g)) > 1 for g in groups)  # no equal-reward group left in the batch


BF16 = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "16",
        "--training.global_batch_size", "32")


def test_the_gpu_configs_layout_samples_in_bf16(runs):
    """TP=2 x FSDP=2 with bf16 mixed precision, as train_configs/qwen3_0.6b_gpu.toml: the sampler computes in FSDP's
    bf16 (tests/test_sampler.py checks the dtypes), the trainer's log-probs follow it within bf16's rounding, and
    the mismatch and generation memory are logged."""
    dump = runs["bf16"]
    tags = scalars_by_step(dump)
    assert len(completions(dump)) == 32
    for step in (1, 2):
        mismatch = tags["online/logprob_mismatch"][step]
        print(f"step {step}: online/logprob_mismatch {mismatch:.2e}")
        assert 0 <= mismatch < 0.1  # bf16 (fp32: < 1e-4, test_online_metrics_are_logged)
        assert tags["online/generation_peak_memory(GiB)"][step] > 0
        assert math.isfinite(tags["loss_metrics/global_avg_loss"][step])
