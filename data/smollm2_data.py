"""Writes the SmolLM2 online example's prompt files: conversational sums, a train and a held-out split.

    python data/smollm2_data.py --out-dir data

Each row is {"prompt": [{"role": "user", "content": "What is 20 + 13? Reply with only the number."}],
"answer": 33} for a, b in 2..49 (plugin.example.sum_question). The split is by unordered pair, so
"a + b" and "b + a" fall on the same side: 128 pairs a < b (256 prompts) are held out, the other
2,048 prompts are for training, in a shuffled order. The package does not ship this script.
"""

import argparse
import json
import random
from pathlib import Path

from plugin.example import SUM_OPERANDS, sum_question

HELDOUT_PAIRS = 128


def split(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) ordered pairs; both orders of a held-out pair are held out."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in SUM_OPERANDS for b in SUM_OPERANDS if a < b]
    held = set(rng.sample(pairs, HELDOUT_PAIRS))
    heldout = sorted([p for p in held] + [(b, a) for a, b in held])
    train = [(a, b) for a in SUM_OPERANDS for b in SUM_OPERANDS if (min(a, b), max(a, b)) not in held]
    rng.shuffle(train)
    return train, heldout


def write(path: Path, pairs: list[tuple[int, int]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": sum_question(a, b), "answer": a + b}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, heldout = split(args.seed)
    out = Path(args.out_dir)
    write(out / "smollm2_sum_prompts.jsonl", train)
    write(out / "smollm2_sum_heldout.jsonl", heldout)
    print(f"{len(train)} train prompts, {len(heldout)} held-out prompts in {out}")


if __name__ == "__main__":
    main()
