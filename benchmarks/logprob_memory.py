"""Peak memory per rank and time of the log-prob computation (final norm + output layer + log-probs).

Each (variant, pass) runs in a fresh torchrun job of --tp ranks, so one variant's peak cannot
leak into the next. The output layer is vocab-parallel exactly as torchtitan's llama3 apply_tp
with loss_parallel shards it; the hidden states are this rank's sequence shard [B, T/TP, D], as
the trunk hands them over under sequence parallelism.

Simplifications:
1. Only the head is modelled (RMSNorm + Linear D -> V); the trunk's memory is not part of the figure.
2. Random weights, hidden states and labels (no IGNORE_INDEX); only shapes matter for memory.
3. The policy loss is a GRPO-like advantage-weighted sum of log-probs, -(A * logprobs).mean(),
   minus --entropy-bonus times the mean entropy when that is set.
4. The .grad buffers of the weights and of the hidden states already exist when a policy pass
   starts (made by the warm-up, zeroed in place), as in a step that holds them; growth counts
   the transients only.

A measurement that runs out of memory (or fails otherwise, or runs past its time) is recorded
with that status instead of numbers, and the run goes on to the next one.

Usage: python benchmarks/logprob_memory.py [--sweep-seq | --sweep-chunk] [--help]; see benchmarks/README.md.
"""

import argparse
import csv
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import results_md
from harness import Memory
from job_status import OK, OOM, OOM_EXIT, SIMULATE_ENV, SKIPPED, TIMEOUT, classify, fake_oom, read_reports, run_job, \
    simulated_oom, write_report

GiB = 2**30


@dataclass(frozen=True)
class Variant:
    gather: bool  # full_tensor() the vocab-sharded logits, then plain log-probs
    chunked: bool
    compiled: bool
    # policy: plugin.scoring.logprobs.fused_chunked_loss, each chunk's backward run in forward; reference: blocked_logprobs
    fused: bool = False
    # TP=1: Liger-Kernel's LigerFusedLinearGRPOLoss (policy) or the reference log-probs it computes (optional, see
    # benchmarks/README.md)
    liger: bool = False


VARIANTS = {
    "gather": Variant(gather=True, chunked=False, compiled=False),
    "gather_compiled": Variant(gather=True, chunked=False, compiled=True),
    "loss_parallel": Variant(gather=False, chunked=False, compiled=False),
    "loss_parallel_compiled": Variant(gather=False, chunked=False, compiled=True),
    "chunked": Variant(gather=False, chunked=True, compiled=False),
    "chunked_compiled": Variant(gather=False, chunked=True, compiled=True),
    "fused": Variant(gather=False, chunked=True, compiled=False, fused=True),
    "fused_compiled": Variant(gather=False, chunked=True, compiled=True, fused=True),
    "liger": Variant(gather=False, chunked=True, compiled=True, liger=True),
}
DEFAULT_VARIANTS = "gather,loss_parallel,loss_parallel_compiled,chunked,chunked_compiled,fused,fused_compiled"
PASSES = ("reference", "policy")

# (batch, seq, vocab, dim, tp, dtype, chunk, repeats) per device kind; the GPU one is the
# originating PR's shape (batch 4, 1024 prompt + 8192 response, Qwen vocab)
DEFAULTS = {
    "cpu": dict(batch=2, seq=2048, vocab=32000, dim=256, tp=2, dtype="bfloat16", chunk=1024, repeats=3),
    "cuda": dict(batch=4, seq=9216, vocab=151936, dim=1024, tp=2, dtype="bfloat16", chunk=1024, repeats=5),
}
SWEEP_SEQS = (1024, 2048, 4096, 8192)
SWEEP_CHUNKS = (64, 128, 256, 512, 1024)

