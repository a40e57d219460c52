"""Reward functions and reward models named in `[online] reward_funcs`, with TRL's signature, and their checked,
weighted sum.

A function is called once per sampled batch:

    fn(prompts, completions, completion_ids, **columns) -> list[float]

`prompts` and `completions` are text (a completion without its stop token), `completion_ids`
the sampled ids (with it), and every other column of the prompt rows arrives as a keyword list
of the same length. As in TRL, a conversational prompt (a list of {"role", "content"} messages)
arrives as that list and its completion as `[{"role": "assistant", "content": text}]`; with [online]
tools, as the trajectory's messages: assistant turns with `tool_calls`, tool messages, the final reply. As in TRL, a
function may return None for a completion it does not apply to; the reward is the weighted sum over
the functions that apply. An async function (one that returns an awaitable: a judge model or a
sandbox behind an API) is awaited together with the batch's other async ones, as TRL does, so their
waits overlap.

An entry that is a folder is a reward model (plugin.model.reward_model): it scores what TRL's reward models read,
on every rank of a TP group at once, before the functions run.
"""

import asyncio
import importlib
import inspect
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from plugin.data.prompts import Prompt


class RewardError(RuntimeError):
    """A reward function that failed, or returned something that is not one finite reward per completion."""


@dataclass
class RewardFn:
    key: str  # e.g. '[online] reward_funcs[0] = "plugin.example:arith_reward"', for messages
    name: str  # the function's name, for metric tags
    fn: Callable | None  # None for a reward model
    weight: float
    model: Any = None  # plugin.model.reward_model.RewardModel of a folder entry


def load_reward_fns(specs: list[str], weights: list[float], job_config=None) -> list[RewardFn]:
    """Import every "module:function", check every reward model (with `job_config`, whose job shares each one between
    training and evaluation); a failure names the TOML key and the module path."""
    fns = []
    for i, spec in enumerate(specs):
        key = f"[online] reward_funcs[{i}] = {spec!r}"
        if job_config is not None and Path(spec).is_dir():
            from plugin.job import GRPOJob

            model = GRPOJob.of(job_config).reward_model(spec, key, job_config)
            fns.append(RewardFn(key, Path(spec).resolve().name, None, weights[i] if weights else 1.0, model))
            continue
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ValueError(f"{key}: cannot import module '{module_name}': {type(e).__name__}: {e}") from e
        fn = getattr(module, attr, None)
        if not callable(fn):
            where = getattr(module, "__file__", module_name)
            raise ValueError(f"{key}: module '{module_name}' ({where}) has no function '{attr}'")
        fns.append(RewardFn(key, attr, fn, weights[i] if weights else 1.0))
    counts = Counter(f.name for f in fns)
    for i, f in enumerate(fns):  # metric tags must not collide
        if counts[f.name] > 1:
            f.name = f"{f.name}_{i}"
    return fns


def check_model_prompts(fns: list[RewardFn], prompts: list[Prompt], key: str) -> None:
    """Start-up: the reward models can read `prompts` (the file of TOML key `key`)."""
    for f in fns:
        if f.model is not None:
            f.model.check_prompts(prompts, key)


def score(fns: list[RewardFn], prompts: list[str], completions: list[str], completion_ids: list[list[int]],
          columns: dict[str, list], where: list[str], given: dict[int, list[float]] | None = None
          ) -> tuple[list[float], list[list[float]]]:
    """(weighted total per completion, each function's rewards with NaN where it returned None).

    `where[i]` is the file:line of completion i's prompt row, for errors; `given`: the rewards of the entries at
    those indices (the reward models'), not called here.
    """
    n = len(completions)
    per_fn = []
    given = given or {}
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    called = [f for i, f in enumerate(fns) if i not in given]
    results = iter(_call_all(called, kwargs))
    results = [given[i] if i in given else next(results) for i in range(len(fns))]
    for f, values in zip(fns, results):
        if isinstance(values, Exception):
            row = _first_failing_row(f, prompts, completions, completion_ids, columns)
            at = f"on the prompt at {where[row]}" if row is not None else f"on the batch of prompts at {_span(where)}"
            raise RewardError(f"{f.key} raised {at}: {type(values).__name__}: {values}") from values
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} rewards" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise RewardError(f"{f.key} returned {got} for {n} completions (prompts at {_span(where)}); "
                              "it must return one reward per completion")
        per_fn.append([math.nan if v is None else _reward(f, v, i, where[i]) for i, v in enumerate(values)])
    totals = []
    for i in range(n):
        applied = [(f.weight, r[i]) for f, r in zip(fns, per_fn) if not math.isnan(r[i])]
        if not applied:
            raise RewardError(f"every reward function returned None for completion {i} of the prompt at {where[i]}")
        totals.append(sum(w * r for w, r in applied))
    return totals, per_fn


