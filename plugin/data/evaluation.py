"""Evaluation during training: held-out prompts sampled from the policy and scored by the run's reward functions.

It is torchtitan's validator of the GRPO TrainSpec (`build_validator_fn`), so torchtitan's `[validation]`
keys say when and on what: `enable`, `dataset_path` (a prompt file, the rows of an online one),
`freq` (after step 1 and every freq steps; here also after the last), `local_batch_size` (prompts per
rank and generate call) and `steps` (calls per evaluation; -1 = the whole file). `[online]` says how:
num_generations_eval completions per prompt at eval_temperature (0 = greedy), the sampler of online
mode with its max_new_tokens and stop ids. Off, nothing is built: torchtitan builds no validator.

Each evaluation logs eval/* to the run's metric loggers (TensorBoard) at the step it follows: the mean
reward, each function's mean, the share of completions with full reward, lengths and time.

Simplifications:
1. Every evaluation draws with the same keys, so two evaluations differ by the policy only.
2. "Full reward": every reward function that applies gave at least 1, the full mark of a 0-to-1 reward.
3. No evaluation before the first step: torchtitan calls a validator after steps only.
"""

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.validate import BaseValidator
from torchtitan.tools.logging import logger

from plugin.data.loader import build_encoder
from plugin.data.online import online_sampler, sample_key
from plugin.data.prompts import load_prompts, resolve_stop_ids
from plugin.data.rewards import check_model_prompts, load_reward_fns, score_completions
from plugin.data.turns import build_tool_setup
from plugin.job import GRPOJob

EVAL_BATCH = -1  # the batch index of sample_key for evaluations: no training batch has it


