"""Reward functions for tests/test_online.py, named as "reward_fns:<name>" (tests/ is on sys.path)."""

import asyncio
import json
import math
import os


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
def logged_length(prompts, completions, completion_ids, **columns):
    """`length`, appending each completion it scores to the file $REWARD_CALLS: a reward with a side effect."""
    with open(os.environ["REWARD_CALLS"], "a") as f:
        f.writelines(json.dumps(ids) + "\n" for ids in completion_ids)
    return length(prompts, completions, completion_ids)


def raises_on_rank_1(prompts, completions, completion_ids, **columns):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("sandbox unreachable")
    return [0.0] * len(prompts)


_started: list[str] = []


async def async_first(prompts, completions, completion_ids, **columns):
    """Returns only once async_second has started: it must be awaited together with it, not before it."""
    _started.clear()
    _started.append("first")
    for _ in range(200):
        if "second" in _started:
            return [1.0] * len(prompts)
        await asyncio.sleep(0.005)
    raise TimeoutError("async_second did not start while async_first waited")


async def async_second(prompts, completions, completion_ids, **columns):
    _started.append("second")
    await asyncio.sleep(0)
    return [2.0 * len(ids) for ids in completion_ids]


async def async_raises_on_seven(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(0)
    return raises_on_seven(prompts, completions, completion_ids)


def equal_on_even_target(prompts, completions, completion_ids, **columns):
    """The same reward for every completion of an even `target` prompt (a group with no advantage), else the length."""
    return [1.0 if t % 2 == 0 else float(len(ids)) for t, ids in zip(columns["target"], completion_ids)]


def constant(prompts, completions, completion_ids, **columns):
    return [1.0] * len(prompts)


def soft_overlong_copy(max_completion_len: int, soft_punish_cache: int):
    """A copy of TRL 1.16's trl.rewards.get_soft_overlong_punishment (trl/rewards/other_rewards.py): its signature,
    and DAPO's eq. 13 as TRL computes it, called as TRL calls it, fn(completion_ids, **kwargs)."""
    def soft_overlong_punishment_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif n <= max_completion_len:
                rewards.append((max_completion_len - soft_punish_cache - n) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment_reward


try:  # TRL's ready-made reward, used as it is: TRL is no dependency of this package
    from trl.rewards import get_soft_overlong_punishment
except ImportError:
    get_soft_overlong_punishment = soft_overlong_copy


# [online] max_new_tokens = 6 in tests/test_online_e2e.py: completions past 3 tokens are punished
soft_overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=3)
short_soft_overlong = get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)


def tool_like(x: int) -> int:
    """A tool for tests/test_online_e2e.py's start-up errors.

    Args:
        x: Any number.
    """
    return x


_generator_calls = 0


def dies_in_generator(prompts, completions, completion_ids, **columns):
    """even_ids, but a generator process (its environment names the trainer's pid) kills itself at its second batch:
    the trainer must stop with an error naming the generators (tests/test_async.py)."""
    global _generator_calls
    if os.environ.get("PLUGIN_TRAINER_PID"):
        _generator_calls += 1
        if _generator_calls == 2:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
    return even_ids(prompts, completions, completion_ids)
