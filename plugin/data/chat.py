"""Conversational prompts: TRL's list of {"role", "content"} messages, rendered with the tokenizer's own Jinja
chat template (`chat_template` of tokenizer_config.json, or chat_template.jinja, or the file that
`[rollout_data] chat_template_path` names) exactly as transformers' `apply_chat_template(messages, tools=...,
add_generation_prompt=True)` renders it, without importing transformers.

transformers' renderer: an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loopcontrols,
a `tojson` filter that does not escape HTML, the globals raise_exception, strftime_now, dict and
namespace, and the named special tokens (bos_token, eos_token, ...) as variables; keys whose value is None
are dropped from the messages first, and `tools` and `documents` are always passed (None when absent).

Multi-turn tool trajectories (plugin.generation.tools) take transformers' message shapes: an assistant message
with `tool_calls` [{"type": "function", "function": {"name", "arguments"}}], then a `tool` message per call
(malformed calls, which `tool_calls` leaves out, get one too: plugin.generation.tools.tool_call_message).
Token ids of a trajectory are concatenated, never re-tokenized: `tool_suffix` gives the text the template adds
between a turn's stop token and the next generation, `trajectory_segments` cuts a whole trajectory into model
text and template text.

Simplifications:
1. No documents, {% generation %} masks or continue_final_message.
2. Of several named templates (a list in tokenizer_config.json) the one named "default" is used.
"""

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from plugin.data.rollouts import BadRow

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the variables its apply_chat_template adds
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore attributes, so a template cannot reach CPython internals."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the namespace attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=dict, namespace=_Namespace)
    return env


