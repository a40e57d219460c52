"""Writes the bundled example's files: rollouts, warm-up rollouts and prompts under data/, and the tokenizer.

The task itself (prompts, answers, the reward) is plugin.example; this script, which the package
does not ship, makes the files from it:

    python data/example_data.py rollouts --split train --out data/arith_rollouts.jsonl \\
        --groups 512 --group-size 4 --seed 0
    python data/example_data.py rollouts --split heldout --out data/arith_heldout.jsonl \\
        --groups 64 --group-size 4 --seed 1
    python data/example_data.py tokenizer --out plugin/assets/tokenizer
    python data/example_data.py warmup --out data/compare_warmup.jsonl --groups 1024 --seed 2
    python data/example_data.py prompts --split train --out data/compare_prompts.jsonl --count 4096
    python data/example_data.py prompts --split heldout --out data/compare_heldout.jsonl --count 256 --seed 3

Completions come from a noisy rule-based solver, not from a policy model.
"""

import argparse
import json
import random
from pathlib import Path

from plugin.example import (END, OPERAND_MAX, TOKENIZER_DIR, answer, completion_for, make_prompt, prompt_pool, reward)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
VOCAB_SIZE = 2048


def _sample_prompts(split: str, n_groups: int, rng: random.Random, compare: bool = False) -> list[str]:
    """`n_groups` distinct prompts of `split` (of the compare variant if `compare`), drawn with `rng`."""
    pool = prompt_pool(split, compare)
    if n_groups > len(pool):
        raise ValueError(f"{split} has only {len(pool)} prompts, asked for {n_groups}")
    return rng.sample(pool, n_groups)


def _wrong_number(correct: int, rng: random.Random) -> int:
    """A plausible mistake: a digit swap or an off-by-a-little answer."""
    digits = str(abs(correct))
    if rng.random() < 0.4 and len(digits) >= 2 and digits[0] != digits[1]:
        swapped = int(digits[1] + digits[0] + digits[2:])
        return -swapped if correct < 0 else swapped
    return correct + rng.choice([-10, -2, -1, 1, 2, 10])


def solve(prompt: str, rng: random.Random) -> str:
    """One completion from a noisy solver: right about half the time, sometimes malformed."""
    correct = answer(prompt)
    u = rng.random()
    if u < 0.5:
        return f" {correct}{END}"
    if u < 0.85:
        return f" {_wrong_number(correct, rng)}{END}"
    # Malformed: truncated before the end marker, or chatter after the number.
    if u < 0.93:
        return f" {correct}"
    return f" {correct} is the answer{END}"


def generate_rollouts(
    n_groups: int, group_size: int, seed: int, split: str = "train"
) -> list[dict]:
    """Rollout rows for `n_groups` distinct prompts of `split`, `group_size` completions each."""
    if group_size < 2:
        raise ValueError("group_size must be >= 2 so each group can mix rewards")
    rng = random.Random(seed)
    rows = []
    for group, prompt in enumerate(_sample_prompts(split, n_groups, rng)):
        # Resample until the group has a right and a wrong answer, else its advantages are all 0.
        while True:
            completions = [solve(prompt, rng) for _ in range(group_size)]
            rewards = [reward(prompt, c) for c in completions]
            if len(set(rewards)) >= 2:
                break
        rows.extend(
            {"prompt": prompt, "completion": c, "reward": r, "group": group}
            for c, r in zip(completions, rewards)
        )
    return rows


def warmup_rollouts(n_groups: int, seed: int) -> list[dict]:
    """Flat rollout rows for the online example's warm-up: per compare train prompt, its answer
    (reward 1) and a companion that stops at once (reward 0), as group `i`.

    Through the GRPO loss this is supervised fine-tuning on the answers. A group needs two rewards
    for a non-zero advantage (+-0.71 here). The companion, the EOS alone, comes with a behaviour
    log-prob of 0, so its ratio is the policy's p(EOS | prompt), below 1 - clip_low, where the
    clipped objective of a negative advantage is flat: it gets no gradient. A wrong answer as the
    companion would cancel the right one's gradient on every token the two share and push its own
    end marker down; with random wrong sums (operands spelled out) the policy lost the end marker.
    """
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json")).token_to_id(EOS_TOKEN)
    rows = []
    for group, prompt in enumerate(_sample_prompts("train", n_groups, random.Random(seed), compare=True)):
        rows.append({"prompt": prompt, "completion": completion_for(prompt), "reward": 1.0, "group": group})
        rows.append({"prompt": prompt, "completion_ids": [eos_id], "reward": 0.0, "group": group,
                     "logprobs": [0.0]})
    return rows