# Every allocation >= 1 MiB gets its own mmap and goes back to the kernel when freed, so RSS
# follows the live tensors. glibc's default raises this threshold after each free (up to 32 MiB)
# and then serves chunk-sized buffers from a heap it keeps: RSS shows the heap's high-water mark
# and fragmentation instead (chunked_compiled reference at chunk 64: 27 MiB instead of 4).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int, help="global sequence length T")
    p.add_argument("--vocab", type=int)
    p.add_argument("--dim", type=int, help="hidden size D")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (ranks)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="weights, hidden states and logits")
    p.add_argument("--chunk", type=int, help="chunk_size of the chunked variants, global positions")
    p.add_argument("--repeats", type=int, help="measured passes per (variant, pass); time is their median")
    p.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)}; default: {DEFAULT_VARIANTS} "
                   "(--sweep-seq: loss_parallel,chunked; --sweep-chunk: chunked,chunked_compiled)")
    p.add_argument("--passes", default=",".join(PASSES))
    p.add_argument("--vocab-block", type=int, default=0,
                   help="fused variants: output-layer rows per block (0: plugin.scoring.logprobs.VOCAB_BLOCK)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--entropy-bonus", type=float, default=0.0,
                   help="policy loss subtracts this times the mean entropy, with entropy_grad=True")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--sweep-seq", action="store_true",
                   help=f"peak growth for T in {SWEEP_SEQS} (batch 1 unless --batch) instead of the variant table")
    p.add_argument("--seqs", default=",".join(map(str, SWEEP_SEQS)), help="T values of --sweep-seq")
    p.add_argument("--sweep-chunk", action="store_true", help="peak growth and time of the chunked variants per chunk size")
    p.add_argument("--chunks", default=",".join(map(str, SWEEP_CHUNKS)), help="chunk sizes of --sweep-chunk")
    p.add_argument("--default-malloc", action="store_true",
                   help="CPU: keep glibc's dynamic mmap threshold (freed buffers may stay resident)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds for the whole run (0: no limit); measurements left when it is spent are "
                        "recorded as skipped, one still running as timeout")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # set by the launcher
    # for tests: VARIANT[:PASS][:kill],... fails that job's pass as an OOM would
    p.add_argument("--simulate-oom", default=os.environ.get(SIMULATE_ENV), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sweep_seq and args.sweep_chunk:
        p.error("--sweep-seq and --sweep-chunk are exclusive")
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, 1 if (k == "batch" and args.sweep_seq) else v)
    if args.variants is None:
        args.variants = ("loss_parallel,chunked" if args.sweep_seq else
                         "chunked,chunked_compiled" if args.sweep_chunk else DEFAULT_VARIANTS)
    args.variant_list = args.variants.split(",")
    args.pass_list = args.passes.split(",")
    for v in args.variant_list:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for s in args.pass_list:
        if s not in PASSES:
            p.error(f"unknown pass {s!r}; choose from {', '.join(PASSES)}")
    return args


def build_head(args, mesh, device):
    """torchtitan llama3's final norm + output layer, tensor-parallel as apply_tp does with loss_parallel."""
    import torch.nn as nn
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(args.dim, eps=1e-5)
            self.output = nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, h):
            return self.output(self.norm(h))

    torch.manual_seed(0)  # same full weights on every rank; each keeps its shard
    head = Head().to(device=device, dtype=getattr(torch, args.dtype))
    torch.nn.init.normal_(head.output.weight, std=args.dim**-0.5)
    if mesh is None:  # Liger takes plain weights
        return head
    return parallelize_module(head, mesh, {
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })


