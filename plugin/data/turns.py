"""Multi-turn rollouts: the tool turns of online batches and evaluations, between the sampler's rounds.

The sampler (plugin.generation.sampler) decodes rows until each ends a turn with a stop id, then asks
`ToolTurns.resume` what to append. Here each reply is decoded and its tool calls parsed ([online]
tool_call_format); the calls of every row that goes on run together, once in the job
(plugin.generation.tools.run_tools); the tool messages are rendered by the chat template as a full
re-render of the conversation places them (ChatTemplate.tool_suffix) and tokenized on their own: those
ids are appended to the ids generated so far, never re-tokenized with them (trl#5224). Every row's
conversation is kept, so reward functions get TRL's message list: assistant turns with `tool_calls`,
tool messages, the final assistant turn.

Simplifications:
1. The first of the stop ids is the template's end of turn: a tool turn's text is cut after it.
2. A reply cut at max_new_tokens ends as an assistant message of its text, a half-written call included.
"""

from dataclasses import dataclass

from torchtitan.tools.logging import logger

from plugin.data.chat import ChatTemplate
from plugin.data.prompts import Prompt
from plugin.generation.tools import PARSERS, Tool, run_tools, tool_call_message, tool_message


@dataclass
class ToolFigures:
    """One completion's tool use: the calls it made, the ones that failed, its assistant turns."""

    calls: int = 0
    failures: int = 0
    turns: int = 1


class ToolSetup:
    """The job's tools, their call format and the chat template that shows them: built once, at start-up."""

    def __init__(self, online, chat: ChatTemplate, encoder, tokenizer, stop_ids: list[int]):
        self.tools: list[Tool] = encoder.tools  # the prompts show the model these
        self.schemas = encoder.schemas
        if online.tool_call_format not in PARSERS:
            raise ValueError(f"[online] tool_call_format = {online.tool_call_format!r} is not one of {sorted(PARSERS)}; "
                             "a new format is a parser class added to plugin.generation.tools.PARSERS by a module "
                             "the job imports ([experimental] custom_import)")
        self.parser = PARSERS[online.tool_call_format]()
        self.chat, self.encode, self.tokenizer = chat, encoder._text_ids, tokenizer
        self.stop_ids, self.stop_text = stop_ids, token_text(tokenizer, stop_ids[0])
        self.max_iterations, self.timeout = online.max_tool_calling_iterations, online.tool_timeout
        # the template shows the model its tools and renders a tool exchange appended to what came before
        chat.check_tools(self.schemas, self.stop_text)
        logger.info(f"Tools: {', '.join(t.name for t in self.tools)} ({online.tool_call_format} calls, up to "
                    f"{'unlimited' if self.max_iterations < 0 else self.max_iterations} tool turns a completion, "
                    f"{online.tool_timeout:g} s a call)")

    def check_prompts(self, prompts: list[Prompt], key: str) -> None:
        """A tool conversation starts from messages: a text or ids prompt has no chat to put tool turns in."""
        for p in prompts:
            if not isinstance(p.text, list):
                raise ValueError(f"{p.where}: with [online] tools a prompt is a list of messages ({key}); this row "
                                 "gives text or token ids")

    def turns(self, prompts: list[Prompt], tp_group) -> "ToolTurns":
        """The tool turns of one generate call over `prompts` (one per completion)."""
        return ToolTurns(self, prompts, tp_group)


def token_text(tokenizer, token_id: int) -> str:
    """A stop id's text as a chat template writes it ("<|im_end|>"), which decode() drops as a special token."""
    hf = getattr(tokenizer, "tokenizer", None)
    return hf.id_to_token(token_id) if hf is not None else tokenizer.decode([token_id])


class ToolTurns:
    """One generate call's conversations: the sampler's `Turns` (plugin.generation.sampler)."""

    def __init__(self, setup: ToolSetup, prompts: list[Prompt], tp_group):
        self.setup, self.prompts, self.tp_group = setup, prompts, tp_group
        n = len(prompts)
        self.messages: list[list[dict]] = [[] for _ in range(n)]  # each row's completion as messages so far
        self.turn_start = [0] * n  # the completion column where the row's current turn starts
        self.open = [True] * n  # the current turn is not in `messages` yet
        self.figures = [ToolFigures() for _ in range(n)]

    def _reply(self, b: int, completion: list[int]) -> str:
        ids = completion[self.turn_start[b]:]
        return self.setup.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.setup.stop_ids else ids)

    def resume(self, rows: list[int], completions: list[list[int]], room: list[int]) -> list[list[int] | None]:
        """The ids of each row's tool turn, or None where its reply calls no tool or its tool turns are used up."""
        s, limit = self.setup, self.setup.max_iterations
        parsed, calls = [], []
        for b, completion in zip(rows, completions):
            content, made = s.parser.parse(self._reply(b, completion))
            if made and (limit < 0 or self.figures[b].turns - 1 < limit):
                parsed.append((content, made))
                calls += made
            else:  # the final turn; unanswered calls stay in it when the tool turns are used up
                self._close(b, tool_call_message(content, made) if made else
                            {"role": "assistant", "content": self._reply(b, completion)})
                parsed.append(None)
        # every rank, with or without calls: TP peers hold the same rows and share their calls
        results = run_tools(s.tools, calls, s.timeout, self.tp_group)
        out, k = [], 0
        for b, completion, fits, reply in zip(rows, completions, room, parsed):
            if reply is None:
                out.append(None)
                continue
            content, made = reply
            answers, k = results[k:k + len(made)], k + len(made)
            f = self.figures[b]
            f.calls, f.failures = f.calls + len(made), f.failures + sum(r.failed for r in answers)
            assistant = tool_call_message(content, made)
            tool_messages = [tool_message(c, r) for c, r in zip(made, answers)]
            prompt = self.prompts[b].text
            ids = s.encode(s.chat.tool_suffix(prompt + self.messages[b] + [assistant], tool_messages, s.schemas,
                                              s.stop_text))
            out.append(ids)
            if len(ids) > fits:  # the sampler ends the row as truncated, without the answers
                self._close(b, assistant)
                continue
            self.messages[b] += [assistant, *tool_messages]
            self.turn_start[b] = len(completion) + len(ids)
            f.turns += 1
        return out

    def _close(self, b: int, message: dict) -> None:
        self.messages[b].append(message)
        self.open[b] = False

    def finish(self, completions: list[list[int]]) -> tuple[list[list[dict]], list[ToolFigures]]:
        """Every row's completion as messages (a reply cut at max_new_tokens closes it), and its tool figures."""
        for b, completion in enumerate(completions):
            if self.open[b]:
                self._close(b, {"role": "assistant", "content": self._reply(b, completion)})
        return self.messages, self.figures


def build_tool_setup(online, encoder, tokenizer, stop_ids: list[int]) -> ToolSetup | None:
    """The job's ToolSetup, or None without [online] tools."""
    if not online.tools:
        return None
    if encoder.chat is None:
        raise ValueError("[online] tools need a chat template: the tokenizer folder has none and [rollout_data] "
                         "chat_template_path is empty")
    return ToolSetup(online, encoder.chat, encoder, tokenizer, stop_ids)