def score_completions(fns: list[RewardFn], tp_group, tokenizer, stop_ids: list[int], prompts: list[Prompt],
                      completion_ids: list[list[int]], messages: list[list[dict]] | None = None
                      ) -> tuple[list[str], list[float], list[list[float]]]:
    """Sampled completions of `prompts` (one per completion) decoded and scored, as
    online batches and evaluations both do: (texts, weighted total per completion, each function's rewards).

    A text leaves out its stop token; TP peers (`tp_group`, holding the same completions) share the calls.
    `messages`: multi-turn completions as TRL's message lists (plugin.data.turns), which the functions then get.
    """
    texts = [tokenizer.decode(c[:-1] if c and c[-1] in stop_ids else c) for c in completion_ids]
    completions = messages if messages is not None else reward_completions(prompts, texts)
    # every rank scores with the reward models, one with no completions too: their forwards are collectives
    given = {i: f.model.rewards(prompts, completions, completion_ids, stop_ids)
             for i, f in enumerate(fns) if f.model is not None}
    if not prompts:  # an evaluation rank past the end of a short file; its TP peers are too
        return texts, [], [[] for _ in fns]
    columns = {k: [p.columns.get(k) for p in prompts] for k in dict.fromkeys(k for p in prompts for k in p.columns)}
    totals, per_fn = score_once(fns, tp_group, [p.text for p in prompts], completions, completion_ids, columns,
                                [p.where for p in prompts], given)
    return texts, totals, per_fn


def reward_completions(prompts: list[Prompt], texts: list[str]) -> list:
    """What reward functions get as completions, as in TRL: the text, or after a conversational prompt
    (a message list) the assistant's reply as a one-message list."""
    return [[{"role": "assistant", "content": t}] if isinstance(p.text, list) else t for p, t in zip(prompts, texts)]


def score_once(reward_fns, tp_group, prompts: list, completions: list, completion_ids: list[list[int]],
               columns: dict[str, list], where: list[str], given: dict[int, list[float]] | None = None
               ) -> tuple[list[float], list[list[float]]]:
    """`score`, each completion's rewards run once in the job.

    A reward with side effects (a sandbox, a judge, an API) must not run once per TP rank:
    TP rank k scores the k-th contiguous share of the completions, and the shares are gathered.
    A failure on any rank is raised on every rank, so none waits for the others. `tp_group` None: one rank.
    """
    given = given or {}
    if tp_group is None:
        return score(reward_fns, prompts, completions, completion_ids, columns, where, given)
    parts = run_once(tp_group, len(completions), lambda mine: score(
        reward_fns, prompts[mine], completions[mine], completion_ids[mine], {k: v[mine] for k, v in columns.items()},
        where[mine], {i: v[mine] for i, v in given.items()}), RewardError)
    totals = [v for p in parts for v in p[0]]
    per_fn = [[v for p in parts for v in p[1][k]] for k in range(len(reward_fns))]
    return totals, per_fn


def run_once(tp_group, n: int, work: Callable[[slice], Any], error: type[Exception], what: str = "") -> list:
    """`work` of this TP rank's contiguous share of `n` items, every peer's result in rank order: each item handled
    once in the job (TP peers hold the same items). A failure on any rank is raised on every rank, so none waits
    for the others' collective."""
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    part, failure = None, None
    try:
        part = work(slice(n * rank // tp, n * (rank + 1) // tp))
    except Exception as e:
        failure = e
    parts = [None] * tp
    dist.all_gather_object(parts, (part, failure and f"{type(failure).__name__}: {failure}"), group=tp_group)
    if failure is not None:
        raise failure
    for _, peer_error in parts:
        if peer_error is not None:
            raise error(f"{what}on a tensor-parallel peer: {peer_error}")
    return [p for p, _ in parts]


def _call_all(fns: list[RewardFn], kwargs: dict) -> list:
    """Each function's return value, or the exception it raised; the awaitables are awaited together."""
    results = []
    for f in fns:
        try:
            results.append(f.fn(**kwargs))
        except Exception as e:
            results.append(e)
    pending = [i for i, v in enumerate(results) if inspect.isawaitable(v)]
    if pending:
        async def gather():
            return await asyncio.gather(*(results[i] for i in pending), return_exceptions=True)

        for i, v in zip(pending, asyncio.run(gather())):
            results[i] = v
    return results


def _reward(f: RewardFn, v, i: int, where: str) -> float:
    """Completion i's reward from `f` as a float; anything but a finite number raises."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise RewardError(f"{f.key} returned {v!r} for completion {i} of the prompt at {where}; "
                          "a reward is a number (or None where the function does not apply)")
    if not math.isfinite(v := float(v)):
        raise RewardError(f"{f.key} returned {v} for completion {i} of the prompt at {where}; a reward must be finite")
    return v


def _first_failing_row(f: RewardFn, prompts, completions, completion_ids, columns) -> int | None:
    """The first completion on which the function raises when called on it alone (None: only the batch fails)."""
    for i in range(len(completions)):
        try:
            values = f.fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1],
                          completion_ids=completion_ids[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
            if inspect.isawaitable(values):
                asyncio.run(_awaited(values))
        except Exception:
            return i
    return None


async def _awaited(awaitable):
    return await awaitable


def _span(where: list[str]) -> str:
    return where[0] if len(set(where)) == 1 else f"{where[0]} .. {where[-1]}"