def worker(args) -> None:
    """One rank of one (variant, pass) measurement; rank 0 writes the JSON result."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from plugin.model.parallelize import tag_compile_caches
    from plugin.scoring.logprobs import VOCAB_BLOCK, Scoring, blocked_logprobs, chunked_logprobs, fused_chunked_loss

    import plugin.scoring.logprobs

    variant, pass_ = VARIANTS[args.variant_list[0]], args.pass_list[0]
    # a compiled variant compiles its vocab-sharded log-probs as the figures since 2026-12-03 did: the shapes here do
    # not vary, where that compile works; the plugin's own runs score those eagerly (plugin.scoring.logprobs)
    plugin.scoring.logprobs.COMPILE_SHARDED_LOGITS = variant.compiled
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU; gloo lets them share it
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    mesh = init_device_mesh(device.type, (world,))
    if variant.compiled:
        # cache keys shared by the TP ranks silently mix their vocab ranges (notes item 6)
        tag_compile_caches(rank)

    B, T, tp, dtype = args.batch, args.seq, world, getattr(torch, args.dtype)
    if T % tp:
        raise ValueError(f"--seq {T} must be divisible by --tp {tp}")
    if variant.liger and tp > 1:
        raise ValueError("liger: Liger-Kernel's GRPO loss takes a plain weight, so TP=1 only (--tp 1)")
    head = build_head(args, None if variant.liger else mesh, device)
    policy = pass_ == "policy"
    torch.manual_seed(1 + rank)
    hidden = torch.randn(B, T // tp, args.dim, device=device, dtype=dtype, requires_grad=policy)  # [B, T/TP, D]
    torch.manual_seed(2)
    labels = torch.randint(0, args.vocab, (B, T), device=device)  # [B, T], replicated
    advantages = torch.randn(B, 1, device=device)
    chunk = args.chunk if variant.chunked else 0
    score_head = (lambda h: head(h).full_tensor()) if variant.gather else head

    fake = simulated_oom(args.simulate_oom, args.variant_list[0], pass_) if rank == world - 1 else None

    def run():
        if fake:
            fake_oom(fake, f"{args.variant_list[0]}/{pass_}")
        # loss_parallel's backward must run inside the context too
        if variant.liger and not policy:
            from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

            # Liger's reference log-probs, as its GRPO loss computes them with use_ref_model: one
            # sequence a chunk (its chunk_size=1), under no_grad
            with torch.no_grad():
                x = head.norm(hidden)
                return torch.cat([LigerFusedLinearPPOBase.chunk_forward(x[b : b + 1], head.output.weight,
                                                                        labels[b : b + 1], temperature=args.temperature)
                                  for b in range(B)])
        if variant.liger:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            # on-policy, beta = 0, token mean ("bnpo"): the same -(A * logprobs).mean() at ratio 1
            liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo",
                                             temperature=args.temperature, chunk_size=1)
            loss, _ = liger(head.norm(hidden), head.output.weight, labels, torch.ones_like(labels),
                            advantages.view(-1))
            loss.backward()
            return torch.zeros(B, T)  # Liger returns no log-probs: no diff column
        with nullcontext() if variant.gather else loss_parallel(), torch.set_grad_enabled(policy):
            scoring = Scoring(temperature=args.temperature, chunk_size=chunk, seq_shards=tp, compiled=variant.compiled,
                              with_entropy=policy, entropy_grad=policy and args.entropy_bonus > 0,
                              vocab_block=args.vocab_block or VOCAB_BLOCK)
            if variant.fused and policy:
                # the same loss, per token: -(A * logprob) / (B * T), minus the bonus's share of the mean entropy
                adv_tokens = advantages.expand(B, T).reshape(-1)

                def token_loss(lp, ent, index):
                    loss = -(adv_tokens[index] * lp).sum() / (B * T)
                    return loss - args.entropy_bonus * ent.sum() / (B * T) if args.entropy_bonus > 0 else loss

                loss, logprobs, _ = fused_chunked_loss(hidden, labels, head.norm, head.output.weight, token_loss, scoring)
                loss.backward()
                return logprobs
            if variant.fused:  # the reference's pass in the same vocab blocks, as plugin.model.policy's
                logprobs, _ = blocked_logprobs(hidden, labels, head.norm, head.output.weight, scoring)
                return logprobs
            # the reference pass computes no entropy, as plugin.model.reference's
            logprobs, entropy = chunked_logprobs(hidden, labels, score_head, scoring)
            if policy:
                loss = -(advantages * logprobs).mean()
                if args.entropy_bonus > 0:
                    loss = loss - args.entropy_bonus * entropy.mean()
                loss.backward()
        return logprobs.detach()

    memory = Memory(device)
    logprobs = run()  # warm-up: compiles, and creates the .grad buffers
    for p in [hidden, *head.parameters()]:
        if p.grad is not None:
            p.grad.zero_()
    befores, peaks, times, cpu_times = [], [], [], []
    for _ in range(args.repeats):
        del logprobs
        gc.collect()
        dist.barrier()
        befores.append(memory.reset())
        start, cpu_start = time.perf_counter(), time.process_time()
        logprobs = run()
        peaks.append(memory.peak())  # synchronizes on CUDA
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        for p in [hidden, *head.parameters()]:
            if p.grad is not None:
                p.grad.zero_()

    mine = dict(
        before=max(befores), peak=max(peaks),
        growth=max(p - b for p, b in zip(peaks, befores)), time=statistics.median(times),
        # this process's CPU seconds: unlike wall time, barely moved by other jobs on the cores
        cpu_time=statistics.median(cpu_times),
    )
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        result = {k: max(r[k] for r in ranks) for k in mine}  # the worst rank
        torch.save(logprobs.float().cpu(), args.worker + ".logprobs.pt")
        Path(args.worker).write_text(json.dumps(dict(result, backend=backend)))
    # no rank tears gloo down while a peer is still in a collective
    dist.barrier()
    dist.destroy_process_group()


def worker_main(args) -> None:
    """A rank that fails writes its report next to the result; one out of memory exits with OOM_EXIT."""
    try:
        worker(args)
    except BaseException as e:
        if write_report(f"{args.worker}.rank{os.environ.get('RANK', 0)}", e):
            print(f"rank {os.environ.get('RANK', 0)}: out of memory: {e}", file=sys.stderr, flush=True)
            os._exit(OOM_EXIT)  # a clean exit could hang in the process group's teardown
        raise


def measure(args, variant: str, pass_: str, seq: int, chunk: int, workdir: Path, time_left: float | None) -> dict:
    """Run one (variant, pass) at sequence length `seq` in a fresh torchrun job; its result row.

    `time_left`: seconds of --time-budget left (None: no budget). A job that fails has its status
    and a detail in the row, and no figures.
    """
    result = workdir / f"{variant}_{pass_}_{seq}_{chunk}.json"
    # this rank's vocab shard of the logits in bf16: B * T * ceil(V / TP) * 2 bytes
    shard = args.batch * seq * -(-args.vocab // args.tp) * 2
    v = VARIANTS[variant]
    row = dict(
        variant=variant, pass_=pass_, status=OK, device=args.device, backend="", batch=args.batch, seq=seq,
        vocab=args.vocab, dim=args.dim, tp=args.tp, dtype=args.dtype, chunk=chunk if v.chunked else 0,
        compiled=v.compiled, entropy_bonus=args.entropy_bonus, repeats=args.repeats,
        before_gib="", peak_gib="", growth_gib="", logits_shard_gib=shard / GiB, growth_vs_shard="", time_s="",
        cpu_s="", wall_s=0.0, logprobs="", detail="",
    )
    label = f"  {variant:22s} {pass_:9s} T={seq:<5d} chunk={row['chunk']:<5d}"
    if time_left is not None and time_left <= 0:
        print(f"{label} skipped: --time-budget spent", file=sys.stderr, flush=True)
        return dict(row, status=SKIPPED, detail="--time-budget spent")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}",
        __file__, "--worker", str(result), "--device", args.device,
        "--batch", str(args.batch), "--seq", str(seq), "--vocab", str(args.vocab), "--dim", str(args.dim),
        "--tp", str(args.tp), "--dtype", args.dtype, "--chunk", str(chunk),
        "--repeats", str(args.repeats), "--variants", variant, "--passes", pass_,
        "--temperature", str(args.temperature), "--entropy-bonus", str(args.entropy_bonus),
        "--vocab-block", str(args.vocab_block),
    ]
    if args.simulate_oom:
        cmd += ["--simulate-oom", args.simulate_oom]
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    # the ranks share the cores; oversubscribed OpenMP threads would make the timings noise
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.tp)))
    if args.device == "cpu" and not args.default_malloc:
        env.update(MALLOC_ENV)
    start = time.perf_counter()
    timeout = args.timeout if time_left is None else min(args.timeout, time_left)
    returncode, output = run_job(cmd, env=env, timeout=timeout)
    reports = read_reports(f"{result}.rank{r}" for r in range(args.tp))
    status, detail = classify(returncode, output, reports)
    if status == TIMEOUT:
        detail = f"ran past {timeout:.0f} s"
    if status == OK and not result.exists():
        status, detail = "error: no result written", "no result written"
    elif status.startswith("error") and not reports and result.exists():
        # every rank's figures were gathered and written before the failure: a crash in the process
        # group's teardown (gloo has aborted there, rarely, on a loaded 2-core machine) loses nothing
        detail = f"the job failed after writing its result ({detail}); figures kept"
        print(f"{label} {detail}", file=sys.stderr, flush=True)
        status = OK
    row["wall_s"] = time.perf_counter() - start
    if status != OK:
        if status != OOM:  # an OOM is a result; anything else needs its log to be understood
            sys.stderr.write(output[-8000:])
        print(f"{label} {status}{f' ({detail})' if status == OOM and detail else ''}  [{row['wall_s']:.0f} s]",
              file=sys.stderr, flush=True)
        return dict(row, status=status, detail=detail)
    r = json.loads(result.read_text())
    row.update(
        backend=r["backend"], before_gib=r["before"] / GiB, peak_gib=r["peak"] / GiB, growth_gib=r["growth"] / GiB,
        growth_vs_shard=r["growth"] / shard, time_s=r["time"], cpu_s=r["cpu_time"],
        logprobs=str(result) + ".logprobs.pt", detail=detail,
    )
    print(f"{label} growth {row['growth_gib'] * 1024:7.1f} MiB"
          f" ({row['growth_vs_shard']:7.1%} of shard)  time {row['time_s']:.2f} s  cpu {row['cpu_s']:.2f} s"
          f"  [{row['wall_s']:.0f} s]", file=sys.stderr, flush=True)
    return row


def add_diffs(rows: list[dict]) -> None:
    """max |logprobs - gather's logprobs| for the same pass and T, where both ran."""
    ref = {(r["pass_"], r["seq"]): torch.load(r["logprobs"])
           for r in rows if r["variant"] == "gather" and r["status"] == OK}
    for r in rows:
        base = ref.get((r["pass_"], r["seq"]))
        # Liger's policy pass returns no log-probs
        ok = base is not None and r["status"] == OK and (r["variant"] != "liger" or r["pass_"] == "reference")
        r["max_abs_diff_vs_gather"] = (torch.load(r["logprobs"]) - base).abs().max().item() if ok else ""


