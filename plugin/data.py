"""Rollout files -> GRPO batches.

A rollout file is JSONL, one completion per line: {"prompt", "completion", "reward", "group"}.
`group` names the prompt the completion was sampled for; rewards are normalized within it,
so a group is never split across batches or data-parallel ranks.

Token layout of one completion (P prompt tokens incl. BOS, C completion tokens incl. EOS):
    sequence = prompt + completion                     # P + C tokens
    input    = sequence[:-1], padded to seq_len
    labels   = sequence[1:], IGNORE_INDEX where the target is a prompt token or padding
so the loss mask (labels != IGNORE_INDEX) covers exactly the C completion tokens.
"""

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from .config import validate

FIELDS = {"prompt": str, "completion": str, "reward": (int, float), "group": (str, int)}


@dataclass
class Rollouts:
    """Per-completion values that travel with a batch to the loss.

    Deliberately not a tensor, dict or other pytree: FSDP's mixed-precision policy casts every
    floating-point forward input to the param dtype, which would round advantages to bf16.
    """

    advantages: torch.Tensor  # [B] fp32
    rewards: torch.Tensor  # [B] fp32

    def to(self, device: torch.device) -> "Rollouts":
        return Rollouts(self.advantages.to(device), self.rewards.to(device))


class RolloutError(ValueError):
    """A rollout row that cannot be trained on; the message names the file, line and field."""


@dataclass
class Completion:
    tokens: list[int]  # prompt + completion token ids
    prompt_len: int
    reward: float
    where: str  # "file:line", for errors


def _parse_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RolloutError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise RolloutError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name, types in FIELDS.items():
        if name not in row:
            raise RolloutError(f"{where}: missing field '{name}'")
        value = row[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise RolloutError(f"{where}: field '{name}' has type {type(value).__name__}")
    if not math.isfinite(row["reward"]):
        raise RolloutError(f"{where}: field 'reward' is {row['reward']}, not a finite number")
    if not row["completion"]:
        raise RolloutError(f"{where}: field 'completion' is empty")
    return row


def read_rollouts(path: str, tokenizer, seq_len: int) -> list[list[Completion]]:
    """Tokenized groups in order of first appearance; raises RolloutError on the first bad row."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[training] dataset_path = {path!r}: no such rollout file")
    groups: dict[Any, list[Completion]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            row = _parse_row(line, where)
            prompt = tokenizer.encode(row["prompt"], add_bos=True, add_eos=False)
            completion = tokenizer.encode(row["completion"], add_bos=False, add_eos=True)
            if len(prompt) + len(completion) - 1 > seq_len:
                raise RolloutError(
                    f"{where}: prompt + completion is {len(prompt) + len(completion)} tokens, "
                    f"more than [training] seq_len + 1 = {seq_len + 1}"
                )
            groups.setdefault(row["group"], []).append(
                Completion(prompt + completion, len(prompt), float(row["reward"]), where)
            )
    if not groups:
        raise RolloutError(f"{path}: no rollout rows")
    return list(groups.values())


def check_group_sizes(groups: list[list[Completion]], group_size: int) -> int:
    """The common group size (from [grpo] group_size, or inferred); errors name the group's first row."""
    expected = group_size or len(groups[0])
    for g in groups:
        if len(g) != expected:
            source = "[grpo] group_size" if group_size else f"the first group ({groups[0][0].where})"
            raise RolloutError(
                f"{g[0].where}: the group starting here has {len(g)} completions, {source} has {expected}"
            )
    if expected < 2:
        raise RolloutError(f"{groups[0][0].where}: groups of 1 completion have no advantage to compare")
    return expected


def advantages(rewards: torch.Tensor, group_size: int, norm: str, eps: float) -> torch.Tensor:
    """Per-completion advantages of a batch made of whole groups: reward - group mean, over a std."""
    r = rewards.double().view(-1, group_size)  # [groups, G]
    centered = r - r.mean(dim=1, keepdim=True)
    if norm == "group_std":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif norm == "batch_std":
        centered = centered / (r.std() + eps)
    return centered.flatten().float()


class RolloutDataset(IterableDataset, Stateful):
    """Whole groups, shuffled per epoch by seed, dealt round-robin to DP ranks; loops over epochs."""

    def __init__(self, groups: list[list[Completion]], dp_rank: int, dp_world_size: int, seed: int):
        self.groups = groups
        self.dp_rank, self.dp_world_size, self.seed = dp_rank, dp_world_size, seed
        self.epoch, self.pos = 0, 0  # pos: index of the next group in this rank's epoch order

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.groups)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order[self.dp_rank :: self.dp_world_size]

    def __iter__(self):
        while True:
            order = self._epoch_order(self.epoch)
            while self.pos < len(order):
                group = self.groups[order[self.pos]]
                self.pos += 1
                yield from group
            self.epoch, self.pos = self.epoch + 1, 0
            logger.info(f"Rollout data: starting epoch {self.epoch} on dp rank {self.dp_rank}")

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch, self.pos = state_dict["epoch"], state_dict["pos"]


class Collate:
    """Pads completions to seq_len, builds labels and the loss mask, and computes advantages."""

    def __init__(self, seq_len: int, pad_id: int, group_size: int, norm: str, eps: float):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.group_size, self.norm, self.eps = group_size, norm, eps

    def __call__(self, batch: list[Completion]):
        n = len(batch)
        inputs = torch.full((n, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for i, c in enumerate(batch):
            seq = torch.tensor(c.tokens, dtype=torch.long)
            inputs[i, : len(seq) - 1] = seq[:-1]
            # position t predicts token t+1: completion targets start at prompt_len - 1
            labels[i, c.prompt_len - 1 : len(seq) - 1] = seq[c.prompt_len :]
        rewards = torch.tensor([c.reward for c in batch], dtype=torch.float32)
        adv = advantages(rewards, self.group_size, self.norm, self.eps)
        return {"input": inputs, "labels": labels, "rollouts": Rollouts(adv, rewards)}, labels


def build_rollout_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    """torchtitan's dataloader builder for rollout files named by [training] dataset_path."""
    validate(job_config)
    training, grpo = job_config.training, job_config.grpo
    if not training.dataset_path:
        raise ValueError("[training] dataset_path is empty: set it to a rollout JSONL file")
    groups = read_rollouts(training.dataset_path, tokenizer, training.seq_len)
    group_size = check_group_sizes(groups, grpo.group_size)
    if training.local_batch_size % group_size:
        raise ValueError(
            f"[training] local_batch_size = {training.local_batch_size} must be a multiple of the "
            f"group size {group_size}: a group is never split across batches"
        )
    if len(groups) < dp_world_size:
        raise RolloutError(f"{training.dataset_path}: {len(groups)} groups for {dp_world_size} data-parallel ranks")
    logger.info(
        f"Rollouts: {len(groups)} groups of {group_size} from {training.dataset_path}, "
        f"{len(groups) // dp_world_size}+ groups per dp rank per epoch"
    )
    dataset = RolloutDataset(groups, dp_rank, dp_world_size, job_config.debug.seed or 0)
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    collate = Collate(training.seq_len, pad_id, group_size, grpo.advantage_norm, grpo.advantage_eps)
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
        batch_size=training.local_batch_size, collate_fn=collate,
    )
