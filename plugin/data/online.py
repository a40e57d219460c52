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
import time
from contextlib import nullcontext
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
from plugin.data.prompts import Prompt, load_prompts, resolve_stop_ids
from plugin.data.rewards import check_model_prompts, load_reward_fns, score_completions
from plugin.data.rollouts import Completion, RolloutError
from plugin.data.turns import ToolFigures, ToolSetup, build_tool_setup
from plugin.generation.engine import KVPool, build_sampler
from plugin.job import GRPOJob
from plugin.runtime.stats import OnlineStats


@dataclass
class SampledGroup:
    """One prompt's G completions and their figures; the completions are absent on ranks that do not train on them."""

    prompt: Prompt | None
    rewards: list[float]  # the weighted total per completion
    lengths: list[int]
    truncated: list[bool]
    fn_rewards: list[list[float]]  # per reward function, per completion; NaN where it returned None
    completions: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None  # the sampler's
    texts: list[str] | None = None
    tool_masks: list[list[int]] | None = None  # multi-turn: 0 on a tool turn's tokens
    tools: list[ToolFigures] | None = None  # multi-turn: each completion's calls, failures and turns
    messages: list[list[dict]] | None = None  # multi-turn: each completion as messages
    routed_experts: list | None = None  # R3: the sampler's routing of each completion (Samples.routed_experts)

    def figures(self) -> "SampledGroup":
        """The group without its prompt and completions: what other DP ranks need of it without filter_groups."""
        return SampledGroup(None, self.rewards, self.lengths, self.truncated, self.fn_rewards, tools=self.tools)


@dataclass
class Drawn:
    """One global batch as drawn: its K groups, completions included, and the figures of every group sampled for it
    (with filter_groups more than K). A generator process sends it whole to the trainer (plugin.generation.remote)."""

    groups: list[SampledGroup]
    gen_time: float  # the slowest rank's seconds generating
    gen_peak: int  # the largest rank's peak memory while generating (bytes)
    reward_time: float
    lengths: list[int]  # every sampled completion's tokens in the loss
    truncated: list[bool]
    fn_rewards: list[list[float]]  # per reward function, per sampled completion
    tools: list | None  # every sampled completion's ToolFigures (multi-turn)
    dropped: int  # filter_groups: equal-reward groups left out
    rounds: int
    stream_start: int  # the prompt stream's positions it took: [stream_start, stream_end)
    stream_end: int
    kv_cache_bytes: int = 0
    version: int = -1  # a generator's: the policy version (optimizer steps) of the weights that drew it
    idle_share: float = 0.0  # a generator's: the share of its time since the last batch spent waiting for weights