COLUMNS = [
    "variant", "pass_", "status", "device", "backend", "batch", "seq", "vocab", "dim", "tp", "dtype", "chunk",
    "compiled",
    "entropy_bonus", "repeats", "before_gib", "peak_gib", "growth_gib", "logits_shard_gib", "growth_vs_shard", "time_s", "cpu_s",
    "max_abs_diff_vs_gather", "wall_s", "detail",
]


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([c.rstrip("_") for c in COLUMNS])
        for r in rows:
            w.writerow([f"{r[c]:.6g}" if isinstance(r[c], float) else r[c] for c in COLUMNS])


def table_rows(rows: list[dict]) -> list[dict]:
    """The CSV's rows as the short table's: growth in MiB and as a share of the logits shard."""
    # growth_vs_shard is a ratio; OOM and other failed rows have no figures
    return [{
        "variant": r["variant"], "pass": r["pass"], "status": r.get("status", "ok"), "T": r["seq"], "V": r["vocab"],
        "TP": r["tp"], "chunk": r["chunk"], "growth (MiB)": results_md.mib(r["growth_gib"]),
        "growth / logits shard": results_md.share(r["growth_vs_shard"]),
        "CPU s": f"{float(r['cpu_s']):.2f}" if r["cpu_s"] else "",
        "max abs diff vs gather": r["max_abs_diff_vs_gather"],
    } for r in rows]


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"logprob_memory": dict(script="logprob_memory.py", pick=table_rows)}