def _token(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict with its content."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class ChatTemplate:
    """The chat template of a tokenizer folder; `render` raises BadRow for a message list it cannot render."""

    def __init__(self, folder: str, source: str | None, special_tokens: dict[str, str], origin: str = ""):
        """`origin`: where the template comes from, for messages (default: the folder's template)."""
        self.folder, self.source, self.special_tokens = folder, source, special_tokens
        self.origin = origin or f"the chat template of {folder}"
        try:
            self._template = _environment().from_string(source) if source is not None else None
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"{self.origin}: line {e.lineno}: {e.message}") from None

    @classmethod
    def from_folder(cls, folder: str, template_path: str = "") -> "ChatTemplate":
        """chat_template.jinja if the folder has one (transformers' newer layout), else tokenizer_config.json's;
        `template_path` (`[rollout_data] chat_template_path`, TRL's chat_template_path), a .jinja file, replaces
        either: a template with tool support for a model whose own has none."""
        path = Path(folder)
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        origin = ""
        if template_path:
            key = f'[rollout_data] chat_template_path = "{template_path}"'
            if not Path(template_path).is_file():
                raise ValueError(f"{key}: no such file")
            source, origin = Path(template_path).read_text(encoding="utf-8"), f"the chat template in {key}"
        tokens = {k: t for k in SPECIAL_TOKENS if (t := _token(config.get(k))) is not None}
        return cls(folder, source, tokens, origin)

    def render(self, messages, name: str = "prompt", tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The text of `messages` (checked first), by default ending in the assistant's generation prompt;
        `tools`: the tools' JSON schemas, which a template with tool support shows the model."""
        check_messages(messages, name)
        return self._render(messages, name, tools, add_generation_prompt)

    def _render(self, messages: list[dict], name: str, tools, add_generation_prompt: bool) -> str:
        if self._template is None:
            raise BadRow(f"field '{name}' is a list of messages, which needs a chat template, and "
                         f"{self.folder} ([model] hf_assets_path) has none: no 'chat_template' in "
                         "tokenizer_config.json and no chat_template.jinja")
        # as transformers: a None value (OpenAI's content=None beside tool_calls) is a missing key to the template
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:  # raise_exception's message, e.g. an unknown role
            raise BadRow(f"field '{name}': {self.origin} raised: {e}") from None

    def check_tools(self, tools: list[dict], stop_text: str | None = None) -> None:
        """Start-up check that the template shows the model every tool and, given the model's `stop_text`, that a
        tool exchange renders appended to what came before; ValueError naming the key otherwise."""
        fix = ("set [rollout_data] chat_template_path to a template with tool support, e.g. "
               "plugin/assets/chat_templates/chatml_tools.jinja (ChatML, hermes tool calls)")
        probe = [{"role": "user", "content": "Which tools can you call?"}]
        try:
            plain, text = self._render(probe, "probe", None, True), self._render(probe, "probe", tools, True)
        except BadRow as e:
            raise ValueError(f"{self.origin} cannot render tools ({e}): {fix}") from None
        # counted against the render without tools: a name like "add" may be in the template's own text
        missing = [n for t in tools if text.count(n := t["function"]["name"]) <= plain.count(n)]
        if missing:
            raise ValueError(f"{self.origin} does not show the model its tools (no {', '.join(missing)} in a "
                             f"prompt rendered with them): {fix}")
        if stop_text is not None:
            name = tools[0]["function"]["name"]
            call = {"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}
            self.tool_suffix(probe + [call], [{"role": "tool", "name": name, "content": "42"}], tools, stop_text)

    def tool_suffix(self, conversation: list[dict], tool_messages: list[dict], tools: list[dict] | None,
                    stop_text: str) -> str:
        """The text that follows a turn that made tool calls and ended with the model's `stop_text`: the rest of
        that turn as the template writes it, the tool messages, and the next generation prompt.

        `conversation`: the prompt and every turn so far, the last the assistant message that made the calls.
        It is the difference of two renders, with and without `tool_messages`, so the template must be
        append-only (verl#6719: Qwen3's drops earlier turns' think blocks); ValueError otherwise.

        Its token ids are appended to the ids generated so far, never re-tokenized with them (trl#5224). They
        equal the ids of a full render's same text: the suffix starts right after the stop token, a special
        token, and a tokenizer splits its input at special tokens before anything else, so no token spans the
        cut (byte-level BPE, as SmolLM2 and Qwen have; a SentencePiece tokenizer that adds a leading space to
        every text would add one here too).
        """
        try:
            before = self._render(conversation, "conversation", tools, False)
            after = self._render(conversation + tool_messages, "conversation", tools, True)
        except BadRow as e:
            raise ValueError(str(e)) from None
        if not after.startswith(before):
            raise ValueError(f"{self.origin} is not append-only: adding the tool messages changes the text before "
                             f"them ({_first_difference(before, after)}), so the tokens generated so far no longer "
                             f"match the conversation (as Qwen3's drops earlier think blocks, verl#6719)")
        cut = before.rfind(stop_text)
        if cut == -1:
            raise ValueError(f"{self.origin} writes no {stop_text!r} (the model's stop text) after an assistant turn")
        return before[cut + len(stop_text):] + after[len(before):]

    def trajectory_segments(self, prompt_messages: list[dict], completion_messages: list[dict],
                            tools: list[dict] | None, stop_text: str) -> list[tuple[str, bool]]:
        """A multi-turn completion (assistant, its tool messages, assistant, ...) as consecutive (text, trained)
        pieces of the text after the prompt's generation prompt: each assistant turn up to and including its
        `stop_text` is trained; the template's text after it, the tool messages and the next generation prompt
        are not. Their concatenation is the render of the whole conversation after the rendered prompt, up to the
        last `stop_text`.

        The untrained pieces end with a generation prompt and the trained ones start after one, which is where
        the model's own tokens started at sampling, so each piece is tokenized on its own. BadRow names the
        message that breaks the shape.
        """
        check_messages(prompt_messages, "prompt")
        check_messages(completion_messages, "completion")
        turns = _turns(completion_messages)
        messages = prompt_messages + completion_messages
        n = len(prompt_messages)
        prev = self._render(prompt_messages, "prompt", tools, True)
        segments = []
        for i, end in turns:
            turn = self._render(messages[:n + i + 1], "completion", tools, False)
            if not turn.startswith(prev):
                raise BadRow(f"field 'completion[{i}]': {_not_append_only(self.origin, prev, turn)}")
            cut = turn.rfind(stop_text) + len(stop_text)
            if cut < len(prev) + len(stop_text):
                raise BadRow(f"field 'completion[{i}]': {self.origin} writes no {stop_text!r} (the model's stop "
                             "text) after this assistant turn")
            segments.append((turn[len(prev):cut], True))
            if end == i + 1:  # no tool messages: the last turn
                break
            prev = self._render(messages[:n + end], "completion", tools, True)
            if not prev.startswith(turn):
                raise BadRow(f"field 'completion[{i + 1}]': {_not_append_only(self.origin, turn, prev)}")
            segments.append((prev[cut:], False))
        return segments


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {i}: {a[i:i + 40]!r} became {b[i:i + 40]!r}"


def _not_append_only(origin: str, before: str, after: str) -> str:
    return (f"{origin} is not append-only: the next message changes the text before it "
            f"({_first_difference(before, after)}); as Qwen3's drops earlier think blocks (verl#6719)")


def _turns(completion: list[dict]) -> list[tuple[int, int]]:
    """(index of each assistant message, index after its tool messages); BadRow for any other shape."""
    turns, i = [], 0
    while i < len(completion):
        m = completion[i]
        if m["role"] != "assistant":
            where = "a completion starts with" if i == 0 else "an assistant message belongs here,"
            raise BadRow(f"field 'completion[{i}]' has role '{m['role']}'; {where} an assistant message")
        end = i + 1
        while end < len(completion) and completion[end]["role"] == "tool":
            end += 1
        calls, answers = m.get("tool_calls"), end - i - 1
        if calls is None and (answers or end < len(completion)):
            raise BadRow(f"field 'completion[{i + 1}]' follows an assistant message without tool_calls: "
                         f"{'a tool message answers calls' if answers else 'the trajectory ended there'}")
        if end < len(completion) or answers:
            # malformed calls are left out of tool_calls but answered too (tool_call_message): more answers is fine
            if answers < max(1, len(calls)):
                raise BadRow(f"field 'completion[{i}]' makes {len(calls)} tool calls and {answers} tool messages "
                             "follow it; each call gets one")
            if end == len(completion):
                raise BadRow(f"field 'completion[{end - 1}]' is a tool message and the last; a trajectory ends "
                             "with an assistant message")
        turns.append((i, end))
        i = end
    return turns


_TOOL_CALL = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'


def check_messages(messages, name: str = "prompt") -> None:
    """TRL's conversational prompt: a non-empty list of dicts, each with a string 'role' and a string 'content';
    an assistant message with 'tool_calls' may have no content, a tool message may have a 'name'."""
    if not isinstance(messages, list):
        raise BadRow(f"field '{name}' has type {type(messages).__name__}, not str or a list of messages")
    if not messages:
        raise BadRow(f"field '{name}' is an empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow(f"field '{name}[{i}]' has type {type(m).__name__}, not a message "
                         '({"role": ..., "content": ...})')
        calls = m.get("tool_calls")
        for key in ("role", "content"):
            if key not in m or m[key] is None:
                if key == "content" and calls is not None:
                    continue
                raise BadRow(f"field '{name}[{i}]' has no '{key}'")
            if type(m[key]) is not str:
                raise BadRow(f"field '{name}[{i}].{key}' has type {type(m[key]).__name__}, not str")
        if m["role"] == "tool" and m.get("name") is not None and type(m["name"]) is not str:
            raise BadRow(f"field '{name}[{i}].name' has type {type(m['name']).__name__}, not str")
        if calls is None:
            continue
        if m["role"] != "assistant":
            raise BadRow(f"field '{name}[{i}]' has 'tool_calls' and role '{m['role']}'; only an assistant calls tools")
        if not isinstance(calls, list):
            raise BadRow(f"field '{name}[{i}].tool_calls' has type {type(calls).__name__}, not a list of {_TOOL_CALL}")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if (not isinstance(fn, dict) or c.get("type", "function") != "function"
                    or type(fn.get("name")) is not str or not isinstance(fn.get("arguments"), (dict, str))):
                raise BadRow(f"field '{name}[{i}].tool_calls[{j}]' is {json.dumps(c, default=repr)[:200]}, "
                             f"not a tool call {_TOOL_CALL}")
