"""Does this project's online GRPO teach SmolLM2-135M-Instruct sums as well as TRL's GRPOTrainer? Over seeds.

Both sides start from the converted folder outputs/smollm2_135m with the settings of
train_configs/smollm2_online_cpu.toml, read from the TOML as torchtitan parses it (its defaults included):
- ours: torchrun of that config with --debug.seed S --training.steps N, a DCP checkpoint every gcd(eval steps)
  steps, its own evaluation off;
- TRL: GRPOTrainer (a script this file writes to a temp file, run with a separate venv's python, --trl-python)
  with the same prompts, rewards (the TOML's functions from plugin/example.py, loaded by path), group size,
  new tokens, temperature, AdamW settings, linear decay, clipping and loss (token_mean = TRL's "dapo",
  group_std = scale_rewards "group"), in fp32, saving the model at each eval step.
Each saved model, and the start weights (step 0), is scored with transformers' greedy generate and
benchmarks/smollm2_learning.py's parser (the reply's last integer) on data/smollm2_sum_heldout.jsonl (a, b in
2..49) and on 96 harder sums (a, b in 10..99, seeded here), as the fraction right and the fraction of bare-number
replies. CPU seconds per step: the training process tree's user + system time (/proc) read at each step's log
line (torchtitan's metrics line; a TRL callback's line), differenced.

Simplifications:
1. Prompt order: both draw prompts without replacement from a seeded shuffle of the training file, but not
   the same shuffle, and their samplers draw different tokens: a seed pairs nothing across the two sides.
2. A step's CPU time includes a checkpoint written at its start (torchtitan writes the optimizer too): the
   table gives the median over steps 2..N; the mean and the whole process (start-up included) are in the CSV.
3. HF's Trainer always leaves norm weights out of weight decay; ours follows
   [optimizer] weight_decay_exempt in the TOML (norms_and_biases matches TRL).
4. Finished runs are kept in --work (<side>-seed<S>/result.json) and reused when their settings match, so
   more seeds can be added later; checkpoints are deleted once scored (--keep-checkpoints keeps them).

TRL lives in its own venv, never in this package's dependencies (figures were taken with trl 1.16.0):
    python -m venv ../trl_venv && ../trl_venv/bin/pip install torch==2.13.0 transformers==5.24.0 trl==1.16.0 \\
        accelerate datasets

Usage:
    python benchmarks/trl_parity.py --seeds 0 1 2 --steps 40 --eval-steps 10 20 40
    python benchmarks/trl_parity.py --seeds 0 --steps 2 --eval-steps 2 --limit 16 --threads 1   # a smoke run
    python benchmarks/trl_parity.py --only ours_vllm --name vllm_learning   # ours, vLLM sampling (docs/vllm.md)
    python benchmarks/trl_parity.py --only ours --config train_configs/smollm2_rm_cpu.toml --seeds 0 \
        --name rm_learning --work outputs/rm_learning   # ours, a learned reward model (docs/reward_models.md)
    python benchmarks/trl_parity.py --only ours --config train_configs/smollm2_async_cpu.toml \
        --name async_learning --work outputs/async_learning   # ours, a separate generator at k = 1 (docs/async.md)
Writes benchmarks/results/trl_parity.csv, .png and .md, trl_parity_train.csv (training rewards per step) and
trl_parity_replies.csv (a few replies of each run's last model to the harder sums), and prints the table.
"""

import argparse
import json
import math
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import reduce
from pathlib import Path

import results_md
from job_status import proc_stats, read_scalars  # benchmarks/, the script's folder
from smollm2_learning import EOS, START, bare, checkpoints, greedy_replies, load, parse, score

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = "train_configs/smollm2_online_cpu.toml"
HELDOUT = REPO / "data" / "smollm2_sum_heldout.jsonl"
HARDER_OPERANDS, HARDER_COUNT = range(10, 100), 96
SIDES = ("ours", "trl", "ours_vllm")  # ours_vllm: ours with [online] use_vllm (vLLM samples); only with --only
# torchtitan's metrics line ("step:  3  loss: ...", colour codes removed); the TRL script's own line
STEP_LINE = {"ours": re.compile(r"\bstep:\s*(\d+)\s"), "trl": re.compile(r"^TRL_STEP (\d+)$")}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
REPLIES_SHOWN = 4  # harder sums per run in trl_parity_replies.csv
COLUMNS = ["side", "seed", "step", "heldout_accuracy", "heldout_bare", "harder_accuracy", "harder_bare",
           "cpu_s_per_step_median", "cpu_s_per_step_mean", "wall_s_per_step_median", "process_cpu_s", "steps"]

