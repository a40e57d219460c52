"""Does GRPO on the bundled arithmetic rollouts teach the policy? Held-out log-probs before and after.

The bundled config (train_configs/debug_cpu.toml, llama3 debugmodel, TP=2) trains from a seed
checkpoint; then, for each of the 64 held-out groups (data/arith_heldout.jsonl, prompts never in
training), the margin is mean log p(completion | prompt) of its reward-1 completions minus that
of its reward-0 completions, log-probs summed over completion tokens with plugin.scoring.logprobs. The
figure is the margin's mean over groups, for the seed weights and for the trained ones.

Simplifications:
1. One seed and one run; the test (tests/test_learning.py) asserts half the observed rise.
2. The policy is scored in fp32 on CPU, one batch of all 256 held-out completions.

Usage: python benchmarks/learning_signal.py [--steps 40] [--out-dir /tmp/learning_signal]
Writes benchmarks/results/learning_signal.csv and .png and prints the figures.

The online example is measured by exact match instead: `--accuracy CHECKPOINT...` prints, per
checkpoint, the share of right answers (plugin.example.reward) to data/compare_heldout.jsonl's
prompts, greedy and sampled at temperature 1 (8 draws each), and the share of prompts whose draws
mix right and wrong answers, as JSON, drawn with the plugin's KV-cache sampler.
`--online` runs the online example itself: the warm-up (train_configs/online_warmup_cpu.toml), then
train_configs/online_cpu.toml from its weights with a checkpoint every `--every` steps, and writes
each checkpoint's accuracy and the train reward per step to benchmarks/results/online_learning.csv
and .png.
"""

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import results_md
from harness import ONE_RANK, build_model  # benchmarks/, the script's folder
from job_status import read_scalars

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = "train_configs/debug_cpu.toml"
HELDOUT = REPO / "data" / "arith_heldout.jsonl"
COMPARE_HELDOUT = REPO / "data" / "compare_heldout.jsonl"  # the online example's held-out prompts
SEQ_LEN = 16  # debug_cpu.toml's [training] seq_len


def table_rows(rows: list[dict]) -> list[dict]:
    """learning_signal.csv's margins per group as their mean, median and the share of groups that rose."""
    before = [float(r["margin_before"]) for r in rows]
    after = [float(r["margin_after"]) for r in rows]
    return [
        {f"{len(rows)} held-out groups": "mean margin (nats)", "before": f"{statistics.mean(before):+.2f}",
         "after": f"{statistics.mean(after):+.2f}"},
        {f"{len(rows)} held-out groups": "median margin (nats)", "before": f"{statistics.median(before):+.2f}",
         "after": f"{statistics.median(after):+.2f}"},
        {f"{len(rows)} held-out groups": "groups whose margin rose", "before": "",
         "after": f"{sum(a > b for a, b in zip(after, before)) / len(rows):.0%}"},
    ]


def online_table_rows(rows: list[dict]) -> list[dict]:
    """online_learning.csv's steps that have a held-out accuracy."""
    return [{"online step": r["step"], "greedy exact match": results_md.pct(r["heldout_greedy"]),
             "sampled (temperature 1)": results_md.pct(r["heldout_sampled"]),
             "prompts with mixed draws": results_md.pct(r["heldout_mixed"])}
            for r in rows if r["heldout_greedy"]]


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {
    "learning_signal": dict(script="learning_signal.py", pick=table_rows),
    "learning_signal_seeds": dict(script="learning_signal.py --seeds", pick=results_md.over_seeds(
        {"margin": "mean margin (nats)"}, points=False, largest=("kl_max", "largest grpo/kl"))),
    "online_learning": dict(script="learning_signal.py --online", pick=online_table_rows),
    "online_learning_seeds": dict(script="learning_signal.py --online --seeds", pick=results_md.over_seeds(
        {"greedy": "greedy exact match", "sampled": "sampled"}, points=True)),
}


