"""Multi-turn online GRPO with tools under torchrun: layouts draw the same trajectories, tools run once per call,
in the training ranks or in a separate generator process.

The debug model is random, so it writes no hermes calls; tests/toy_tools.py adds a "toy" format that about
half its turns call `echo` in, through the job's own custom_import (how a user adds a format). The chat
template is tests/fixtures/toy_chat.jinja over the bundled tokenizer; 401 stop ids end turns often.
Each run trains one step with an evaluation (the same tools) after it.
"""

import json
import os
from pathlib import Path

import pytest

import plugin.cpu
from conftest import REPO, check, scalars_by_step, torchrun

CONFIG = "train_configs/online_cpu.toml"
STOPS = [1, *range(1000, 1400)]  # <|end_of_text|> (the template's end of turn) first
TOOLS = ("--experimental.custom_import", "toy_tools", "--online.tools", "toy_tools:echo",
         "--online.tool_call_format", "toy", "--online.max_tool_calling_iterations", "2",
         "--rollout_data.chat_template_path", str(REPO / "tests/fixtures/toy_chat.jinja"),
         "--online.reward_funcs", "reward_fns:even_ids,toy_tools:tool_turns", "--online.num_generations", "4",
         "--online.max_new_tokens", "32", "--training.seq_len", "80", "--online.log_completions",
         "--online.stop_token_ids", *map(str, STOPS), "--training.local_batch_size", "16")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tool_prompts") / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Q: {a} {b} + {c} ="}]} for a, b, c in
            [(1, 2, 3), (4, 5, 6), (7, 8, 9), (2, 4, 6)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


LAYOUTS = {
    "1 rank": (1, "--parallelism.tensor_parallel_degree", "1"),
    "TP=2": (2, "--parallelism.tensor_parallel_degree", "2"),
    "FSDP=2": (2, "--parallelism.tensor_parallel_degree", "1", "--training.local_batch_size", "8",
               "--training.global_batch_size", "16"),
    # a separate generator process draws, runs the tools, rewards and evaluates (docs/async.md)
    "generator": (1, "--parallelism.tensor_parallel_degree", "1", "--online.generator_mode", "local"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoint, prompts) -> dict[str, Path]:
    # a launch per layout, TP=2 and FSDP=2 not shared: each run counts its own tool calls, which toy_tools.echo
    # writes to TOY_TOOL_LOG (the launch's environment) in files named by pid, the same for a launch's jobs
    out = {}
    for name, (nproc, *flags) in LAYOUTS.items():
        dump = out[name] = tmp_path_factory.mktemp(name.replace(" ", "_").replace("=", ""))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])),
               "TOY_TOOL_LOG": str(dump)}
        proc = torchrun(nproc, CONFIG, "--job.dump_folder", str(dump), "--training.steps", "1",
                        "--training.dataset_path", str(prompts), "--checkpoint.enable", "--checkpoint.initial_load_path",
                        str(seed_checkpoint), "--checkpoint.interval", "1000", *TOOLS, *flags,
                        "--validation.enable", "--validation.dataset_path", str(prompts), "--validation.freq", "1",
                        "--validation.local_batch_size", "2", "--online.eval_log_completions", env=env)
        check(proc)
        (dump / "rank0.log").write_text(proc.stdout + proc.stderr)
    return out


def test_every_layout_leaves_before_the_interpreters_shutdown(runs):
    # CI saw this launch's TP=2 rank 1 abort after a good run, in the interpreter's shutdown: plugin.cpu's exit skips it
    for name, dump in runs.items():
        assert plugin.cpu.EXIT_NOTE in (dump / "rank0.log").read_text(), name


def trajectories(dump: Path) -> dict[tuple[str, int], dict]:
    """(prompt row, member) -> the logged row of batch 0, over every DP rank's log."""
    out = {}
    for f in sorted((dump / "completions").glob("batch-000000-dp*.jsonl")):
        seen: dict[str, int] = {}
        for line in f.read_text().splitlines():
            row = json.loads(line)
            m = seen[row["where"]] = seen.get(row["where"], -1) + 1
            out[row["where"], m] = row
    return out


def calls(dump: Path) -> list[str]:
    return [line for f in dump.glob("calls-*.txt") for line in f.read_text().splitlines()]


def test_every_layout_draws_the_same_trajectories_and_loss(runs):
    base = trajectories(runs["1 rank"])
    assert len(base) == 16
    turns = [sum(m["role"] == "tool" for m in r["completion"]) for r in base.values()]
    assert max(turns) >= 1 and min(turns) == 0 and max(turns) <= 2  # some rows called, some never; the limit holds
    base_tags = scalars_by_step(runs["1 rank"])
    for name, dump in runs.items():
        other = trajectories(dump)
        assert set(other) == set(base), name
        for k, row in base.items():
            assert other[k]["completion_ids"] == row["completion_ids"], (name, k)
            assert other[k]["tool_mask"] == row["tool_mask"] and other[k]["completion"] == row["completion"], (name, k)
        tags = scalars_by_step(dump)
        for tag in ("loss_metrics/global_avg_loss", "grpo/reward_mean", "tools/call_frequency", "tools/turns_mean",
                    "online/completion_length_mean", "eval/tools/call_frequency"):
            assert tags[tag][1] == pytest.approx(base_tags[tag][1], rel=1e-4, abs=1e-7), (name, tag)


def ran(row: dict) -> int:
    """The tool calls a logged completion made: answered ones, and one whose answer overflowed the budget (rolled
    back: the row ends truncated on a calling turn; a turn past the limit ends with its stop id, no call run)."""
    messages = row["completion"]
    rolled_back = row["truncated"] and bool(messages[-1].get("tool_calls"))
    return sum(m["role"] == "tool" for m in messages) + rolled_back


def test_tools_run_once_per_call_and_are_counted(runs):
    for name, dump in runs.items():
        rows = trajectories(dump)
        made = sum(ran(r) for r in rows.values())
        tags = scalars_by_step(dump)
        # every training call and every evaluation call, each once, whatever the ranks
        evaluated = [json.loads(l) for f in (dump / "eval").glob("step-*.jsonl") for l in f.read_text().splitlines()]
        assert len(calls(dump)) == made + sum(ran(r) for r in evaluated), name
        assert tags["tools/call_frequency"][1] == pytest.approx(made / 16), name
        assert tags["tools/failure_frequency"][1] == 0
        answered = sum(m["role"] == "tool" for r in rows.values() for m in r["completion"])
        assert tags["tools/turns_mean"][1] == pytest.approx(1 + answered / 16)
        assert tags["online/reward/tool_turns_mean"][1] == pytest.approx(answered / 16)  # rewards saw the messages


def test_tool_tokens_are_read_but_not_counted(runs):
    rows = trajectories(runs["1 rank"]).values()
    tags = scalars_by_step(runs["1 rank"])
    model_tokens = [sum(r["tool_mask"]) for r in rows]
    assert any(len(r["tool_mask"]) > sum(r["tool_mask"]) for r in rows)
    # the length metrics and the loss's token count are the model's tokens only (TRL's)
    assert tags["online/completion_length_mean"][1] == pytest.approx(sum(model_tokens) / 16)
    assert tags["grpo/completion_length_mean"][1] == pytest.approx(sum(model_tokens) / 16)
    for r in rows:
        assert len(r["tool_mask"]) == len(r["completion_ids"]) <= 32
        tool_text = r["completion"]
        assert tool_text[-1]["role"] == "assistant"