TRL_SCRIPT = r'''
"""TRL's GRPOTrainer on the SmolLM2 sums, as benchmarks/trl_parity.py asks (run with a venv that has trl)."""
import importlib.util, json, sys
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

a = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("smollm2_rewards", a["rewards_file"])  # stdlib only, unlike plugin/
rewards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rewards)
rows = [json.loads(line) for line in open(a["prompts"], encoding="utf-8")]
eval_steps = set(a["eval_steps"])


class Marks(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"TRL_STEP {state.global_step}", flush=True)  # the benchmark reads the CPU clock at this line
        control.should_save = state.global_step in eval_steps
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        print("TRL_LOG " + json.dumps({"step": state.global_step, **(logs or {})}), flush=True)


model = AutoModelForCausalLM.from_pretrained(a["start"], dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(a["start"])
trainer = GRPOTrainer(
    model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
    reward_funcs=[getattr(rewards, name) for name in a["reward_funcs"]],
    args=GRPOConfig(**a["config"]), callbacks=[Marks()])
trainer.train()
'''


def parse_config(*overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(REPO / CONFIG), *overrides])


def trl_config(cfg, seed: int, steps: int, output_dir: Path) -> dict:
    """GRPOConfig's arguments for the TOML's settings; a setting TRL has no counterpart for stops the run."""
    g, o, opt = cfg.grpo, cfg.online, cfg.optimizer
    checks = {
        "[training] mixed_precision_param = float32": cfg.training.mixed_precision_param == "float32",
        "[grpo] advantage_eps = 1e-4 (TRL's constant)": g.advantage_eps == 1e-4,
        "[grpo] loss_aggregation = token_mean (TRL's dapo)": g.loss_aggregation == "token_mean",
        "[grpo] importance_sampling_level = token": g.importance_sampling_level == "token",
        "[grpo] entropy_coef = 0": g.entropy_coef == 0,
        "[grpo] dual_clip = 0": g.dual_clip == 0,
        "[online] filter_groups = false": not o.filter_groups,
        "[online] stop_token_ids = [<|im_end|>] (TRL stops at the tokenizer's EOS)": o.stop_token_ids in ([], [EOS]),
        "[optimizer] name = AdamW": opt.name == "AdamW",
        "[lr_scheduler] linear decay to 0": cfg.lr_scheduler.decay_type == "linear"
        and cfg.lr_scheduler.min_lr_factor == 0 and cfg.lr_scheduler.decay_ratio is None,
        "[training] global_batch_size = local_batch_size (no accumulation)": cfg.training.global_batch_size
        in (-1, cfg.training.local_batch_size),
    }
    if bad := [k for k, ok in checks.items() if not ok]:
        raise SystemExit(f"{CONFIG}: the TRL side needs " + "; ".join(bad))
    return dict(
        output_dir=str(output_dir), seed=seed, max_steps=steps, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, report_to="none", logging_steps=1, disable_tqdm=True,
        save_strategy="steps", save_steps=steps, save_only_model=True, dataloader_num_workers=0,
        per_device_train_batch_size=cfg.training.local_batch_size, gradient_accumulation_steps=1,
        num_generations=o.num_generations, max_completion_length=o.max_new_tokens,
        temperature=g.temperature, top_k=0, top_p=1.0, repetition_penalty=1.0,  # plain sampling, as ours
        learning_rate=opt.lr, adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay, optim="adamw_torch_fused", max_grad_norm=cfg.training.max_norm,
        lr_scheduler_type="linear", warmup_steps=cfg.lr_scheduler.warmup_steps,
        beta=g.beta, epsilon=g.clip_low, epsilon_high=g.clip_high, loss_type="dapo",
        scale_rewards={"group_std": "group", "batch_std": "batch", "none": "none"}[g.advantage_norm],
        reward_weights=list(o.reward_weights) or None, num_iterations=o.num_iterations,
        mask_truncated_completions=o.mask_truncated_completions,
    )


