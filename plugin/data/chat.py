"""Conversational prompts: TRL's list of {"role", "content"} messages, rendered with the tokenizer's own Jinja
chat template (`chat_template` of tokenizer_config.json, or chat_template.jinja) exactly as transformers'
`apply_chat_template(messages, add_generation_prompt=True)` renders it, without importing transformers.

transformers' renderer: an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loopcontrols,
a `tojson` filter that does not escape HTML, the globals raise_exception, strftime_now, dict and
namespace, and the named special tokens (bos_token, eos_token, ...) as variables.

Simplifications:
1. No tools, documents, {% generation %} masks or continue_final_message: a prompt is messages only.
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

    def __init__(self, folder: str, source: str | None, special_tokens: dict[str, str]):
        self.folder, self.source, self.special_tokens = folder, source, special_tokens
        self._template = _environment().from_string(source) if source is not None else None

    @classmethod
    def from_folder(cls, folder: str) -> "ChatTemplate":
        """chat_template.jinja if the folder has one (transformers' newer layout), else tokenizer_config.json's."""
        path = Path(folder)
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        tokens = {k: t for k in SPECIAL_TOKENS if (t := _token(config.get(k))) is not None}
        return cls(folder, source, tokens)

    def render(self, messages, name: str = "prompt") -> str:
        """The prompt text of `messages` (checked first), ending in the assistant's generation prompt."""
        check_messages(messages, name)
        if self._template is None:
            raise BadRow(f"field '{name}' is a list of messages, which needs a chat template, and "
                         f"{self.folder} ([model] hf_assets_path) has none: no 'chat_template' in "
                         "tokenizer_config.json and no chat_template.jinja")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:  # raise_exception's message, e.g. an unknown role
            raise BadRow(f"field '{name}': the chat template of {self.folder} raised: {e}") from None


def check_messages(messages, name: str = "prompt") -> None:
    """TRL's conversational prompt: a non-empty list of dicts, each with a string 'role' and a string 'content'."""
    if not isinstance(messages, list):
        raise BadRow(f"field '{name}' has type {type(messages).__name__}, not str or a list of messages")
    if not messages:
        raise BadRow(f"field '{name}' is an empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow(f"field '{name}[{i}]' has type {type(m).__name__}, not a message "
                         '({"role": ..., "content": ...})')
        for key in ("role", "content"):
            if key not in m or m[key] is None:
                raise BadRow(f"field '{name}[{i}]' has no '{key}'")
            if type(m[key]) is not str:
                raise BadRow(f"field '{name}[{i}].{key}' has type {type(m[key]).__name__}, not str")