def online_sampler(policy, job_config, parallel_dims, *, stop_ids: list[int], temperature: float, pad_id: int):
    """The sampler of the job's [online] settings over `policy`, for training batches and for evaluation alike:
    the built-in one, or with use_vllm one over the job's vLLM engine (built at the first call)."""
    cfg = job_config.online
    if cfg.use_vllm:
        from plugin.generation.vllm import VLLMEngine, VLLMSampler

        job = GRPOJob.of(job_config)
        if job.vllm is None:
            job.vllm = VLLMEngine(job_config, policy, parallel_dims, job.online_stats)
        return VLLMSampler(job.vllm, max_new_tokens=cfg.max_new_tokens, stop_ids=stop_ids, temperature=temperature,
                           max_seq_len=policy.model_args.max_seq_len, device=next(policy.parameters()).device)
    # the training forward's autocast (none under FSDP, whose parameters are already in the compute dtype)
    amp = maybe_enable_amp(parallel_dims, job_config.training.mixed_precision_param,
                           next(policy.parameters()).device.type)
    job = GRPOJob.of(job_config)
    if job.kv_pool is None:  # one cache for the run: training's and evaluation's samplers share it
        job.kv_pool = KVPool()
    # only TP peers' forwards talk, and they hold the same rows, but EP's all-to-alls span the data-parallel ranks
    return build_sampler(policy, kv_cache=cfg.kv_cache, max_new_tokens=cfg.max_new_tokens, stop_ids=stop_ids,
                         temperature=temperature, pad_id=pad_id, max_num_seqs=cfg.max_num_seqs,
                         check_every=cfg.stop_check_every, compile_decode=cfg.compile_decode, autocast=lambda: amp,
                         pool=job.kv_pool, lockstep=parallel_dims.ep_enabled)


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
                 stats: OnlineStats, job_config=None, tools: ToolSetup | None = None):
        self.prompts, self.plan, self.collate, self.seed, self.cfg = prompts, plan, collate, seed, online
        self.reward_fns, self.tokenizer, self.pad_id, self.stop_ids = reward_fns, tokenizer, pad_id, stop_ids
        self.temperature, self.dump_folder, self.job, self.stats = temperature, dump_folder, job, stats
        self.job_config = job_config  # the job's whole config: the sampler's settings (online_sampler)
        self.tools = tools  # [online] tools: completions are multi-turn
        self.stream = GroupStream(len(prompts), plan.groups_per_step, seed)
        # the next batch's first stream position: K per batch, more where filter_groups sampled extra rounds
        self.stream_pos = 0
        # position: the next (batch, iteration, microbatch) to yield; mid-batch, its microbatches
        self.batch_index, self.iteration, self.microbatch = 0, 0, 0
        self.batch: list[dict] | None = None
        self.policy, self.sampler, self.dp_group, self.tp_group, self.writes_log = None, None, None, None, True
        # a separate generator ([online] generator_mode): the link to it, the batches received (in order), and
        # those a checkpoint holds that were drawn but not yet trained on
        self.remote, self.fetched, self.held = None, 0, {}
        self.generators = None  # generator_mode = "local": the processes started with the dataset (LocalGenerators)

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
        if tp > 1:  # TP peers sample the same completions: each scores a share of them
            self.tp_group = parallel_dims.get_optional_mesh("tp").get_group()
        if self.cfg.generator_mode != "colocate":  # the generator processes sample: this rank never does
            from plugin.generation.remote import TrainerLink

            self.remote = self.job.remote = TrainerLink(self.job_config, self.policy, parallel_dims, self.stats,
                                                        self.generators)
            self.fetched, self.stream_pos = self.remote.start(self.fetched, self.stream_pos, self.held,
                                                              self.steps_done(), self.plan.dp_world_size)
            return
        self.sampler = online_sampler(self.policy, self.job_config, parallel_dims, stop_ids=self.stop_ids,
                                      temperature=self.temperature, pad_id=self.pad_id)

    def steps_done(self) -> int:
        """Optimizer steps taken before the next microbatch: the policy's version."""
        done = self.microbatch == self.plan.grad_accum
        return self.batch_index * self.cfg.num_iterations + self.iteration + done

    def __iter__(self):
        plan, mu = self.plan, self.cfg.num_iterations
        if self.sampler is None and self.remote is None:  # the policy is attached by now: its sampler, or the link
            self._start()
        while True:
            if self.microbatch == plan.grad_accum:
                self.iteration, self.microbatch = self.iteration + 1, 0
            if self.iteration == mu:
                self.batch_index, self.iteration, self.batch = self.batch_index + 1, 0, None
            if self.microbatch == 0 and self.remote is not None:
                self.remote.push(self.steps_done())  # the weights of every step, before the step's first microbatch
            if self.batch is None:
                if self.iteration or self.microbatch:
                    raise RolloutError("the data position is inside a replayed batch that the checkpoint does not hold")
                self.batch = self.sample_batch(self.batch_index)
            record = self.batch[self.microbatch]
            r = record["rollouts"]
            # the first pass is on-policy and measures the sampler's log-probs; replays use the batch's old log-probs
            old, sampler = (None, r.sampler_logprobs) if self.iteration == 0 else (record.get("old_logprobs"), None)
            if self.cfg.behavior_logprobs == "sampler":  # every pass's ratio is to the sampler that drew the batch
                old = r.sampler_logprobs
            rollouts = Rollouts(r.advantages, r.rewards, r.loss_weights, old, sampler, seq_lens=r.seq_lens,
                                packed=r.packed, routed_experts=r.routed_experts)
            self.microbatch += 1
            # as collated (input, labels, padding-free positions), the rollouts replaced; old log-probs are in them
            yield {**{k: v for k, v in record.items() if k != "old_logprobs"}, "rollouts": rollouts}, record["labels"]

    @torch.no_grad()
    def sample_batch(self, index: int) -> list[dict]:
        """Global batch `index`, drawn here or by the generator processes ([online] generator_mode), cut into this
        rank's microbatches."""
        if index in self.held:  # drawn before a checkpoint by a separate generator: trained on in either mode
            drawn = self.held.pop(index)
        elif self.remote is not None:
            drawn = self.remote.batch(index)
        else:
            drawn = self.draw(index)
        self.fetched = max(self.fetched, index + 1)
        self.stream_pos = max(self.stream_pos, drawn.stream_end)
        return self.cut(index, drawn)

    def draw(self, index: int, positions: list[int] | None = None) -> "Drawn":
        """Sample and reward global batch `index`: this rank's `positions` of it (its microbatches' by default; a
        generator process draws them all), every group's rewards gathered over the DP ranks.

        With [online] filter_groups, a group whose rewards are all equal (no advantage) is dropped
        and whole rounds of K more prompts are sampled from the stream until K groups are kept.
        """
        if self.sampler is None:
            self._start()
        K, cfg = self.plan.groups_per_step, self.cfg
        kept, dropped, sampled, gen_time, gen_peak, reward_time, rounds = [], [], [], 0.0, 0, 0.0, 0
        stream_start = self.stream_pos
        while len(kept) < K:
            if cfg.filter_groups and cfg.max_num_gen_batches and rounds == cfg.max_num_gen_batches:
                logger.warning(
                    f"Online batch {index}: {len(kept)} of {K} groups have rewards that differ after "
                    f"[online] max_num_gen_batches = {cfg.max_num_gen_batches} generation rounds; the batch is filled "
                    f"with {K - len(kept)} equal-reward groups (no advantage, only the KL term trains on them). "
                    "Easier prompts, more completions per prompt or a larger cap avoid this")
                need = K - len(kept)
                kept, dropped = kept + dropped[:need], dropped[need:]
                break
            if (epoch := self.stream.epoch_starting_at(self.stream_pos, K)) is not None:
                logger.info(f"Online prompts: epoch {epoch} starts at batch {index}")
            groups, seconds, peak, scoring = self._sample_round(index, rounds, self.stream.groups(self.stream_pos, K),
                                                                positions)
            self.stream_pos, rounds, gen_time = self.stream_pos + K, rounds + 1, gen_time + seconds
            reward_time += scoring
            gen_peak = max(gen_peak, peak)
            sampled += groups
            if not cfg.filter_groups:
                kept = groups
                break
            for g in groups:
                (kept if len(set(g.rewards)) > 1 else dropped).append(g)
        pool = getattr(self.sampler, "pool", None)  # the built-in engine's KV cache (vLLM keeps its own)
        return Drawn(kept[:K], gen_time, gen_peak, reward_time, [n for g in sampled for n in g.lengths],
                     [t for g in sampled for t in g.truncated],
                     [[r for g in sampled for r in g.fn_rewards[k]] for k in range(len(self.reward_fns))],
                     [f for g in sampled for f in g.tools] if self.tools else None, len(dropped), rounds,
                     stream_start, self.stream_pos, kv_cache_bytes=pool.bytes() if pool is not None else 0)

    def cut(self, index: int, drawn: "Drawn") -> list[dict]:
        """This rank's microbatches of a drawn global batch, collated; with mu > 1 and the policy's log-probs, their
        old log-probs."""
        plan, G, cfg = self.plan, self.plan.group_size, self.cfg
        final = drawn.groups  # a round's surplus is left unused, as verl does
        if drawn.kv_cache_bytes:
            self.stats.kv_cache_bytes = drawn.kv_cache_bytes
        self.stats.record(drawn.gen_time, drawn.gen_peak, drawn.lengths, drawn.truncated, drawn.fn_rewards,
                          drawn.tools, drawn.reward_time)
        if cfg.filter_groups:
            self.stats.record_filter(drawn.dropped, drawn.rounds - 1)

        positions = [i for j in range(plan.grad_accum) for i in plan.microbatch(j)]  # my groups, in batch order
        if cfg.log_completions and self.writes_log:
            self._log(index, [final[i] for i in positions])

        rewards = [r for g in final for r in g.rewards]
        rewards_t = torch.tensor(rewards, dtype=torch.float32)
        lens_t = torch.tensor([n for g in final for n in g.lengths], dtype=torch.long)  # the tokens in the loss
        keep = None
        if cfg.mask_truncated_completions:
            keep = ~torch.tensor([t for g in final for t in g.truncated], dtype=torch.bool)
            if not keep.any():
                logger.warning(f"Online batch {index}: every completion reached [online] max_new_tokens = "
                               f"{cfg.max_new_tokens} and mask_truncated_completions leaves none in the loss: the "
                               "step makes no update (its loss is 0, as TRL's)")
        batch = []
        # padding-free: microbatches balanced by tokens over every rank's, whose completions every rank then holds
        tokens = None
        if self.collate.padding_free:  # every completion's whole length, tool turns included
            tokens = self.collate.tokens([len(g.prompt.ids) for g in final for _ in g.lengths],
                                         [len(c) for g in final for c in g.completions])
        for j in range(plan.grad_accum):
            rows = plan.rows(j, tokens)
            completions = []
            for row in rows:
                g, m = final[row // G], row % G
                completions.append(Completion(g.prompt.ids + g.completions[m], len(g.prompt.ids), rewards[row],
                                              g.logprobs[m], tool_mask=g.tool_masks[m] if g.tool_masks else None,
                                              routed_experts=g.routed_experts[m] if g.routed_experts else None))
            inputs, labels = self.collate(rewards_t, lens_t, rows, completions, keep)
            batch.append(inputs)
        if cfg.num_iterations > 1 and cfg.behavior_logprobs == "policy":
            # the replays' old log-probs: the policy's before any update from this batch. Routing replay: R3 routes
            # this pass as the sampler did; R2 keeps its routing for every pass over the batch
            device = next(self.policy.parameters()).device
            routing = getattr(self.policy, "routing", None)
            replay = routing.replay if routing is not None else "none"
            for record in batch:
                layout = {"positions": record["positions"].to(device)} if "positions" in record else {}
                inputs, r = record["input"].to(device), record["rollouts"]
                capture = routing.capturing(*inputs.shape, device) if replay == "R2" else nullcontext()
                with capture as kept, routing.replaying(r.routed_experts) if replay == "R3" else nullcontext():
                    record["old_logprobs"] = self.policy.logprobs(inputs, record["labels"].to(device), **layout).cpu()
                if kept is not None:
                    r.routed_experts = kept.experts.cpu()
        return batch

    def _sample_round(self, index: int, rnd: int, prompt_ids,
                      positions: list[int] | None = None) -> tuple[list["SampledGroup"], float, int, float]:
        """One generation round of K groups: this rank samples and scores its positions, and every rank gets every
        group's rewards (advantages and loss weights are global), with filter_groups also their completions.

        A completion's key names the batch, the round's place and the member, never the rank: 1 rank, TP and FSDP
        draw the same completions. Returns the groups in stream order, the slowest rank's generation seconds,
        the largest rank's peak memory during generation (bytes) and the slowest rank's reward seconds.
        """
        plan, G, K = self.plan, self.plan.group_size, self.plan.groups_per_step
        if positions is None:  # my groups, in batch order
            positions = [i for j in range(plan.grad_accum) for i in plan.microbatch(j)]
        mine = [self.prompts[prompt_ids[i]] for i in positions for _ in range(G)]
        keys = [sample_key(self.seed, index, rnd * K + i, m) for i in positions for m in range(G)]

        start = time.perf_counter()
        turns = self.tools.turns(mine, self.tp_group) if self.tools else None
        routing = getattr(self.policy, "routing", None)  # an MoE policy's sampler routing: moe/sampler_*, R3
        with self.job.stats.peak_memory(next(self.policy.parameters()).device) as memory, \
                routing.record("sampler") if routing is not None else nullcontext(), \
                routing.capturing_samples(routing.replay == "R3") if routing is not None else nullcontext():
            samples = self.sampler.generate([p.ids for p in mine], keys, turns)
        gen_time, gen_peak = time.perf_counter() - start, memory.peak

        messages, tools = turns.finish(samples.completions) if turns else (None, None)
        start = time.perf_counter()
        texts, totals, per_fn = score_completions(self.reward_fns, self.tp_group, self.tokenizer, self.stop_ids, mine,
                                                  samples.completions, messages)
        reward_time = time.perf_counter() - start
        masks = samples.tool_mask
        # the tokens in the loss: the model's own
        lengths = [sum(m) for m in masks] if masks is not None else [len(c) for c in samples.completions]
        mine_groups = {}
        for k, i in enumerate(positions):
            rows = slice(k * G, (k + 1) * G)
            mine_groups[i] = SampledGroup(
                self.prompts[prompt_ids[i]], totals[rows], lengths[rows], samples.truncated[rows],
                [r[rows] for r in per_fn], samples.completions[rows], samples.logprobs[rows], texts[rows],
                masks[rows] if masks is not None else None, tools[rows] if tools else None,
                messages[rows] if messages else None,
                samples.routed_experts[rows] if samples.routed_experts is not None else None)
        groups = dict(mine_groups)
        if self.dp_group is not None:
            # the rewards of every group; with filter_groups a kept group, padding-free a completion, may be trained
            # on another rank: everything
            whole = self.cfg.filter_groups or self.collate.padding_free
            share = {i: g if whole else g.figures() for i, g in mine_groups.items()}
            gathered = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, (share, gen_time, gen_peak, reward_time), group=self.dp_group)
            for rank_groups, *_ in gathered:
                for i, g in rank_groups.items():
                    groups.setdefault(i, g)
            gen_time, gen_peak = max(g[1] for g in gathered), max(g[2] for g in gathered)
            reward_time = max(g[3] for g in gathered)
        return [groups[i] for i in range(K)], gen_time, gen_peak, reward_time

    def _log(self, index: int, groups: list["SampledGroup"]) -> None:
        folder = Path(self.dump_folder) / "completions"
        folder.mkdir(parents=True, exist_ok=True)
        dp = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        with open(folder / f"batch-{index:06d}-dp{dp}.jsonl", "w") as f:
            for g in groups:
                for m in range(len(g.rewards)):
                    f.write(json.dumps(dict(
                        prompt=g.prompt.text, where=g.prompt.where,
                        completion=g.messages[m] if g.messages else g.texts[m],
                        completion_ids=g.completions[m], truncated=g.truncated[m], reward=g.rewards[m],
                        **({"tool_mask": g.tool_masks[m]} if g.tool_masks else {}),
                        rewards={fn.name: (None if r[m] != r[m] else r[m]) for fn, r in zip(self.reward_fns, g.fn_rewards)},
                    )) + "\n")

    def state_dict(self) -> dict[str, Any]:
        state = dict(batch_index=self.batch_index, iteration=self.iteration, microbatch=self.microbatch,
                     num_prompts=len(self.prompts), stream_pos=self.stream_pos)
        mid_batch = self.microbatch < self.plan.grad_accum or self.iteration + 1 < self.cfg.num_iterations
        if self.batch is not None and (self.iteration or self.microbatch) and mid_batch:
            state["batch"] = [dict(rec, rollouts=rec["rollouts"].to(torch.device("cpu"))) for rec in self.batch]
        if self.remote is not None:
            # the batches drawn by weights older than these: a resumed generator, given these, cannot draw them again
            for index in self.remote.unrepeatable(self.fetched, self.steps_done()):
                self.held[index] = self.remote.batch(index)
                self.fetched = index + 1
                self.stream_pos = self.held[index].stream_end
            state.update(fetched=self.fetched, stream_pos=self.stream_pos, held=dict(self.held))
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
        # a checkpoint of a version without filter_groups: batch b drew positions [b*K, (b+1)*K)
        begun = bool(self.iteration or self.microbatch)
        self.stream_pos = state_dict.get("stream_pos", (self.batch_index + begun) * self.plan.groups_per_step)
        self.fetched = state_dict.get("fetched", self.batch_index + begun)
        self.held = dict(state_dict.get("held", {}))
        for record in self.batch or []:  # earlier versions kept the replays' old log-probs in the rollouts
            record.setdefault("old_logprobs", record["rollouts"].old_logprobs)