def process_tree_cpu(root: int) -> float:
    """User + system seconds of `root` and its live descendants, with the children each has waited for."""
    stats = proc_stats()
    parent = {p: int(fields[1]) for p, fields in stats.items()}
    cpu = {p: sum(int(x) for x in fields[11:15]) for p, fields in stats.items()}  # utime stime cutime cstime, ticks
    tree, frontier = {root}, [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(frontier)
    return sum(cpu.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def run_marked(cmd: list[str], side: str, env: dict, log: Path, timeout: float | None) -> dict:
    """Run a training job, reading its process tree's CPU time at each step line; its marks and exit status."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    marks, logs = {}, []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            if m := STEP_LINE[side].search(ANSI.sub("", line).strip()):
                marks[int(m.group(1))] = (process_tree_cpu(proc.pid), time.perf_counter() - start)
            elif line.startswith("TRL_LOG "):
                logs.append(json.loads(line[len("TRL_LOG "):]))
            if timeout and time.perf_counter() - start > timeout:
                os.killpg(proc.pid, 9)
    code = proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise RuntimeError(f"{side} failed (exit {code}); its output: {log}\n" + log.read_text()[-3000:])
    return dict(marks=marks, trl_logs=logs, wall_s=time.perf_counter() - start,
                process_cpu_s=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))


def per_step(marks: dict[int, tuple[float, float]]) -> dict:
    """CPU and wall seconds per step from the marks of steps 1..N (differences from step 2 on)."""
    steps = sorted(marks)
    cpu = [marks[b][0] - marks[a][0] for a, b in zip(steps, steps[1:])]
    wall = [marks[b][1] - marks[a][1] for a, b in zip(steps, steps[1:])]
    if not cpu:
        return dict(cpu_s_per_step_median=math.nan, cpu_s_per_step_mean=math.nan, wall_s_per_step_median=math.nan)
    return dict(cpu_s_per_step_median=statistics.median(cpu), cpu_s_per_step_mean=statistics.mean(cpu),
                wall_s_per_step_median=statistics.median(wall))


def prompt_sets(limit: int | None) -> dict[str, list[dict]]:
    """The held-out file and the harder sums (a, b in 10..99, outside the training range), the first `limit` of each."""
    from plugin.example import sum_question

    heldout = [json.loads(line) for line in open(HELDOUT, encoding="utf-8")]
    pairs = random.Random(0).sample([(a, b) for a in HARDER_OPERANDS for b in HARDER_OPERANDS], HARDER_COUNT)
    harder = [{"prompt": sum_question(a, b), "answer": a + b} for a, b in pairs]
    return {"heldout": heldout[:limit], "harder": harder[:limit]}


def score_model(folder: Path, tokenizer, sets: dict, max_new_tokens: int) -> dict:
    """{set: {accuracy, bare_number, replies}} of one model's greedy replies."""
    t0, c0 = time.perf_counter(), time.process_time()
    model = load(folder, START)
    out = {}
    for name, rows in sets.items():
        replies = greedy_replies(model, tokenizer, rows, max_new_tokens)
        out[name] = {**score(replies, rows), "replies": replies}
    print(f"  scored {folder}: {time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU; "
          + ", ".join(f"{k} {v['accuracy']:.1%}" for k, v in out.items()), file=sys.stderr, flush=True)
    return out


def train_ours(args, seed: int, folder: Path, interval: int, env: dict, vllm: bool = False) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan.train",
           "--job.config_file", CONFIG, "--job.dump_folder", str(folder), "--debug.seed", str(seed),
           "--training.steps", str(args.steps), "--checkpoint.interval", str(interval),
           "--checkpoint.keep_latest_k", "0", "--validation.no_enable", *(["--online.use_vllm"] if vllm else [])]
    run = run_marked(cmd, "ours", env, folder / "train.log", args.timeout)
    tags = read_scalars(folder)
    run["train"] = [dict(step=s, reward_mean=t.get("grpo/reward_mean"),
                         correct_mean=t.get("online/reward/sum_correct_mean"),
                         reward_share=t.get("online/reward_share")) for s, t in sorted(tags.items())]
    run["models"] = {s: str(p) for s, p in checkpoints(folder).items()}
    return run


def train_trl(args, cfg, seed: int, folder: Path, env: dict) -> dict:
    python = Path(args.trl_python)
    if not python.exists():
        raise SystemExit(f"--trl-python {python} does not exist; make TRL's venv as this file's docstring says")
    config = trl_config(cfg, seed, args.steps, folder / "out")
    payload = dict(config=config, start=str(START), prompts=str(REPO / cfg.training.dataset_path),
                   rewards_file=str(REPO / "plugin" / "example.py"), eval_steps=args.eval_steps,
                   reward_funcs=[f.partition(":")[2] for f in cfg.online.reward_funcs])
    if any(not f.startswith("plugin.example:") for f in cfg.online.reward_funcs):
        raise SystemExit(f"{CONFIG}: the TRL side loads reward functions from plugin/example.py only")
    with tempfile.NamedTemporaryFile("w", suffix="_trl_grpo.py", delete=False) as script:
        script.write(TRL_SCRIPT)
    try:
        run = run_marked([str(python), script.name, json.dumps(payload)], "trl", env, folder / "train.log",
                         args.timeout)
    finally:
        os.unlink(script.name)
    run["train"] = [dict(step=entry["step"], reward_mean=entry.get("reward"),
                         correct_mean=entry.get("rewards/sum_correct/mean"))
                    for entry in run.pop("trl_logs") if "reward" in entry]
    run["models"] = {int(p.name.split("-")[1]): str(p) for p in (folder / "out").glob("checkpoint-*")}
    return run


def one_run(args, cfg, side: str, seed: int, sets: dict, tokenizer, settings: dict) -> dict:
    """Train one side with one seed, score its models at the eval steps; reused from --work if done before."""
    folder = Path(args.work) / f"{side}-seed{seed}"
    result_file = folder / "result.json"
    if result_file.exists():
        done = json.loads(result_file.read_text())
        if done["settings"] == settings:
            print(f"{side} seed {seed}: reusing {result_file}", file=sys.stderr)
            return done
    shutil.rmtree(folder, ignore_errors=True)  # ours would resume from a checkpoint left there
    folder.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    print(f"{side} seed {seed}: training {args.steps} steps ({folder / 'train.log'})", file=sys.stderr, flush=True)
    interval = reduce(math.gcd, args.eval_steps)
    run = (train_trl(args, cfg, seed, folder, env) if side == "trl" else
           train_ours(args, seed, folder, interval, env, vllm=side == "ours_vllm"))
    scores = {}
    for step in args.eval_steps:
        if step not in run["models"]:
            raise RuntimeError(f"{side} seed {seed}: no model saved at step {step} (saved: {sorted(run['models'])})")
        scores[step] = score_model(Path(run["models"][step]), tokenizer, sets, cfg.online.max_new_tokens)
    if not args.keep_checkpoints:
        shutil.rmtree(folder / ("out" if side == "trl" else "checkpoint"), ignore_errors=True)
    result = dict(settings=settings, side=side, seed=seed, scores=scores, train=run["train"],
                  process_cpu_s=run["process_cpu_s"], wall_s=run["wall_s"], **per_step(run["marks"]))
    result_file.write_text(json.dumps(result))
    return json.loads(result_file.read_text())  # steps as JSON keys, as a reused result has them


def mean_sd(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return ""
    sd = f" ± {statistics.stdev(values):.1%}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.1%}{sd}"


def table_rows(rows: list[dict]) -> list[dict]:
    """Per side and step: mean ± sd over seeds (and the range) of each figure."""
    num = lambda v: float(v) if v not in ("", None) else math.nan  # noqa: E731
    out = []
    for side in dict.fromkeys(r["side"] for r in rows):
        for step in sorted({int(r["step"]) for r in rows if r["side"] == side}):
            sel = [r for r in rows if r["side"] == side and int(r["step"]) == step]
            acc = [num(r["heldout_accuracy"]) for r in sel]
            cpu = [num(r["cpu_s_per_step_median"]) for r in sel]
            out.append({
                "side": side, "step": step, "seeds": len(sel),
                "held-out right (mean ± sd)": mean_sd(acc),
                "range": f"{min(acc):.1%}–{max(acc):.1%}",
                "harder sums right": mean_sd([num(r["harder_accuracy"]) for r in sel]),
                "bare-number replies": mean_sd([num(r["heldout_bare"]) for r in sel]),
                "CPU s / step": "" if step == 0 or all(map(math.isnan, cpu)) else f"{statistics.mean(cpu):.1f}",
            })
    return out


def train_table_rows(rows: list[dict], block: int = 10) -> list[dict]:
    """Training rewards per side and block of steps, the mean over seeds and steps (the replies drawn at temperature 1)."""
    num = lambda v: float(v) if v not in ("", None) else math.nan  # noqa: E731
    out = []
    for side in dict.fromkeys(r["side"] for r in rows):
        sel = [r for r in rows if r["side"] == side]
        for first in range(1, max(int(r["step"]) for r in sel) + 1, block):
            part = [r for r in sel if first <= int(r["step"]) < first + block]
            mean = lambda key: statistics.mean(num(r[key]) for r in part)  # noqa: B023, E731
            last = max(int(r["step"]) for r in part)
            out.append({"side": side, "steps": f"{first}–{last}", "seeds": len({r["seed"] for r in part}),
                        "reward": f"{mean('reward_mean'):.3f}", "replies right": f"{mean('correct_mean'):.1%}"})
            if any(r.get("reward_share") not in ("", None) for r in part):  # the step's share spent on rewards
                out[-1]["reward share"] = f"{mean('reward_share'):.1%}"
    return out


def replies_table_rows(rows: list[dict]) -> list[dict]:
    """The replies as one table line each: line breaks shown as ⏎, pipes escaped."""
    return [{**r, "reply": r["reply"].replace("|", "\\|").replace("\n", "⏎")} for r in rows]


def run_tables(name: str) -> dict:
    """A --name's three tables: <name>.csv, <name>_train.csv and <name>_replies.csv."""
    return {name: dict(script="trl_parity.py", pick=table_rows),
            f"{name}_train": dict(script="trl_parity.py", pick=train_table_rows),
            f"{name}_replies": dict(script="trl_parity.py", pick=replies_table_rows)}


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {
    **run_tables("trl_parity"),
    **run_tables("vllm_learning"),  # --only ours_vllm --name vllm_learning: the vLLM-sampled runs
    # --only ours --config train_configs/smollm2_rm_cpu.toml --name rm_learning: a learned reward model's runs
    **run_tables("rm_learning"),
    # the same without the KL term, its reward model trained on the sampled replies alone
    # (train_reward_model.py --no-hard-negatives --contrast 0)
    **run_tables("rm_learning_v1"),
    # --only ours --config train_configs/smollm2_async_cpu.toml --name async_learning: a separate generator, k = 1
    **run_tables("async_learning"),
}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    colors = {"ours": "tab:blue", "trl": "tab:orange", "ours_vllm": "tab:green"}
    for ax, key, name in zip(axes, ("heldout_accuracy", "harder_accuracy"), ("held-out sums (a, b in 2..49)",
                                                                           "harder sums (a, b in 10..99)")):
        for side in dict.fromkeys(r["side"] for r in rows):
            sel = [r for r in rows if r["side"] == side]
            steps = sorted({r["step"] for r in sel})
            for seed in sorted({r["seed"] for r in sel if r["step"] > 0}):
                pts = sorted((r["step"], r[key]) for r in sel if r["seed"] == seed)
                ax.plot(*zip(*pts), color=colors.get(side), lw=0.6, alpha=0.35)
            at = [[r[key] for r in sel if r["step"] == s] for s in steps]
            means = [statistics.mean(v) for v in at]
            ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=colors.get(side), alpha=0.12)
            cpu = [r["cpu_s_per_step_median"] for r in sel if r["step"] > 0 and not math.isnan(r["cpu_s_per_step_median"])]
            label = f"{side}" + (f" ({statistics.mean(cpu):.1f} CPU s / step)" if cpu else "")
            ax.plot(steps, means, "o-", color=colors.get(side), label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("GRPO step (0: the start weights)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy replies whose last number is the sum")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    global CONFIG
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of each run (the LR decays to 0 over them)")
    parser.add_argument("--eval-steps", type=int, nargs="+", default=[10, 20, 40],
                        help="steps whose models are scored (step 0, the start weights, always is)")
    parser.add_argument("--only", choices=SIDES, help="run one side only")
    parser.add_argument("--limit", type=int, help="score only the first N prompts of each set (smoke runs)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run and of the scoring")
    parser.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", str(REPO.parent / "trl_venv" / "bin" / "python")),
                        help="python of a venv with trl (default: $TRL_PYTHON or ../trl_venv)")
    parser.add_argument("--work", default=str(REPO / "outputs" / "trl_parity"), help="runs' folders")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--name", default="trl_parity", help="the results' file names: <name>.csv, <name>_train.csv, ...")
    parser.add_argument("--config", default=CONFIG, help="our side's TOML (its settings also set TRL's side)")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--timeout", type=float, help="seconds one training run may take")
    args = parser.parse_args()
    CONFIG = args.config
    args.eval_steps = sorted(set(args.eval_steps) - {0})
    if not args.eval_steps or max(args.eval_steps) > args.steps:
        parser.error(f"--eval-steps must be in 1..--steps {args.steps}")
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    cfg = parse_config()
    sets = prompt_sets(args.limit)
    tokenizer = AutoTokenizer.from_pretrained(str(START))
    settings = dict(steps=args.steps, eval_steps=args.eval_steps, limit=args.limit,
                    config=(REPO / CONFIG).read_text())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    start_file = work / f"start_{args.limit}.json"
    start = json.loads(start_file.read_text()) if start_file.exists() else None
    if start is None:
        start = score_model(START, tokenizer, sets, cfg.online.max_new_tokens)
        start_file.write_text(json.dumps(start))

    runs = [one_run(args, cfg, side, seed, sets, tokenizer, settings)
            for side in ([args.only] if args.only else SIDES[:2]) for seed in args.seeds]

    rows, train_rows, reply_rows = [], [], []
    for run in runs:
        run_figures = {k: round(run[k], 3) for k in ("cpu_s_per_step_median", "cpu_s_per_step_mean",
                                                     "wall_s_per_step_median", "process_cpu_s")}
        for step, s in [(0, start), *((int(k), v) for k, v in run["scores"].items())]:
            rows.append(dict(side=run["side"], seed=run["seed"], step=step,
                             heldout_accuracy=s["heldout"]["accuracy"], heldout_bare=s["heldout"]["bare_number"],
                             harder_accuracy=s["harder"]["accuracy"], harder_bare=s["harder"]["bare_number"],
                             steps=args.steps, **(run_figures if step else {k: math.nan for k in run_figures})))
        train_rows += [dict(side=run["side"], seed=run["seed"], **t) for t in run["train"]]
        last = run["scores"][str(max(args.eval_steps))]["harder"]["replies"]
        reply_rows += [dict(side=run["side"], seed=run["seed"], step=max(args.eval_steps),
                            question=r["prompt"][-1]["content"], answer=r["answer"], reply=reply,
                            right=int(parse(reply) == r["answer"]), bare=int(bare(reply)))
                       for r, reply in list(zip(sets["harder"], last))[:REPLIES_SHOWN]]

    results = Path(args.results)
    name = args.name
    results_md.write_csv(results / f"{name}.csv", rows, COLUMNS, **TABLES["trl_parity"])
    results_md.write_csv(results / f"{name}_train.csv", train_rows,
                         ["side", "seed", "step", "reward_mean", "correct_mean", "reward_share"],
                         **TABLES["trl_parity_train"])
    results_md.write_csv(results / f"{name}_replies.csv", reply_rows,
                         ["side", "seed", "step", "question", "answer", "reply", "right", "bare"],
                         **TABLES["trl_parity_replies"])
    plot(rows, results / f"{name}.png",
         f"SmolLM2-135M-Instruct, {CONFIG}: this project vs TRL's GRPOTrainer\n{len(args.seeds)} seed(s) x "
         f"{args.steps} steps; mean, each seed, and the range over seeds"
         + (f"; first {args.limit} prompts of each set" if args.limit else ""))
    print((results / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
