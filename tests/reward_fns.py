"""Reward functions for tests/test_online.py, named as "reward_fns:<name>" (tests/ is on sys.path)."""

import math


def length(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]


def echo_columns(prompts, completions, completion_ids, **columns):
    """The row's `target` column: proves every extra column reaches the function."""
    return [float(t) for t in columns["target"]]


def raises_on_seven(prompts, completions, completion_ids, **columns):
    if any("7" in p for p in prompts):
        raise ZeroDivisionError("seven")
    return [0.0] * len(prompts)


def one_short(prompts, completions, completion_ids, **columns):
    return [0.0] * (len(prompts) - 1)


def nan_on_seven(prompts, completions, completion_ids, **columns):
    return [math.nan if "7" in p else 0.0 for p in prompts]


def none_on_seven(prompts, completions, completion_ids, **columns):
    return [None if "7" in p else 1.0 for p in prompts]


def even_ids(prompts, completions, completion_ids, **columns):
    """A graded reward that even a random policy's samples spread: the share of even token ids."""
    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]


def chat_reply_length(prompts, completions, completion_ids, **columns):
    """Conversational rows only, as TRL passes them: message-list prompts, completions as one assistant message."""
    for p, c in zip(prompts, completions):
        assert isinstance(p, list) and p[-1]["role"] == "user", p
        assert isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant", c
    return [float(len(c[0]["content"])) for c in completions]


def unit_on_even_target(prompts, completions, completion_ids, **columns):
    """1 for rows with an even `target`, 0.5 otherwise: a 0-to-1 reward with full marks on some rows."""
    return [1.0 if t % 2 == 0 else 0.5 for t in columns["target"]]