def build_online_dataset(job_config, job: GRPOJob, tokenizer, encoder, batching):
    """The online dataset for [training] dataset_path's prompts; `batching` (plugin.data.loader) cuts batches as for files."""
    training, grpo, online, cfg = job_config.training, job_config.grpo, job_config.online, job_config.rollout_data
    G = online.num_generations
    if grpo.group_size not in (0, G):
        raise ValueError(f"[grpo] group_size = {grpo.group_size} differs from [online] num_generations = {G}; "
                         "set [grpo] group_size = 0 (or to the same value) in online mode")
    if online.use_vllm:
        from plugin.generation.vllm import engine_config

        engine_config(job_config)  # raises, at start-up, for a model vLLM cannot run
    stop_ids = resolve_stop_ids(online, tokenizer, encoder.vocab_size)
    reward_fns = load_reward_fns(online.reward_funcs, online.reward_weights, job_config)
    tools = build_tool_setup(online, encoder, tokenizer, stop_ids)
    prompts, skipped = load_prompts(training.dataset_path, encoder, tokenizer, fmt=cfg.format,
                                    max_new_tokens=online.max_new_tokens, on_error=cfg.on_error)
    if tools:
        tools.check_prompts(prompts, "[training] dataset_path")
    check_model_prompts(reward_fns, prompts, "[training] dataset_path")
    job.stats.skipped_rows = skipped
    job.online_stats = OnlineStats([f.name for f in reward_fns], online.filter_groups, tools=tools is not None)
    plan, collate = batching(G, len(prompts), "prompts", sampled=True)
    logger.info(
        f"Online GRPO: {len(prompts)} prompts from {training.dataset_path}, {plan.groups_per_step} per batch, "
        f"{G} completions each, up to {online.max_new_tokens} new tokens (stop ids {stop_ids}), "
        f"{online.num_iterations} optimizer step(s) per batch"
        + (f", equal-reward groups dropped (up to {online.max_num_gen_batches or 'unlimited'} generation rounds)"
           if online.filter_groups else "") + ", rewards: "
        + ", ".join(f"{f.weight:g} * {f.key.split('= ', 1)[1]}" for f in reward_fns)
    )
    dataset = OnlineDataset(prompts, plan, collate, job_config.debug.seed or 0, online, reward_fns, tokenizer,
                            collate.pad_id, stop_ids, grpo.temperature, job_config.job.dump_folder, job,
                            job.online_stats, job_config, tools)
    if online.generator_mode == "local":  # started now: they start up while the trainer builds its model
        from plugin.generation.remote import LocalGenerators

        dataset.generators = LocalGenerators(job_config)
    return dataset