def markdown(rows: list[dict], args) -> str:
    """A Markdown table of every figure, one row per measurement (printed; `table_rows` is the short one)."""
    swept = ["T"] if args.sweep_seq else ["chunk"] if args.sweep_chunk else []
    lines = [
        f"{args.device}, B={args.batch}, " + ("" if args.sweep_seq else f"T={args.seq}, ")
        + f"V={args.vocab}, D={args.dim}, TP={args.tp}, {args.dtype}, "
        + ("" if args.sweep_chunk else f"chunk={args.chunk}, ") + f"{args.repeats} repeats; "
        + ("" if args.sweep_seq else f"local bf16 logits shard B*T*V/TP*2 = {rows[0]['logits_shard_gib'] * 1024:.0f} MiB"),
        "",
        "| " + " | ".join(swept + ["variant", "pass", "peak/rank (GiB)", "growth (MiB)", "growth / logits shard",
                                  "time (s)", "CPU time (s)", "max abs diff vs gather"]) + " |",
        "|" + "---:|" * len(swept) + "---|---|" + "---:|" * 6,
    ]
    failed = []
    for r in rows:
        diff = r["max_abs_diff_vs_gather"]
        cells = [str(r["x"])] if swept else []
        cells += [r["variant"], r["pass_"]]
        if r["status"] == OK:
            cells += [f"{r['peak_gib']:.2f}", f"{r['growth_gib'] * 1024:.1f}", f"{r['growth_vs_shard']:.1%}",
                      f"{r['time_s']:.2f}", f"{r['cpu_s']:.2f}", "" if diff == "" else f"{diff:.1e}"]
        else:
            # the figures' cells say why there are none; the details follow the table
            cells += [r["status"].split(":")[0]] + ["–"] * 5
            if r["detail"]:
                where = f" at {swept[0]}={r['x']}" if swept else ""
                failed.append(f"- {r['variant']} / {r['pass_']}{where}: {r['status'].split(':')[0]}: {r['detail']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + failed if failed else []))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_variants(rows: list[dict], path: Path, args) -> None:
    """Grouped bars per variant, reference vs policy: growth and time."""
    plt = _pyplot()
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["variant"], r["pass_"]): r for r in rows}

    def ok(v, pass_):
        return (v, pass_) in by and by[v, pass_]["status"] == OK

    # on CPU other jobs on the same cores inflate wall time; the process's CPU time does not move
    time_key = "cpu_s" if args.device == "cpu" else "time_s"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(args.pass_list)
    for i, pass_ in enumerate(args.pass_list):
        xs = [j + (i - (len(args.pass_list) - 1) / 2) * width for j in range(len(variants))]
        for ax, key in zip(axes, ("growth_gib", time_key)):
            ax.bar(xs, [by[v, pass_][key] if ok(v, pass_) else 0 for v in variants], width, label=pass_)
            for x, v in zip(xs, variants):
                if (v, pass_) in by and not ok(v, pass_):  # no bar: say why
                    ax.text(x, 0, by[v, pass_]["status"].split(":")[0], rotation=90, ha="center", va="bottom",
                            fontsize=8, color="red")
    axes[0].axhline(rows[0]["logits_shard_gib"], color="gray", ls="--", lw=1, label="bf16 logits shard")
    axes[0].set_ylabel("peak growth per rank (GiB)")
    axes[1].set_ylabel(f"median {'CPU ' if time_key == 'cpu_s' else ''}time per pass (s)")
    for ax in axes:
        ax.set_xticks(range(len(variants)), variants, rotation=20, ha="right")
        ax.legend()
    fig.suptitle(f"log-probs, {args.device}: B={args.batch} T={args.seq} V={args.vocab} D={args.dim} "
                 f"TP={args.tp} {args.dtype} chunk={args.chunk}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_sweep(rows: list[dict], path: Path, args) -> None:
    """Growth and time against the swept T or chunk size, one line per (variant, pass)."""
    plt = _pyplot()
    x_key = "seq" if args.sweep_seq else "chunk"
    time_key = "cpu_s" if args.device == "cpu" else "time_s"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key in dict.fromkeys((r["variant"], r["pass_"]) for r in rows):
        mine = [r for r in rows if (r["variant"], r["pass_"]) == key]
        pts = sorted((r["x"], r["growth_gib"] * 1024, r[time_key]) for r in mine if r["status"] == OK)
        failed = [f"{r['status'].split(':')[0]} at {r['x']}" for r in mine if r["status"] != OK]
        label = f"{key[0]} / {key[1]}" + (f" ({', '.join(failed)})" if failed else "")
        xs, growth, times = zip(*pts) if pts else ((), (), ())
        axes[0].plot(xs, growth, marker="o", label=label)
        axes[1].plot(xs, times, marker="o", label=label)
    pts = sorted({(r["x"], r["logits_shard_gib"] * 1024) for r in rows})
    axes[0].plot(*zip(*pts), color="gray", ls="--", label="bf16 logits shard")
    axes[0].set_ylabel("peak growth per rank (MiB)")
    axes[1].set_ylabel(f"median {'CPU ' if time_key == 'cpu_s' else ''}time per pass (s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T" if x_key == "seq" else "chunk size (positions)")
        ax.legend(fontsize=8)
    fixed = f"chunk={args.chunk}" if x_key == "seq" else f"T={args.seq}"
    fig.suptitle(f"log-probs, {args.device}: B={args.batch} V={args.vocab} D={args.dim} TP={args.tp} {args.dtype} {fixed}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int | None:
    args = parse_args()
    if args.worker:
        return worker_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep_seq:
        points, stem = [(int(t), args.chunk) for t in args.seqs.split(",")], "logprob_memory_seq"
    elif args.sweep_chunk:
        points, stem = [(args.seq, int(c)) for c in args.chunks.split(",")], "logprob_memory_chunk"
    else:
        points, stem = [(args.seq, args.chunk)], "logprob_memory"
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="logprob_memory_") as tmp:
        for seq, chunk in points:
            for variant in args.variant_list:
                for pass_ in args.pass_list:
                    left = args.time_budget - (time.perf_counter() - start) if args.time_budget > 0 else None
                    rows.append(measure(args, variant, pass_, seq, chunk, Path(tmp), left))
                    rows[-1]["x"] = seq if args.sweep_seq else chunk
        add_diffs(rows)
    write_csv(rows, out / f"{stem}.csv")
    results_md.write(out / f"{stem}.csv", **TABLES["logprob_memory"])
    (plot_sweep if args.sweep_seq or args.sweep_chunk else plot_variants)(rows, out / f"{stem}.png", args)
    print(markdown(rows, args))
    print(f"\nwrote {out / stem}.csv and .png in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    # an OOM, a timeout or a skip is a result; an error means the benchmark itself is broken
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
