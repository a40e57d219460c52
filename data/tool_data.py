"""Writes the SmolLM2 tool example's prompt files: products to work out with the multiply tool.

    python data/tool_data.py --out-dir data

Each row is {"prompt": plugin.example.product_question(a, b), "answer": a * b}: two worked exchanges
with the tool (312 * 47, 608 * 29), then "What is 523 * 86?". a is 3-digit, b 2-digit (81,000 pairs
less the worked ones); 128 pairs are held out and 2,048 others are for training, in a shuffled order.
smollm2_tool_bigger.jsonl asks 128 products of a 4-digit and a 3-digit number, a size never trained
on, to see whether the learnt tool use carries over. The package does not ship this script.
"""

import argparse
import json
import random
from pathlib import Path

from plugin.example import TOOL_FIRST, TOOL_SECOND, WORKED_EXAMPLES, product_question

TRAIN = 2048
HELDOUT = 128
BIGGER = 128


def split(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out, bigger) pairs; train and held-out are disjoint samples of the 3-digit x 2-digit pairs."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in TOOL_FIRST for b in TOOL_SECOND if (a, b) not in WORKED_EXAMPLES]
    picked = rng.sample(pairs, TRAIN + HELDOUT)
    train, heldout = picked[:TRAIN], sorted(picked[TRAIN:])
    bigger = sorted(rng.sample([(a, b) for a in range(1000, 10000) for b in range(100, 1000)], BIGGER))
    return train, heldout, bigger


def write(path: Path, pairs: list[tuple[int, int]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": product_question(a, b), "answer": a * b}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, heldout, bigger = split(args.seed)
    out = Path(args.out_dir)
    write(out / "smollm2_tool_prompts.jsonl", train)
    write(out / "smollm2_tool_heldout.jsonl", heldout)
    write(out / "smollm2_tool_bigger.jsonl", bigger)
    print(f"{len(train)} train, {len(heldout)} held-out, {len(bigger)} bigger-operand prompts in {out}")


if __name__ == "__main__":
    main()
