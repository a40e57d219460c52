"""Online GRPO: every batch's groups are sampled from the current policy inside torchtitan's loop.

torchtitan's Trainer pulls all microbatches of a step before its first forward, and builds the
dataloader before the model. So the dataset samples: it finds the parallelized policy in the
job's GRPOJob (the parallelize function puts it there), and the first `next()` of a batch's
first step generates G completions for each of this rank's prompts, scores them with the reward
functions, gathers rewards and lengths from the other DP ranks (advantages and loss weights are
global), and cuts the same microbatches as file rollouts (plugin.data.batch's plan and Collate).
Generation time therefore also shows as torchtitan's data-loading time.

With `[online] num_iterations` = mu > 1 a batch is trained on for mu optimizer steps. The
dataset scores its microbatches with the policy before any update (`policy.logprobs`, no
gradient), as TRL does: those are the replays' old log-probs. The first step is on-policy (its
ratio is 1), the replays' ratios are clipped against them.

The data state (prompt position, replay phase and, mid-replay, the batch itself with its old
log-probs) is saved per DP rank, so a resume anywhere, mid-replay too, continues the same run.

Simplifications:
1. Every rank loads the whole prompt file into memory (prompts are small next to rollouts).
2. A batch's completions are generated together per rank, all its microbatches at once ([online] max_num_seqs
   splits them into calls).
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.distributed.utils import maybe_enable_amp
from torchtitan.tools.logging import logger

from plugin.data.batch import GroupStream, Rollouts
from plugin.data.rewards import load_reward_fns, score
from plugin.data.rollouts import BadRow, Completion, JsonlFile, ParquetFile, RolloutError, report, rollout_format
from plugin.generation.sampler import build_sampler, max_prompt_tokens
from plugin.job import GRPOJob
from plugin.runtime.stats import OnlineStats

PROMPT_FIELDS = ("prompt", "prompt_ids")


@dataclass
class Prompt:
    ids: list[int]  # with the chat template and BOS, as the model reads it
    text: str  # as given (decoded when the row gives ids): what reward functions get as a prompt
    columns: dict[str, Any]  # every other column of the row
    where: str  # file:line (JSONL) or file: row n (Parquet)


def load_prompts(path: str, encoder, tokenizer, *, fmt: str, max_new_tokens: int, on_error: str) -> tuple[list[Prompt], int]:
    """Every prompt row, checked; (prompts, rows skipped). A bad row raises naming file, line and field,
    or with on_error = "skip" is counted, logged and left out."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[training] dataset_path = {path!r}: no such prompt file")
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
        raise RolloutError(f"{path}: no valid prompt rows" + (f"; first problems:\n  " + "\n  ".join(problems)
                                                                if problems else ""))
    return prompts, skipped