def load_policy(checkpoint: Path, max_seq_len: int = SEQ_LEN) -> torch.nn.Module:
    """The GRPO llama3 debugmodel with the policy weights of a DCP checkpoint folder (model-only or full)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # the policy alone, on one rank; the rotary table (freqs_cis) is a non-persistent buffer, so any
    # max_seq_len loads any checkpoint
    model, *_ = build_model("--model.name", "grpo_llama3", "--model.flavor", "debugmodel", "--training.seq_len",
                            str(max_seq_len), "--grpo.beta", "0", *ONE_RANK)
    out = Path(f"{checkpoint}.pt")
    # converted once per checkpoint; again when the folder was written anew (a re-run warm-up)
    if not out.exists() or out.stat().st_mtime < (Path(checkpoint) / ".metadata").stat().st_mtime:
        dcp_to_torch_save(str(checkpoint), str(out))
    saved = torch.load(out, weights_only=False)
    # a full checkpoint keeps the model's entries at top level, next to "optimizer" and the rest
    model.load_state_dict({k: saved[k] for k in model.state_dict()})
    return model.eval()


@torch.no_grad()
def heldout_margins(model: torch.nn.Module, path: Path = HELDOUT) -> np.ndarray:
    """Per held-out group: mean summed log-prob of its reward-1 completions minus its reward-0 ones."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from plugin.config import GRPO
    from plugin.data.batch import Collate
    from plugin.scoring.logprobs import compute_logprobs
    from plugin.data.rollouts import Encoder, index_rollouts

    tokenizer = HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))
    index = index_rollouts(str(path), Encoder(tokenizer, tokenizer.get_vocab_size(), SEQ_LEN))
    items = np.arange(len(index.offsets))
    # padded rows: each row is one held-out completion, summed below
    inputs, labels = Collate(SEQ_LEN, tokenizer.eos_id, GRPO(padding_free=False), index.group_size)(
        torch.from_numpy(index.rewards), torch.from_numpy(index.lengths).long(), items.tolist(), index.read(items)
    )
    logits = model(inputs["input"])  # [B, T, V]: no labels, so torchtitan's own forward
    logprobs = compute_logprobs(logits, labels).sum(dim=1).view(-1, index.group_size).double()  # [groups, G]
    right = torch.from_numpy(index.rewards).view(-1, index.group_size) == 1
    mean = lambda m: (logprobs * m).sum(1) / m.sum(1)  # noqa: E731
    return (mean(right) - mean(~right)).numpy()


