"""How far the policy pass's gradients are from fp64, in bf16: plain logits against the fused pass.

One process, CPU, one thread: B=2 x 1,024 tokens, D=256, V=151,936 (Qwen3's), bf16 hidden states,
norm and output weights. The loss is GRPO's shape on the log-probs, -sum(A * logprobs) / N with
random advantages A. The reference is the same computation in fp64 from the same bf16 inputs.
The error of a gradient is max |g - g_fp64| / max |g_fp64|.

Labels are drawn from the first --distinct ids, so an output row collects gradient from many
tokens and chunks, as the frequent tokens of real completions do; the logits' spread is set by
--weight-std.

Simplifications: a synthetic head (RMSNorm + bias-free Linear), not a trained model.

Time and memory: benchmarks/logprob_memory.py.

Usage: python benchmarks/fused_precision.py [--distinct 200] [--weight-std 0.05] [--out DIR]
"""

import argparse
import csv
import sys
from pathlib import Path
import results_md  # benchmarks/, the script's folder

import torch

# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"fused_precision": dict(script="fused_precision.py", pick=results_md.columns(
    "path", ("dh_error", "dL/dh error"), ("dw_error", "dL/dW error")))}


def main() -> None:
    # imported here, so that docs/generate.py can import TABLES without pytest and the tests' folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_fused import _grad_errors  # the test's computation, at the benchmark's shape

    from plugin.scoring.logprobs import Scoring

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--distinct", type=int, default=200, help="labels are drawn from ids [0, distinct)")
    p.add_argument("--weight-std", type=float, default=0.05, help="std of the output weight's entries")
    p.add_argument("--chunks", default="441,128", help="logprob_chunk_tokens values of the fused pass")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    N, V, D = args.tokens, args.vocab, args.dim
    hidden = torch.randn(2, N // 2, D, generator=g).bfloat16()
    weight = (args.weight_std * torch.randn(V, D, generator=g)).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16()
    labels = torch.randint(0, args.distinct, (2, N // 2), generator=g)
    adv = torch.randn(2, N // 2, generator=g)
    rows = []
    for name, scoring in [("plain bf16 logits", None)] + [
            (f"fused, {c} tokens a chunk", Scoring(chunk_tokens=int(c))) for c in args.chunks.split(",")]:
        dh, dw = _grad_errors(torch.bfloat16, hidden, labels, weight, norm_weight, adv, scoring)
        rows.append(dict(path=name, dh_error=f"{dh:.3e}", dw_error=f"{dw:.3e}"))
        print(f"{name:28s} dL/dh {dh:.2e}  dL/dW {dw:.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fused_precision_d{args.distinct}_w{args.weight_std}.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} and {results_md.write(path, **TABLES['fused_precision'])}")


if __name__ == "__main__":
    main()
