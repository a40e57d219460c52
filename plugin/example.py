"""A bundled verifiable GRPO task (two-digit addition and subtraction), its compare variant, and the tokenizer.

Rollout rows are JSONL: {"prompt": "Q: 37+45=", "completion": " 82\\n", "reward": 1.0, "group": 0}.
All completions sampled for one prompt share `group`; the reward comes only from `reward()`.

The compare variant, the online example's task (train_configs/online_cpu.toml), writes one digit
per token: "Q: 3 7 max 4 5 =" -> " 4 5\\n", "Q: 3 7 min 4 5 =" -> " 3 7\\n". Its answer is a
copy chosen by a comparison, which the debugmodel learns within a minute on 2 CPU cores; the
digits of a sum (mod 10) it did not learn in five (see `warmup_rollouts`).

The bundled files under data/ and the tokenizer under plugin/assets/ are written by
data/example_data.py, which the package does not ship.

Simplifications:
1. Completions come from a noisy rule-based solver, not from a policy model.
2. Operands are 0..99 and the operator is + or -, so the prompt space has 20,000 prompts.
3. A prompt is held out iff crc32(prompt) % 8 == 0; the split is fixed, seeds only pick from it.
4. Compare prompts have two-digit operands 0..99 (zero-padded) and max or min: 20,000 prompts.
"""

import re
import zlib
from pathlib import Path

TOKENIZER_DIR = Path(__file__).parent / "assets" / "tokenizer"

END = "\n"
OPERAND_MAX = 99
HELDOUT_MODULUS = 8

COMPARE_OPS = ("max", "min")

_PROMPT_RE = re.compile(r"Q: (\d+)([+-])(\d+)=")
_COMPARE_RE = re.compile(r"Q: (\d) (\d) (max|min) (\d) (\d) =")


def make_prompt(a: int, op: str, b: int) -> str:
    """The prompt "a op b": "Q: 37+45=" for + and -, the compare variant's "Q: 3 7 max 4 5 =" for max and min."""
    return f"Q: {spell(a)} {op} {spell(b)} =" if op in COMPARE_OPS else f"Q: {a}{op}{b}="


def spell(n: int) -> str:
    """A compare operand or answer, two digits with a space between: spell(5) == "0 5"."""
    return " ".join(f"{n:02d}")


def answer(prompt: str) -> int:
    """The exact result of the prompt's expression."""
    if match := _PROMPT_RE.fullmatch(prompt):
        a, op, b = int(match[1]), match[2], int(match[3])
        return a + b if op == "+" else a - b
    if match := _COMPARE_RE.fullmatch(prompt):
        a, b = int(match[1] + match[2]), int(match[4] + match[5])
        return max(a, b) if match[3] == "max" else min(a, b)
    raise ValueError(f"not an arithmetic prompt: {prompt!r}")


def completion_for(prompt: str) -> str:
    """The one completion that scores 1.0: " 82\\n" for "Q: 37+45=", " 4 5\\n" for "Q: 3 7 max 4 5 =".

    Numbers are canonical: no leading zeros and no "-0" (compare answers are always two digits).
    """
    value = answer(prompt)
    return f" {spell(value) if _COMPARE_RE.fullmatch(prompt) else value}{END}"


def reward(prompt: str, completion: str) -> float:
    """1.0 iff the completion is exactly completion_for(prompt), else 0.0; a foreign prompt raises.

    Anything else scores 0.0: a wrong number, a missing or doubled end marker, extra or missing
    spaces, leading zeros, "-0", or any text before or after the number. No partial credit.
    Compare answers have exactly two digits, as the operands do: " 0 5\\n", not " 5\\n".
    """
    return 1.0 if completion == completion_for(prompt) else 0.0


