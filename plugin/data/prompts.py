"""Prompt files of online mode and evaluation: rows checked and encoded as the model reads them, and the stop ids.

A row gives `prompt` (text, or a list of chat messages rendered with the tokenizer's chat template) or
`prompt_ids`; every other column reaches the reward functions as a keyword list (plugin.data.rewards).
"""

import os
from dataclasses import dataclass
from typing import Any

from torchtitan.tools.logging import logger

from plugin.data.rollouts import BadRow, JsonlFile, ParquetFile, RolloutError, report, rollout_format
from plugin.generation.sampler import max_prompt_tokens

PROMPT_FIELDS = ("prompt", "prompt_ids")


@dataclass
class Prompt:
    ids: list[int]  # with the chat template and BOS, as the model reads it
    text: str | list[dict]  # as given, text or messages (decoded when the row gives ids): reward functions' prompt
    columns: dict[str, Any]  # every other column of the row
    where: str  # file:line (JSONL) or file: row n (Parquet)


def load_prompts(path: str, encoder, tokenizer, *, fmt: str, max_new_tokens: int, on_error: str,
                 key: str = "[training] dataset_path") -> tuple[list[Prompt], int]:
    """Every prompt row, checked; (prompts, rows skipped). A bad row raises naming file, line and field,
    or with on_error = "skip" is counted, logged and left out. `key` names the file's TOML key."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key} = {path!r}: no such prompt file")
    prompts, problems, skipped = [], [], 0
    limit = max_prompt_tokens(encoder.seq_len, max_new_tokens)
    source = JsonlFile(path) if rollout_format(path, fmt) == "jsonl" else ParquetFile(path, every_column=True)
    for line, _, row in source.scan():
        try:
            if isinstance(row, BadRow):
                raise row
            ids = encoder.prompt(row)
            if len(ids) > limit:
                raise BadRow(f"the prompt is {len(ids)} tokens; with [online] max_new_tokens = {max_new_tokens} "
                           f"a prompt may have at most [training] seq_len + 1 - max_new_tokens = {limit}")
        except BadRow as e:
            report(problems, on_error, f"{source.where(line)}: {e}")
            skipped += 1
            continue
        text = row["prompt"] if row.get("prompt") is not None else tokenizer.decode(ids)
        columns = {k: v for k, v in row.items() if k not in PROMPT_FIELDS}
        prompts.append(Prompt(ids, text, columns, source.where(line)))
    if skipped:
        logger.warning(f"{path}: {skipped} prompt rows skipped ([rollout_data] on_error = \"skip\"); first problems:\n  "
                       + "\n  ".join(problems))
    if not prompts:
        raise RolloutError(f"{path}: no valid prompt rows" + ("; first problems:\n  " + "\n  ".join(problems)
                                                                if problems else ""))
    return prompts, skipped


def resolve_stop_ids(online, tokenizer, vocab_size: int) -> list[int]:
    """[online] stop_token_ids, checked against the vocabulary; [] = the tokenizer's EOS id."""
    stop_ids = list(online.stop_token_ids)
    if not stop_ids:
        if tokenizer.eos_id is None:
            raise ValueError("[online] stop_token_ids is empty and the tokenizer has no EOS id: give the stop ids")
        stop_ids = [tokenizer.eos_id]
    for i, t in enumerate(stop_ids):
        if t >= vocab_size:
            raise ValueError(f"[online] stop_token_ids[{i}] = {t} is outside the model's vocabulary [0, {vocab_size})")
    return stop_ids