def sample_key(seed: int, batch: int, position: int, member: int) -> int:
    """The 63-bit key of one completion's randomness: the run seed, the batch, the group's place in it, the member.

    Nothing about the rank layout enters it, so 1 rank, TP and FSDP draw the same completions.
    """
    data = f"{seed}:{batch}:{position}:{member}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class OnlineDataset(IterableDataset, Stateful):
    """Yields this rank's microbatches of completions sampled from the attached policy, each batch mu times."""

    def __init__(self, prompts: list[Prompt], plan, collate, seed: int, online, reward_fns, tokenizer,
                 pad_id: int, stop_ids: list[int], temperature: float, dump_folder: str, job: GRPOJob,
                 stats: OnlineStats, mixed_precision_param: str = "float32"):
        self.prompts, self.plan, self.collate, self.seed, self.cfg = prompts, plan, collate, seed, online
        self.reward_fns, self.tokenizer, self.pad_id, self.stop_ids = reward_fns, tokenizer, pad_id, stop_ids
        self.temperature, self.dump_folder, self.job, self.stats = temperature, dump_folder, job, stats
        self.mixed_precision_param = mixed_precision_param  # [training]: the dtype the trainer computes in
        self.stream = GroupStream(len(prompts), plan.groups_per_step, seed)
        # position: the next (batch, iteration, microbatch) to yield; mid-batch, its microbatches
        self.batch_index, self.iteration, self.microbatch = 0, 0, 0
        self.batch: list[dict] | None = None
        self.policy, self.sampler, self.dp_group, self.writes_log = None, None, None, True

    def _start(self) -> None:
        """The parallelized policy (built after this dataset) to sample from, its sampler and the DP group."""
        self.policy, parallel_dims = self.job.policy, self.job.parallel_dims
        if self.policy is None:
            raise RuntimeError("online mode: the policy was never parallelized for this job (plugin.model.parallelize "
                               "hands it over; is [model] name a grpo_* model?)")
        if parallel_dims.dp_enabled:
            self.dp_group = parallel_dims.get_optional_mesh("batch").get_group()
        tp = parallel_dims.tp if parallel_dims.tp_enabled else 1
        self.writes_log = tp == 1 or parallel_dims.get_optional_mesh("tp").get_local_rank() == 0  # TP peers agree
        # the training forward's autocast (none under FSDP, whose parameters are already in the compute dtype)
        amp = maybe_enable_amp(parallel_dims, self.mixed_precision_param, next(self.policy.parameters()).device.type)
        self.sampler = build_sampler(self.policy, kv_cache=self.cfg.kv_cache, max_new_tokens=self.cfg.max_new_tokens,
                                     stop_ids=self.stop_ids, temperature=self.temperature, pad_id=self.pad_id,
                                     max_num_seqs=self.cfg.max_num_seqs, check_every=self.cfg.stop_check_every,
                                     compile_decode=self.cfg.compile_decode, autocast=lambda: amp)

    def __iter__(self):
        plan, mu = self.plan, self.cfg.num_iterations
        while True:
            if self.microbatch == plan.grad_accum:
                self.iteration, self.microbatch = self.iteration + 1, 0
            if self.iteration == mu:
                self.batch_index, self.iteration, self.batch = self.batch_index + 1, 0, None
            if self.batch is None:
                if self.iteration or self.microbatch:
                    raise RolloutError("the data position is inside a replayed batch that the checkpoint does not hold")
                self.batch = self.sample_batch(self.batch_index)
            record = self.batch[self.microbatch]
            r = record["rollouts"]
            # the first pass is on-policy and measures the sampler's log-probs; replays use the batch's old log-probs
            old, sampler = (None, r.sampler_logprobs) if self.iteration == 0 else (record["old_logprobs"], None)
            rollouts = Rollouts(r.advantages, r.rewards, r.loss_weights, old, sampler)
            self.microbatch += 1
            yield {"input": record["input"], "labels": record["labels"], "rollouts": rollouts}, record["labels"]

    @torch.no_grad()
    def sample_batch(self, index: int) -> list[dict]:
        """Sample, reward and cut global batch `index`: this rank's microbatches."""
        if self.sampler is None:
            self._start()
        plan, G = self.plan, self.plan.group_size
        if (epoch := self.stream.epoch_starting(index)) is not None:
            logger.info(f"Online prompts: epoch {epoch} starts at batch {index}")
        prompt_ids = self.stream.step_groups(index)
        positions = [i for j in range(plan.grad_accum) for i in plan.microbatch(j)]  # my groups, in batch order
        mine = [self.prompts[prompt_ids[i]] for i in positions for _ in range(G)]
        keys = [sample_key(self.seed, index, i, m) for i in positions for m in range(G)]

        start = time.perf_counter()
        with self.job.stats.peak_memory(next(self.policy.parameters()).device) as memory:
            samples = self.sampler.generate([p.ids for p in mine], keys)
        gen_time = time.perf_counter() - start

        texts = [self.tokenizer.decode(c[:-1] if c and c[-1] in self.stop_ids else c) for c in samples.completions]
        columns = {k: [p.columns.get(k) for p in mine] for k in dict.fromkeys(k for p in mine for k in p.columns)}
        totals, per_fn = score(self.reward_fns, [p.text for p in mine], texts, samples.completions, columns,
                               [p.where for p in mine])
        lengths = [len(c) for c in samples.completions]

        # advantages (batch_std) and loss weights need every DP rank's rewards and lengths
        part = (positions, gen_time, memory.peak, [totals, lengths, samples.truncated, *per_fn])
        gathered = [part]
        if self.dp_group is not None:
            gathered = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, part, group=self.dp_group)
        n = plan.groups_per_step * G
        # reward, length, truncated and each function's reward of every completion, in batch order
        values = [[0.0] * n, [0] * n, [False] * n, *([0.0] * n for _ in self.reward_fns)]
        for pos, _, _, rank_values in gathered:
            for k, i in enumerate(pos):  # the rank's k-th group is the batch's i-th
                for column, v in zip(values, rank_values):
                    column[i * G : (i + 1) * G] = v[k * G : (k + 1) * G]
        rewards, lens, truncated, *fn_rewards = values
        self.stats.record(max(g[1] for g in gathered), max(g[2] for g in gathered), lens, truncated, fn_rewards)
        if self.cfg.log_completions and self.writes_log:
            self._log(index, mine, texts, samples, totals, per_fn)

        rewards_t, lens_t = torch.tensor(rewards, dtype=torch.float32), torch.tensor(lens, dtype=torch.long)
        batch = []
        for j in range(plan.grad_accum):
            rows = plan.rows(j)
            # `mine` is in batch order (`positions`), so microbatch j's completions are its j-th run of len(rows)
            completions = [Completion(mine[s].ids + samples.completions[s], len(mine[s].ids), rewards[row],
                                      samples.logprobs[s]) for s, row in enumerate(rows, start=j * len(rows))]
            inputs, labels = self.collate(rewards_t, lens_t, rows, completions)
            batch.append(dict(input=inputs["input"], labels=labels, rollouts=inputs["rollouts"]))
        if self.cfg.num_iterations > 1:
            # the replays' old log-probs: the policy's before any update from this batch
            device = next(self.policy.parameters()).device
            for record in batch:
                record["old_logprobs"] = self.policy.logprobs(record["input"].to(device),
                                                              record["labels"].to(device)).cpu()
        return batch

    def _log(self, index: int, mine: list[Prompt], texts, samples, totals, per_fn) -> None:
        folder = Path(self.dump_folder) / "completions"
        folder.mkdir(parents=True, exist_ok=True)
        dp = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        with open(folder / f"batch-{index:06d}-dp{dp}.jsonl", "w") as f:
            for s, p in enumerate(mine):
                f.write(json.dumps(dict(
                    prompt=p.text, where=p.where, completion=texts[s], completion_ids=samples.completions[s],
                    truncated=samples.truncated[s], reward=totals[s],
                    rewards={fn.name: (None if r[s] != r[s] else r[s]) for fn, r in zip(self.reward_fns, per_fn)},
                )) + "\n")

    def state_dict(self) -> dict[str, Any]:
        state = dict(batch_index=self.batch_index, iteration=self.iteration, microbatch=self.microbatch,
                     num_prompts=len(self.prompts))
        mid_batch = self.microbatch < self.plan.grad_accum or self.iteration + 1 < self.cfg.num_iterations
        if self.batch is not None and (self.iteration or self.microbatch) and mid_batch:
            state["batch"] = [dict(rec, rollouts=rec["rollouts"].to(torch.device("cpu"))) for rec in self.batch]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("num_prompts", len(self.prompts))
        if saved != len(self.prompts):
            raise RolloutError(
                f"{self.prompts[0].where.rsplit(':', 1)[0]}: {len(self.prompts)} valid prompts, but the checkpoint's "
                f"data position is in a stream of {saved}; resume with the same prompt file and settings"
            )
        self.batch_index, self.iteration, self.microbatch = (
            state_dict["batch_index"], state_dict["iteration"], state_dict["microbatch"])
        self.batch = state_dict.get("batch")
        for record in self.batch or []:  # earlier versions kept the replays' old log-probs in the rollouts
            record.setdefault("old_logprobs", record["rollouts"].old_logprobs)