def heldout_accuracy(model: torch.nn.Module, path: Path = COMPARE_HELDOUT, samples: int = 8,
                     temperature: float = 1.0, max_new_tokens: int = 8, seed: int = 0) -> dict:
    """Exact-match accuracy (plugin.example.reward) on a prompts file: greedy, and `samples` draws at `temperature`.

    The completions come from the plugin's KV-cache sampler (what online training and its evaluation draw
    with), every prompt's rows in one call; draw j of prompt i has key seed * 2^32 + i * samples + j.
    `mixed` is the fraction of prompts whose draws hold both a right and a wrong answer: the
    groups that would give GRPO a non-zero advantage.
    """
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from plugin.example import reward
    from plugin.generation.engine import build_sampler
    from plugin.generation.sampler import generation_mode

    tokenizer = HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))
    prompts = [json.loads(line)["prompt"] for line in open(path, encoding="utf-8")]
    encoded = [tokenizer.encode(p, add_bos=True) for p in prompts]

    def rewards(n: int, temperature: float) -> np.ndarray:
        """[prompts, n]: the rewards of n completions of each prompt, cut before EOS."""
        sampler = build_sampler(model, kv_cache=True, max_new_tokens=max_new_tokens, stop_ids=[tokenizer.eos_id],
                                temperature=temperature, pad_id=tokenizer.eos_id)
        with generation_mode(model):
            done = sampler.generate([ids for ids in encoded for _ in range(n)],
                                    [(seed << 32) + j for j in range(len(encoded) * n)]).completions
        cut = [c[: c.index(tokenizer.eos_id)] if tokenizer.eos_id in c else c for c in done]
        return np.array([reward(prompts[j // n], tokenizer.decode(c)) for j, c in enumerate(cut)]).reshape(-1, n)

    greedy, drawn = rewards(1, 0.0)[:, 0], rewards(samples, temperature)
    return {"prompts": len(prompts), "greedy": float(greedy.mean()), "sampled": float(drawn.mean()),
            "mixed": float(np.mean((drawn.min(1) == 0) & (drawn.max(1) == 1))), "temperature": temperature,
            "samples": samples}


def torchrun(nproc: int, *args: str, config: str = CONFIG) -> float:
    """Seconds from launch to exit of a torchtitan run of `config` with `args` as overrides."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0", "-m", "torchtitan.train",
           "--job.config_file", config, *args]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    return time.perf_counter() - start


def warm_start(out: Path) -> tuple[Path, float]:
    """The warm-up's last checkpoint (online_warmup_cpu.toml, seed 0 as the test's) and its seconds (0: reused)."""
    warm = out / "warmup"
    start = warm / "checkpoint" / "step-60"  # online_warmup_cpu.toml's steps
    warm_s = 0.0 if start.exists() else torchrun(2, "--job.dump_folder", str(warm),
                                                  config="train_configs/online_warmup_cpu.toml")
    return start, warm_s


def online_run(start: Path, run: Path, steps: int, every: int, seed: int = 0) -> tuple[dict, dict, float]:
    """Online GRPO from the warm-up's weights with --debug.seed `seed`: held-out accuracy of every checkpoint
    (step 0: the warm-up's), the train reward per step, and the run's seconds."""
    shutil.rmtree(run, ignore_errors=True)  # a checkpoint left there would be resumed from
    online_s = torchrun(2, "--job.dump_folder", str(run), "--training.steps", str(steps),
                        "--checkpoint.initial_load_path", str(start), "--checkpoint.interval", str(every),
                        "--debug.seed", str(seed), config="train_configs/online_cpu.toml")
    checkpoints = {0: start, **{s: run / "checkpoint" / f"step-{s}" for s in range(every, steps + 1, every)}}
    accuracy = {s: heldout_accuracy(load_policy(c, max_seq_len=32)) for s, c in checkpoints.items()}
    rewards = {s: tags["grpo/reward_mean"] for s, tags in read_scalars(run).items()}
    return accuracy, rewards, online_s


def offline_run(out: Path, steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """debug_cpu.toml from a seed checkpoint, both with --debug.seed `seed` (the init and the data order):
    the held-out margins of the seed weights and of the trained ones (runs found in `out` are reused)."""
    seeds = ("--debug.seed", str(seed))
    init, run = out / "seed", out / "run"
    if not (init / "checkpoint" / "step-0").exists():
        torchrun(1, "--job.dump_folder", str(init), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                 "--parallelism.tensor_parallel_degree", "1", *seeds)
    if not (run / "checkpoint" / f"step-{steps}").exists():
        torchrun(2, "--job.dump_folder", str(run), "--training.steps", str(steps), "--checkpoint.enable",
                 "--checkpoint.initial_load_path", str(init / "checkpoint" / "step-0"),
                 "--checkpoint.interval", "1000", *seeds)
    return heldout_margins(load_policy(init / "checkpoint" / "step-0")), \
        heldout_margins(load_policy(run / "checkpoint" / f"step-{steps}"))


def over_seeds(args) -> None:
    """The tests' learning checks (tests/test_learning.py) over --seeds: one CSV line per seed, and the spread.

    Offline: debug_cpu.toml for --steps (40), seed checkpoint and run both with the seed, and the run's
    largest grpo/kl (the test bounds it). Online (--online): the warm-up once (seed 0), then online_cpu.toml
    for --steps (25) with each seed, scored at its end.
    """
    out, results = Path(args.out_dir), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.online:
        steps = args.steps or 25
        start, _ = warm_start(out)
        for seed in args.seeds:
            t0 = time.perf_counter()
            accuracy, _, _ = online_run(start, out / f"online-seed{seed}", steps, steps, seed)
            a, b = accuracy[0], accuracy[steps]
            rows.append(dict(seed=seed, steps=steps, greedy_before=a["greedy"], greedy_after=b["greedy"],
                             sampled_before=a["sampled"], sampled_after=b["sampled"],
                             greedy_rise=b["greedy"] - a["greedy"], sampled_rise=b["sampled"] - a["sampled"],
                             wall_s=time.perf_counter() - t0))
            print(json.dumps(rows[-1]), flush=True)
        name = "online_learning_seeds"
    else:
        steps = args.steps or 40
        for seed in args.seeds:
            t0 = time.perf_counter()
            before, after = offline_run(out / f"seed{seed}", steps, seed)
            kl = [tags["grpo/kl"] for tags in read_scalars(out / f"seed{seed}" / "run").values()]
            rows.append(dict(seed=seed, steps=steps, margin_before=before.mean(), margin_after=after.mean(),
                             margin_rise=after.mean() - before.mean(), groups_rose=float((after > before).mean()),
                             kl_max=max(kl), wall_s=time.perf_counter() - t0))
            print(json.dumps(rows[-1]), flush=True)
        name = "learning_signal_seeds"
    rows = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    print(results_md.write_csv(results / f"{name}.csv", rows, list(rows[0]), **TABLES[name]).read_text())


def online(out: Path, steps: int, every: int, results: Path) -> None:
    """The online example from scratch: warm-up, online GRPO, held-out accuracy of every checkpoint."""
    start, warm_s = warm_start(out)
    accuracy, rewards, online_s = online_run(start, out / "online", steps, every)

    results.mkdir(parents=True, exist_ok=True)
    with open(results / "online_learning.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "train_reward_mean", "heldout_greedy", "heldout_sampled", "heldout_mixed"])
        for s in sorted(set(rewards) | set(accuracy)):
            a = accuracy.get(s, {})
            writer.writerow([s, round(rewards[s], 4) if s in rewards else "",
                             *(round(a[k], 4) if a else "" for k in ("greedy", "sampled", "mixed"))])
    results_md.write(results / "online_learning.csv", **TABLES["online_learning"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = sorted(rewards)
    smooth = np.convolve([rewards[s] for s in xs], np.ones(10) / 10, mode="valid")
    ax.plot(xs, [rewards[s] for s in xs], color="lightgray", lw=0.8, label="train reward (4 prompts x 8)")
    ax.plot(xs[9:], smooth, color="gray", label="train reward, mean of 10 steps")
    steps_seen = sorted(accuracy)
    for key, style in (("greedy", "o-"), ("sampled", "s-")):
        ax.plot(steps_seen, [accuracy[s][key] for s in steps_seen], style, label=f"held-out exact match, {key}")
    ax.set_xlabel(f"online GRPO step (step 0: the warm-up's weights); {online_s / 60:.1f} min on 2 CPU ranks")
    ax.set_ylabel("share right")
    ax.set_ylim(0, max(0.6, max(rewards.values()) + 0.05))
    ax.set_title("Online GRPO on the compare task: 256 held-out prompts, greedy and temperature 1 (8 draws)",
                 fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(results / "online_learning.png", dpi=110)
    for s in steps_seen:
        a = accuracy[s]
        print(f"step {s:4d}: greedy {a['greedy']:.1%}, sampled {a['sampled']:.1%}, mixed groups {a['mixed']:.0%}")
    first, last = accuracy[0], accuracy[steps_seen[-1]]
    print(f"warm-up {warm_s:.0f} s (0: reused), online {steps} steps {online_s:.0f} s; held-out greedy "
          f"{100 * (last['greedy'] - first['greedy']):+.1f} points, sampled {100 * (last['sampled'] - first['sampled']):+.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="default: 40, the main job's; 100 with --online")
    parser.add_argument("--out-dir", default="/tmp/learning_signal")
    parser.add_argument("--score", nargs="+", metavar="CHECKPOINT",
                        help="only print each DCP checkpoint's held-out margins as JSON (tests/test_learning.py)")
    parser.add_argument("--accuracy", nargs="+", metavar="CHECKPOINT",
                        help="only print each DCP checkpoint's exact-match accuracy on --prompts as JSON")
    parser.add_argument("--prompts", default=str(COMPARE_HELDOUT), help="prompts file for --accuracy")
    parser.add_argument("--samples", type=int, default=8, help="draws per prompt at --temperature, for --accuracy")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--online", action="store_true", help="the online example: warm-up, then --steps online steps")
    parser.add_argument("--every", type=int, default=25, help="online: a checkpoint and its accuracy every N steps")
    parser.add_argument("--results", default=str(RESULTS), help="where the CSV and PNG go")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="the test's check once per --debug.seed: <name>_seeds.csv, the rise per seed")
    args = parser.parse_args()
    if args.seeds:
        over_seeds(args)
        return
    if args.online:
        online(Path(args.out_dir), args.steps or 100, args.every, Path(args.results))
        return
    if args.score:
        print(json.dumps({c: heldout_margins(load_policy(Path(c))).tolist() for c in args.score}))
        return
    if args.accuracy:
        print(json.dumps({c: heldout_accuracy(load_policy(Path(c), max_seq_len=32), Path(args.prompts), args.samples,
                                              args.temperature) for c in args.accuracy}))
        return
    args.steps = args.steps or 40
    before, after = offline_run(Path(args.out_dir), args.steps)

    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "learning_signal.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["group", "margin_before", "margin_after"])
        writer.writerows([g, round(float(b), 4), round(float(a), 4)] for g, (b, a) in enumerate(zip(before, after)))
    results_md.write(RESULTS / "learning_signal.csv", **TABLES["learning_signal"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(before, after, s=12)
    lo, hi = min(before.min(), after.min()), max(before.max(), after.max())
    ax.plot([lo, hi], [lo, hi], ":", color="gray", label="no change")
    ax.axhline(0, color="gray", lw=0.5)
    ax.axvline(0, color="gray", lw=0.5)
    ax.set_xlabel("margin at the seed weights (nats)")
    ax.set_ylabel(f"margin after {args.steps} GRPO steps (nats)")
    ax.set_title(f"{len(before)} held-out groups: mean margin {before.mean():+.1f} -> {after.mean():+.1f} nats\n"
                 f"(median {np.median(before):+.1f} -> {np.median(after):+.1f})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "learning_signal.png", dpi=110)
    print(f"held-out groups: {len(before)}; margin = mean log p(reward 1) - mean log p(reward 0), summed over tokens")
    for name, m in (("before", before), ("after", after)):
        print(f"{name:6s}: mean {m.mean():+.2f} nats, median {np.median(m):+.2f}, groups with margin > 0: {(m > 0).mean():.0%}")
    print(f"rise of the mean: {after.mean() - before.mean():+.2f} nats; groups whose margin rose: {(after > before).mean():.0%}")


if __name__ == "__main__":
    main()