def arith_reward(prompts: list[str], completions: list[str], completion_ids=None, **columns) -> list[float]:
    """reward() of each completion, with TRL's reward-function signature (completions are decoded text)."""
    # the prompt fixes the answer: a prompts file's "answer" column is for people and other tools
    return [reward(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]


def is_heldout(prompt: str) -> bool:
    """Whether a prompt belongs to the held-out split."""
    # crc32, unlike hash(), is the same in every process and on every platform.
    return zlib.crc32(prompt.encode()) % HELDOUT_MODULUS == 0


def prompt_pool(split: str, compare: bool = False) -> list[str]:
    """All prompts of one split, of the arithmetic task or its compare variant, in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    ops = COMPARE_OPS if compare else "+-"
    return [
        prompt
        for op in ops
        for a in range(OPERAND_MAX + 1)
        for b in range(OPERAND_MAX + 1)
        if is_heldout(prompt := make_prompt(a, op, b)) == want_heldout
    ]


# SmolLM2-135M-Instruct's example (train_configs/smollm2_online_cpu.toml): two-number sums asked
# through its chat template. Greedy, it gets about a quarter right and often shows its working
# ("20 + 13 = 33"), so a group mixes right and wrong replies from the first step. Only a right answer
# is paid: a format mark for a bare number, right or wrong, taught some runs that shortcut instead.
SUM_OPERANDS = range(2, 50)
_INTEGER = re.compile(r"-?\d+")
SMOLLM2_EOS = 2  # <|im_end|>, the end of an assistant turn and [online] stop_token_ids


def sum_question(a: int, b: int) -> list[dict]:
    """The conversational prompt for a + b (the chat template adds SmolLM2's default system message)."""
    return [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}]


def _reply(completion) -> str:
    """A completion's text: as given, or the assistant message's content after a conversational prompt."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def sum_correct(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float]:
    """1.0 iff the reply's last integer is the row's `answer` column, else 0.0 (working shown is allowed)."""
    rewards = []
    for completion, right in zip(completions, answer, strict=True):
        numbers = _INTEGER.findall(_reply(completion))
        rewards.append(1.0 if numbers and int(numbers[-1]) == int(right) else 0.0)
    return rewards


# SmolLM2-135M-Instruct with a calculator (train_configs/smollm2_tools_cpu.toml): the product of a
# 3-digit and a 2-digit number, which it cannot work out in its head, asked with a `multiply` tool
# (hermes format, plugin/assets/chat_templates/chatml_tools.jinja) after two worked exchanges. After
# one, the start weights write `<tool_response>` where the call should be (the exact call has
# P < 1e-4 a question); after two, P = 0.19, and at temperature 1 they called multiply right in 37 of
# 256 replies (14.5%), then reported its result in 36; greedy, they never call (benchmarks/tool_learning.py).
# Rewards read TRL's tool trajectory: completions[i] is [assistant (with "tool_calls"), tool, ...,
# assistant], the final answer last.
TOOL_FIRST = range(100, 1000)
TOOL_SECOND = range(10, 100)
WORKED_EXAMPLES = ((312, 47), (608, 29))  # shown in every prompt, never asked


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    # int(): a call with "312" for 312 gets the product, not Python's string repetition
    return int(a) * int(b)


def _worked(a: int, b: int) -> list[dict]:
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def product_question(a: int, b: int) -> list[dict]:
    """The conversational prompt for a * b: the worked exchanges with the tool, then the question."""
    return [*(m for x, y in WORKED_EXAMPLES for m in _worked(x, y)), {"role": "user", "content": f"What is {a} * {b}?"}]


def _trajectory(completion) -> list[dict]:
    """A completion as messages: a tool trajectory as given, a text completion as one assistant message."""
    return completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]


def _tool_results(messages: list[dict]) -> list[str]:
    return [m["content"].strip() for m in messages if m["role"] == "tool"]


def tool_correct(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float]:
    """1.0 iff the final assistant message follows a tool result, calls nothing itself, and its last integer is
    the row's `answer`; else 0.0.

    An answer given without a tool result does not pay, right or wrong: the task is to use the tool, and
    a lucky guess or a copied number would otherwise be reinforced like a tool call.
    """
    rewards = []
    for completion, right in zip(completions, answer, strict=True):
        messages = _trajectory(completion)
        final = messages[-1]
        numbers = _INTEGER.findall(final.get("content") or "")
        # "tool_calls" is there, possibly empty, whenever the reply tried a call (plugin.generation.tools)
        rewards.append(1.0 if final["role"] == "assistant" and "tool_calls" not in final and _tool_results(messages)
                       and numbers and int(numbers[-1]) == int(right) else 0.0)
    return rewards


def tool_call_right(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float]:
    """1.0 iff a tool result of the trajectory is the row's `answer` (multiply called on the question's numbers),
    whatever the final message says; else 0.0.

    A shaping term: a well-formed call on other numbers (the worked examples' 312 and 47) earns nothing.
    """
    return [1.0 if str(int(right)) in _tool_results(_trajectory(completion)) else 0.0
            for completion, right in zip(completions, answer, strict=True)]