def prompt_rows(split: str, count: int | None, seed: int) -> list[dict]:
    """Compare prompts of `split` with their answers, for online sampling; the whole split if `count` is None."""
    pool = prompt_pool(split, compare=True)
    if count is not None and not 0 < count <= len(pool):
        raise ValueError(f"{split} has {len(pool)} prompts, asked for {count}")
    return [{"prompt": p, "answer": answer(p)} for p in random.Random(seed).sample(pool, count or len(pool))]


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


_WORDS = """
the of and to in is was that for it with as on be at by this had not are but from or have an
they which one you were her all she there would their we him been has when who will more no if
out so said what up its about into than them can only other new some could time these two may
then do first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come
since against go came right used take three small large number answer question sum difference
add subtract plus minus equals count check result model learn train reward group sample value
""".split()


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Training text for the tokenizer: arithmetic lines plus English-like sentences."""
    rng = random.Random(seed)
    lines = []
    for _ in range(40_000):
        a, b, op = rng.randint(0, OPERAND_MAX), rng.randint(0, OPERAND_MAX), rng.choice("+-")
        prompt = make_prompt(a, op, b)
        lines.append(f"{prompt} {answer(prompt)}{END}")
    # Larger numbers give the merges left over after the words a useful job.
    for _ in range(20_000):
        lines.append(f"{rng.randint(0, 9999)}, {rng.randint(0, 999)}.{END}")
    for _ in range(20_000):
        words = rng.choices(_WORDS, k=rng.randint(4, 14))
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice(".?!,;:") + END)
    return lines


def train_tokenizer(out_dir: str | Path) -> None:
    """Train the byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Byte-identical output for any RAYON_NUM_THREADS (checked 1, 2, 4, 16), so none is forced.
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    # torchtitan's HuggingFaceTokenizer reads bos/eos from here; BOS/EOS are added only on request.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python data/example_data.py", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rollouts = sub.add_parser("rollouts", help="write rollout JSONL")
    rollouts.add_argument("--out", required=True)
    # Required so a held-out file can never be written from the train split by default.
    rollouts.add_argument("--split", required=True, choices=["train", "heldout"])
    rollouts.add_argument("--groups", type=int, required=True)
    rollouts.add_argument("--group-size", type=int, required=True)
    rollouts.add_argument("--seed", type=int, required=True)
    tok = sub.add_parser("tokenizer", help="train and write the bundled tokenizer")
    tok.add_argument("--out", default=str(TOKENIZER_DIR))
    warmup = sub.add_parser("warmup", help="write the online example's warm-up rollouts (compare, train split)")
    warmup.add_argument("--out", required=True)
    warmup.add_argument("--groups", type=int, required=True)
    warmup.add_argument("--seed", type=int, required=True)
    prompts = sub.add_parser("prompts", help="write compare prompts with their answers, for online sampling")
    prompts.add_argument("--out", required=True)
    prompts.add_argument("--split", required=True, choices=["train", "heldout"])
    prompts.add_argument("--count", type=int, help="how many, drawn without replacement; default: the whole split")
    prompts.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "rollouts":
        write_jsonl(generate_rollouts(args.groups, args.group_size, args.seed, args.split), args.out)
    elif args.command == "warmup":
        write_jsonl(warmup_rollouts(args.groups, args.seed), args.out)
    elif args.command == "prompts":
        write_jsonl(prompt_rows(args.split, args.count, args.seed), args.out)
    else:
        train_tokenizer(args.out)


if __name__ == "__main__":
    main()
