"""A tool-call format a random policy writes, and a tool that records its calls: tests/test_tools_e2e.py's torchrun jobs.

The job imports this module ([experimental] custom_import = "toy_tools", tests/ on PYTHONPATH), which imports the
plugin and adds the "toy" format to PARSERS, as a user's own format would be added. A reply whose text has an even
number of characters calls `echo` with its first characters: about half the turns of a random policy call.
"""

import os

import plugin  # noqa: F401  (registers the GRPO TrainSpecs, as custom_import = "plugin" does)
from plugin.generation.tools import PARSERS, ToolCall


class ToyParser:
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if len(text) % 2:
            return text, []
        return text, [ToolCall("echo", {"text": text[:6]})]


PARSERS["toy"] = ToyParser


def echo(text: str) -> str:
    """Echo the start of a reply, and record the call.

    Args:
        text: What to echo.
    """
    with open(os.path.join(os.environ["TOY_TOOL_LOG"], f"calls-{os.getpid()}.txt"), "a") as f:
        f.write(" ".join(text.splitlines()) + "\n")  # one line a call: "\r" and the like count as breaks when read
    return f"ok {len(text)}"


def tool_turns(prompts, completions, completion_ids, **columns) -> list[float]:
    """The reward is the number of tool messages in the trajectory: it sees TRL's message lists."""
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]
