"""Tools for multi-turn rollouts: functions named in `[online] tools`, their JSON schemas for the chat template,
the parsers of the tool calls in a model's reply, and one run of a whole batch's calls per job.

A tool is a plain Python function with a type hint on every parameter and a Google-style docstring, as TRL's
`tools=[...]` takes it: its schema is what transformers' `get_json_schema` builds from the same function.
A failed call never raises: the model gets `{"error": "..."}` as the tool's answer and can try again.

Simplifications:
1. Parameter types: int, float, str, bool, None, Any, list[...], dict[...], unions and Literal; no Enum, tuple
   or classes.
2. A sync tool that runs past the timeout is abandoned, not stopped: its thread (a daemon) runs on, out of sight.
"""

import asyncio
import importlib
import inspect
import json
import re
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Union, get_args, get_origin, get_type_hints

from plugin.data.rewards import run_once


@dataclass
class Tool:
    key: str  # e.g. '[online] tools[0] = "plugin.example:multiply"', for messages
    name: str  # the function's __name__, which the model calls it by
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    error: str | None = None  # why the call block is malformed; the model is told


@dataclass
class ToolResult:
    content: str  # the tool message's content: the result, or {"error": ...} as JSON
    failed: bool


# ---- schemas


_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
# the first paragraph(s), the Args: block and the Returns: block of a Google-style docstring
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(?:Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(?:Returns:|Raises:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(?:Raises:|\Z)", re.DOTALL)
# one "name (type): description" entry; a continuation line is indented deeper than its name
_ARG = re.compile(r"^([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:[ \t]*(.*(?:\n\1[ \t]+.*)*)", re.MULTILINE)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _enum(values: list) -> dict:
    names = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": names[0] if len(names) == 1 else names, "enum": values}


def type_schema(hint) -> dict:
    """The JSON schema of a type hint, as transformers writes it; ValueError for one JSON cannot express."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return {}
    if origin is None and hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint in (list, dict):
        return {"type": "array" if hint is list else "object"}
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:  # JSON keys are strings: only the values' type is said
        return {"type": "object", "additionalProperties": type_schema(args[1])} if args else {"type": "object"}
    if origin is Literal and args and all(type(a) in _SCALARS for a in args):
        return _enum(list(args))
    if origin is Union or origin is types.UnionType:
        subtypes = [type_schema(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:  # an `items` or an `enum` would be lost in a list of type names
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    raise ValueError(f"the type hint {hint!r} has no JSON schema here; a tool's parameters take int, float, str, "
                     "bool, None, Any, list[...], dict[...], unions of these and Literal[...]")


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """A tool's schema from its type hints and Google-style docstring (the `Args:` section describes each
    parameter), the schema transformers' get_json_schema writes; ValueError says what is missing.
    `name`: the tool's name, default `fn.__name__`."""
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError("the function has no docstring; a tool's docstring describes it and, under 'Args:', "
                         "each of its parameters")
    doc = doc.strip()
    description = _DESCRIPTION.search(doc)[1].strip()
    args_block = _ARGS.search(doc)
    described = {m[2]: re.sub(r"\s*\n+\s*", " ", m[3].strip())
                 for m in _ARG.finditer("\n".join(line for line in args_block[1].split("\n") if line.strip()))
                 } if args_block else {}
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # a hint naming something undefined
        raise ValueError(f"its type hints cannot be read: {type(e).__name__}: {e}") from e
    properties, required = {}, []
    for arg, param in inspect.signature(fn).parameters.items():
        if arg not in hints:
            raise ValueError(f"parameter '{arg}' has no type hint; the model is told each parameter's type")
        if arg not in described:
            raise ValueError(f"the docstring has no description of parameter '{arg}' under 'Args:' "
                             f"(a line '{arg}: what it is')")
        try:
            schema = type_schema(hints[arg])
        except ValueError as e:
            raise ValueError(f"parameter '{arg}': {e}") from None
        text = described[arg]
        if choices := _CHOICES.search(text):  # "(choices: [...])" at the end: an enum, as transformers reads it
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices[1])]
            text = text[: choices.start()].strip()
        properties[arg] = dict(schema, description=text)
        if param.default is inspect.Parameter.empty:
            required.append(arg)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name or fn.__name__, "description": description, "parameters": parameters}
    if "return" in hints:  # templates that dump the whole schema show it; one it cannot express is left out
        try:
            out["return"] = type_schema(hints["return"])
        except ValueError:
            pass
        else:
            if returns := _RETURNS.search(doc):
                out["return"]["description"] = returns[1].strip()
    return {"type": "function", "function": out}


def load_tools(specs: list[str]) -> list[Tool]:
    """Import every "module:function" and build its schema; a failure names the TOML key."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        key = f'[online] tools[{i}] = "{spec}"'
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"{key}: a tool is written 'module:function'")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ValueError(f"{key}: cannot import module '{module_name}': {type(e).__name__}: {e}") from e
        fn = getattr(module, attr, None)
        if not callable(fn):
            where = getattr(module, "__file__", module_name)
            what = "no function" if fn is None else f"a {type(fn).__name__}, not a function, named"
            raise ValueError(f"{key}: module '{module_name}' ({where}) has {what} '{attr}'")
        try:
            schema = function_schema(fn, getattr(fn, "__name__", attr))
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        name = schema["function"]["name"]
        if name in tools:  # the model calls a tool by name: two of one name are one too many
            raise ValueError(f"{key}: a second tool named '{name}', after {tools[name].key}")
        tools[name] = Tool(key, name, fn, schema)
    return list(tools.values())


# ---- parsing the model's calls


class ToolCallParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the reply without its call blocks, stripped: the assistant message's content; the calls in order)."""