def build_online_dataset(job_config, job: GRPOJob, tokenizer, encoder, batching):
    """The online dataset for [training] dataset_path's prompts; `batching` (plugin.data.loader) cuts batches as for files."""
    training, grpo, online, cfg = job_config.training, job_config.grpo, job_config.online, job_config.rollout_data
    G = online.num_generations
    if grpo.group_size not in (0, G):
        raise ValueError(f"[grpo] group_size = {grpo.group_size} differs from [online] num_generations = {G}; "
                         "set [grpo] group_size = 0 (or to the same value) in online mode")
    stop_ids = list(online.stop_token_ids)
    if not stop_ids:
        if tokenizer.eos_id is None:
            raise ValueError("[online] stop_token_ids is empty and the tokenizer has no EOS id: give the stop ids")
        stop_ids = [tokenizer.eos_id]
    for i, t in enumerate(stop_ids):
        if t >= encoder.vocab_size:
            raise ValueError(f"[online] stop_token_ids[{i}] = {t} is outside the model's vocabulary [0, {encoder.vocab_size})")
    reward_fns = load_reward_fns(online.reward_funcs, online.reward_weights)
    prompts, skipped = load_prompts(training.dataset_path, encoder, tokenizer, fmt=cfg.format,
                                    max_new_tokens=online.max_new_tokens, on_error=cfg.on_error)
    job.stats.skipped_rows = skipped
    job.online_stats = OnlineStats([f.name for f in reward_fns])
    plan, collate = batching(G, len(prompts), "prompts", sampled=True)
    logger.info(
        f"Online GRPO: {len(prompts)} prompts from {training.dataset_path}, {plan.groups_per_step} per batch, "
        f"{G} completions each, up to {online.max_new_tokens} new tokens (stop ids {stop_ids}), "
        f"{online.num_iterations} optimizer step(s) per batch, rewards: "
        + ", ".join(f"{f.weight:g} * {f.key.split('= ', 1)[1]}" for f in reward_fns)
    )
    return OnlineDataset(prompts, plan, collate, job_config.debug.seed or 0, online, reward_fns, tokenizer,
                         collate.pad_id, stop_ids, grpo.temperature, job_config.job.dump_folder, job, job.online_stats,
                         training.mixed_precision_param)