class GRPOEvaluator(BaseValidator):
    """Samples this rank's share of the held-out prompts, scores them, gathers over DP and logs eval/* at the step."""

    def __init__(self, job_config, prompts, reward_fns, tokenizer, stop_ids: list[int], pad_id: int, dp_rank: int,
                 dp_world_size: int, parallel_dims, metrics_processor, tools=None):
        super().__init__(job_config)
        self.tools = tools  # [online] tools (plugin.data.turns.ToolSetup): the same tool turns as training
        self.prompts, self.reward_fns, self.tokenizer = prompts, reward_fns, tokenizer
        self.stop_ids, self.pad_id, self.dp_rank, self.dp_world_size = stop_ids, pad_id, dp_rank, dp_world_size
        self.metrics_processor = metrics_processor
        self.parallel_dims = parallel_dims
        self.dp_group = parallel_dims.get_optional_mesh("batch").get_group() if parallel_dims.dp_enabled else None
        tp = parallel_dims.tp if parallel_dims.tp_enabled else 1
        self.writes_log = tp == 1 or parallel_dims.get_optional_mesh("tp").get_local_rank() == 0  # TP peers agree
        # TP peers sample the same completions: each scores a share of them (score_once)
        self.tp_group = parallel_dims.get_optional_mesh("tp").get_group() if tp > 1 else None
        self.sampler, self.model = None, None
        v = job_config.validation
        # prompts per evaluation: the first steps * local_batch_size * dp ranks, or all with steps = -1
        self.count = len(prompts) if v.steps == -1 else min(len(prompts), v.steps * v.local_batch_size * dp_world_size)

    def should_validate(self, step: int) -> bool:
        return super().should_validate(step) or step == self.job_config.training.steps

    def _rounds(self) -> list[list[int]]:
        """This rank's prompt indices per generate call; every rank makes the same number of calls."""
        b = self.job_config.validation.local_batch_size
        return [list(range(start + self.dp_rank * b, min(start + (self.dp_rank + 1) * b, self.count)))
                for start in range(0, self.count, b * self.dp_world_size)]

    @torch.no_grad()
    def validate(self, model_parts, step: int) -> None:
        online = self.job_config.online
        remote = GRPOJob.of(self.job_config).remote
        if remote is not None:  # a separate generator evaluates, with the weights of this step (pushed now)
            metrics = remote.evaluation(step)
            self.metrics_processor.logger.log(metrics, step)
            logger.info(f"Evaluation after step {step} (by the generators): reward {metrics['eval/reward_mean']:.4f}, "
                        f"full reward {metrics['eval/full_reward_share']:.1%} ({metrics['eval/time(s)']:.1f} s)")
            return
        if self.model is not model_parts[0]:
            self.model = model_parts[0]
            # eval_temperature 0 takes the sampler's greedy path: the argmax, without noise
            self.sampler = online_sampler(self.model, self.job_config, self.parallel_dims, stop_ids=self.stop_ids,
                                          temperature=online.eval_temperature, pad_id=self.pad_id)
        G, seed = online.num_generations_eval, self.job_config.debug.seed or 0
        start = time.perf_counter()
        mine, completions, truncated, messages, tools = [], [], [], [], []
        for indices in self._rounds():
            call = [i for i in indices for _ in range(G)]
            turns = self.tools.turns([self.prompts[i] for i in call], self.tp_group) if self.tools else None
            samples = self.sampler.generate([self.prompts[i].ids for i in call],
                                            [sample_key(seed, EVAL_BATCH, i, m) for i in indices for m in range(G)],
                                            turns)
            mine += call
            completions += samples.completions
            truncated += samples.truncated
            if turns:
                conversations, figures = turns.finish(samples.completions)
                messages += conversations
                tools += [(f.calls, f.failures) for f in figures]
        prompts = [self.prompts[i] for i in mine]
        texts, totals, per_fn = score_completions(self.reward_fns, self.tp_group, self.tokenizer, self.stop_ids,
                                                  prompts, completions, messages if self.tools else None)
        part = [totals, [len(c) for c in completions], truncated, tools, *per_fn]
        gathered = [part]
        if self.dp_group is not None:
            gathered = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, part, group=self.dp_group)
        totals_all, lengths, truncs, tools_all, *fn_all = ([v for g in gathered for v in g[k]] for k in range(len(part)))
        metrics = self._metrics(totals_all, lengths, truncs, fn_all, time.perf_counter() - start)
        if self.tools:
            calls = sum(c for c, _ in tools_all)
            metrics["eval/tools/call_frequency"] = calls / len(tools_all)
            metrics["eval/tools/failure_frequency"] = sum(f for _, f in tools_all) / calls if calls else 0.0
        self.metrics_processor.logger.log(metrics, step)
        logger.info(f"Evaluation after step {step}: {len(totals_all)} completions of {len(totals_all) // G} prompts, "
                    f"reward {metrics['eval/reward_mean']:.4f}, full reward {metrics['eval/full_reward_share']:.1%} "
                    f"({metrics['eval/time(s)']:.1f} s)")
        if online.eval_log_completions and self.writes_log:
            self._log(step, prompts, messages or texts, completions, truncated, totals, per_fn)

    def _metrics(self, totals, lengths, truncated, per_fn, seconds: float) -> dict[str, float]:
        n = len(totals)
        out = {"eval/reward_mean": sum(totals) / n,
               "eval/completion_length_mean": sum(lengths) / n,
               "eval/truncated_share": sum(truncated) / n,
               "eval/time(s)": seconds}
        full = [True] * n
        for f, rewards in zip(self.reward_fns, per_fn):
            applied = [r for r in rewards if not math.isnan(r)]
            if applied:
                out[f"eval/reward/{f.name}_mean"] = sum(applied) / len(applied)
            full = [ok and (math.isnan(r) or r >= 1) for ok, r in zip(full, rewards)]
        out["eval/full_reward_share"] = sum(full) / n
        return out

    def _log(self, step: int, prompts, texts, completions, truncated, totals, per_fn) -> None:
        folder = Path(self.job_config.job.dump_folder) / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step-{step:06d}-dp{self.dp_rank}.jsonl", "w") as f:
            for s, p in enumerate(prompts):
                f.write(json.dumps(dict(
                    prompt=p.text, where=p.where, completion=texts[s], completion_ids=completions[s],
                    truncated=truncated[s], reward=totals[s],
                    rewards={fn.name: (None if r[s] != r[s] else r[s]) for fn, r in zip(self.reward_fns, per_fn)},
                )) + "\n")


def build_grpo_evaluator(job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, metrics_processor,
                         **kwargs) -> GRPOEvaluator:
    """torchtitan's build_validator_fn: the held-out prompts of [validation] dataset_path, checked at start-up."""
    v, online = job_config.validation, job_config.online
    encoder = build_encoder(job_config, tokenizer)
    prompts, _ = load_prompts(v.dataset_path, encoder, tokenizer, fmt=job_config.rollout_data.format,
                              max_new_tokens=online.max_new_tokens, on_error=job_config.rollout_data.on_error,
                              key="[validation] dataset_path")
    stop_ids = resolve_stop_ids(online, tokenizer, encoder.vocab_size)
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    tools = build_tool_setup(online, encoder, tokenizer, stop_ids)
    if tools:
        tools.check_prompts(prompts, "[validation] dataset_path")
    reward_fns = load_reward_fns(online.reward_funcs, online.reward_weights, job_config)
    check_model_prompts(reward_fns, prompts, "[validation] dataset_path")
    evaluator = GRPOEvaluator(job_config, prompts, reward_fns,
                              tokenizer, stop_ids, pad_id, dp_rank, dp_world_size, parallel_dims, metrics_processor,
                              tools)
    logger.info(f"Evaluation: {evaluator.count} of {len(prompts)} prompts from {v.dataset_path} "
                f"in {len(evaluator._rounds())} generate call(s) per rank, {online.num_generations_eval} completion(s) each at "
                f"{'greedy' if online.eval_temperature == 0 else f'temperature {online.eval_temperature:g}'}, after step 1, "
                f"every {v.freq} steps and the last")
    return evaluator