def _json_call(body: str) -> ToolCall:
    """A call from the JSON object {"name": ..., "arguments": {...}}, or one that says why it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, f"the tool call is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return ToolCall(None, None, 'the tool call is not a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str):
        return ToolCall(None, None, "the tool call has no \"name\" string")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the call of '{name}' has no \"arguments\" object")
    return ToolCall(name, arguments)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, our chatml_tools.jinja);
    an unclosed block at the end is a malformed call, not text."""

    open, close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        kept, calls, pos = [], [], 0
        while (start := text.find(self.open, pos)) != -1:
            kept.append(text[pos:start])
            end = text.find(self.close, start)
            if end == -1:  # the reply hit its length limit mid-call, or the model forgot to close it
                calls.append(ToolCall(None, None, f"{self.open} without {self.close}"))
                pos = len(text)
                break
            calls.append(_json_call(text[start + len(self.open):end]))
            pos = end + len(self.close)
        kept.append(text[pos:])
        return "".join(kept).strip(), calls


# a call format's name (the TOML's value) -> its parser; a new format is one more class here
PARSERS: dict[str, type] = {"hermes": HermesParser}


# ---- messages


def tool_call_message(content: str, calls: list[ToolCall]) -> dict:
    """The assistant message of a reply with `calls`, in transformers' shape.

    A malformed call has no place in `tool_calls` (it has no name or no arguments to render) but still gets its
    error as a tool message, so after a reply with malformed calls more tool messages follow than `tool_calls`
    holds; a reply whose calls are all malformed has `tool_calls: []`. A reply without calls has no `tool_calls`.
    """
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls if c.error is None]
    return message


def tool_message(call: ToolCall, result: ToolResult) -> dict:
    return {"role": "tool", "name": call.name or "", "content": result.content}


# ---- running the calls


def _failed(message: str) -> ToolResult:
    return ToolResult(json.dumps({"error": message}, ensure_ascii=False), True)


def _succeeded(value) -> ToolResult:
    text = json.dumps(value, ensure_ascii=False, default=str) if isinstance(value, (dict, list)) else str(value)
    return ToolResult(text, False)


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _sync_call(fn: Callable, bound: inspect.BoundArguments, out: list) -> None:
    """Thread body: out[0] = the tool's result, or its failure."""
    try:
        value = fn(*bound.args, **bound.kwargs)
        if inspect.isawaitable(value):  # a sync function that hands back an awaitable: await it here
            async def wait():
                return await value
            value = asyncio.run(wait())
        out[0] = _succeeded(value)
    except Exception as e:
        out[0] = _failed(f"{type(e).__name__}: {e}")


def _run(tools: list[Tool], calls: list[ToolCall], timeout: float) -> list[ToolResult]:
    """Every call's result on this rank: sync tools each on a thread, async ones awaited together."""
    by_name = {t.name: t for t in tools}
    results: list[ToolResult | None] = [None] * len(calls)
    sync, coroutines = [], []
    for i, call in enumerate(calls):
        if call.error is not None:
            results[i] = _failed(call.error)
            continue
        if (tool := by_name.get(call.name)) is None:
            results[i] = _failed(f"unknown tool '{call.name}'; the tools are: {', '.join(by_name)}")
            continue
        try:
            bound = inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            results[i] = _failed(f"bad arguments for '{call.name}': {e}")
            continue
        if _is_async(tool.fn):
            coroutines.append((i, tool.fn, bound))
        else:
            # a daemon thread per call, not a ThreadPoolExecutor: its workers are joined at exit, so one hung
            # tool would keep the finished job from exiting
            out = [None]  # its own slot: an abandoned thread that finishes late must not touch `results`
            thread = threading.Thread(target=_sync_call, args=(tool.fn, bound, out), daemon=True,
                                      name=f"tool-{call.name}")
            thread.start()
            sync.append((i, thread, out))
    limit = timeout if timeout > 0 else None
    deadline = time.monotonic() + timeout
    if coroutines:  # the batch's async calls overlap their waits in one event loop, beside the sync threads
        async def one(fn, bound):
            try:
                return _succeeded(await asyncio.wait_for(fn(*bound.args, **bound.kwargs), limit))
            except asyncio.TimeoutError:
                return _failed(f"timed out after {timeout:g} s")
            except Exception as e:
                return _failed(f"{type(e).__name__}: {e}")

        async def gather():
            return await asyncio.gather(*(one(fn, bound) for _, fn, bound in coroutines))

        for (i, _, _), result in zip(coroutines, asyncio.run(gather())):
            results[i] = result
    for i, thread, out in sync:
        thread.join(max(0.0, deadline - time.monotonic()) if limit else None)
        # abandoned when still running: a thread cannot be stopped from outside
        results[i] = _failed(f"timed out after {timeout:g} s") if thread.is_alive() else out[0]
    return results


def run_tools(tools: list[Tool], calls: list[ToolCall], timeout: float, tp_group=None) -> list[ToolResult]:
    """The result of every call of a batch, each call run once in the job; never raises for a failed call.

    A tool with side effects (a sandbox, an API) must not run once per TP rank: TP rank k runs the k-th
    contiguous share of the calls (all TP peers hold the same calls), and the shares are gathered.
    `timeout`: seconds per call (0: no limit). `tp_group` None: one rank.
    """
    if tp_group is None:
        return _run(tools, calls, timeout)
    # a failure here is a bug, not a tool's: every peer still joins the gather, then raises
    parts = run_once(tp_group, len(calls), lambda mine: _run(tools, calls[mine], timeout), RuntimeError,
                     "running tool calls ")
    return [r for p in parts for r in p]
