"""GRPO statistics: accumulated by the model, the loss and the online dataset; reduced over DP ranks at log time."""

import time
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

from plugin import cpu

GIB = 1024**3

# sums reduced with SUM over the data-parallel ranks, the token ones kept on the device; peaks with MAX
_DEVICE_KEYS = ("tokens", "kl", "ratio", "clip_low", "clip_high", "entropy", "reward", "reward_sq", "adv", "adv_sq",
                "mismatch", "mismatch_out", "mismatch_tokens")
_HOST_KEYS = ("seqs", "ref_passes", "ref_time", "real_tokens", "computed_tokens")
_MAX_KEYS = ("ref_peak_mem", "ref_peak_growth")


class GRPOStats:
    """Running sums since the last log, filled by the model (reference pass) and the loss (tokens)."""

    def __init__(self, on_nonfinite: str = "raise", skipped_rows: int = 0):
        self.on_nonfinite = on_nonfinite  # [grpo] on_nonfinite, for plugin.runtime.guard
        # rows of the data file left out by [rollout_data] on_error = "skip", counted by the dataloader builder;
        # every rank reads the whole file, so no reduction
        self.skipped_rows = skipped_rows
        # the device's (active, reserved) peaks before each reference pass reset them, see
        # PeakKeepingMemoryMonitor, which clears them when torchtitan resets the peaks at log time
        self.device_peaks = (0, 0)
        self.nonfinite = None  # per plugin.runtime.guard.TERMS, counts since the last optimizer step, on the device
        self.skipped_steps = 0  # steps whose update plugin.runtime.guard dropped
        self.reset()

    def reset(self) -> None:
        self.sums = dict.fromkeys(_HOST_KEYS, 0.0)
        self.peaks = dict.fromkeys(_MAX_KEYS, 0.0)
        self.device_sums = None  # [len(_DEVICE_KEYS)] float64, on the batch's device
        self.ref_events = []  # CUDA (start, end) event pairs of reference passes, resolved in reduce()

    @torch.no_grad()
    def record_tokens(self, terms, mask: torch.Tensor, pred) -> None:
        """Add one microbatch's sums without a host sync: .item() would wait for the device every microbatch."""
        total = partial(torch.sum, dtype=torch.float64)
        rewards, adv = pred.rewards.double(), pred.advantages.double()
        mismatch = mismatch_out = mismatch_tokens = torch.zeros((), dtype=torch.float64, device=mask.device)
        if pred.sampler_logprobs is not None:
            # the sampler's log-probs against this pass's, on the completion tokens the sampler scored
            sampled = mask & ~pred.sampler_logprobs.isnan()
            diff = torch.where(sampled, pred.logprobs.detach() - pred.sampler_logprobs, 0.0).double()
            mismatch, mismatch_tokens = diff.abs().sum(), total(sampled)
            mismatch_out = total(sampled & ((diff.exp() - 1).abs() > 0.1))  # ratio outside [0.9, 1.1]
        row = torch.stack([
            total(mask), total(terms.kl), total(terms.ratio * mask), total(terms.clipped_low),
            total(terms.clipped_high), total(pred.entropy * mask),
            rewards.sum(), (rewards**2).sum(), adv.sum(), (adv**2).sum(), mismatch, mismatch_out, mismatch_tokens,
        ])
        self.device_sums = row if self.device_sums is None else self.device_sums + row
        self.sums["seqs"] += rewards.numel()

    def record_layout(self, real: int, computed: int) -> None:
        """One microbatch's real tokens (prompts and completions) and the tokens its passes compute on."""
        self.sums["real_tokens"] += real
        self.sums["computed_tokens"] += computed

    @torch.no_grad()
    def record_nonfinite(self, *terms: torch.Tensor | None) -> None:
        """Count NaN/inf entries of each of plugin.runtime.guard.TERMS, on the device (None: the term is absent)."""
        zero = torch.zeros((), dtype=torch.float64, device=terms[-1].device)
        row = torch.stack([zero if t is None else (~torch.isfinite(t)).sum(dtype=torch.float64) for t in terms])
        self.nonfinite = row if self.nonfinite is None else self.nonfinite + row

    def take_nonfinite(self, device: torch.device) -> torch.Tensor:
        counts, self.nonfinite = self.nonfinite, None
        return torch.zeros(4, dtype=torch.float64, device=device) if counts is None else counts.to(device)

    def _new_peak(self, device: torch.device):
        """Start a new allocator peak; (torch.cuda or plugin.cpu's stand-in, the memory allocated now)."""
        # torch.cuda's memory queries, or on the CPU plugin.cpu's answers to them (the process's RSS)
        mem = torch.cuda if device.type == "cuda" else cpu.device_module
        # the reset below would hide the step's peak so far from torchtitan's memory/max_* tags:
        # keep the (active, reserved) peaks its memory monitor reads
        stats = mem.memory_stats(device)
        peaks = stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
        self.device_peaks = tuple(map(max, self.device_peaks, peaks))
        mem.reset_peak_memory_stats(device)
        return mem, stats.get("allocated_bytes.all.current", 0)  # the reset leaves it as it is

    @contextmanager
    def peak_memory(self, device: torch.device):
        """Yields a namespace whose `peak` is, after the block, the allocator's peak bytes during it."""
        mem, _ = self._new_peak(device)
        out = SimpleNamespace(peak=0)
        yield out
        # the allocator's peak is a host-side counter: reading it does not synchronize
        out.peak = mem.memory_stats(device).get("allocated_bytes.all.peak", 0)

    @contextmanager
    def reference_pass(self, device: torch.device):
        """Time the reference scoring pass and record its peak memory (absolute and growth)."""
        mem, start_mem = self._new_peak(device)
        if device.type == "cuda":
            # events time the pass on the stream without synchronizing; reduce() reads them
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record(torch.cuda.current_stream(device))
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            events[1].record(torch.cuda.current_stream(device))
            self.ref_events.append(events)
        else:
            self.sums["ref_time"] += time.perf_counter() - start
        self.sums["ref_passes"] += 1
        peak = mem.memory_stats(device).get("allocated_bytes.all.peak", 0)
        self.peaks["ref_peak_mem"] = max(self.peaks["ref_peak_mem"], peak / GIB)
        self.peaks["ref_peak_growth"] = max(self.peaks["ref_peak_growth"], (peak - start_mem) / GIB)

    def reduce(self, group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
        """Metrics over all DP ranks; `group` None means a single DP rank."""
        if self.ref_events:
            self.ref_events[-1][1].synchronize()  # the stream runs in order: every earlier pass is done too
            self.sums["ref_time"] += sum(a.elapsed_time(b) for a, b in self.ref_events) / 1000
            self.ref_events = []
        f64 = dict(dtype=torch.float64, device=device)
        dev = torch.zeros(len(_DEVICE_KEYS), **f64) if self.device_sums is None else self.device_sums.to(device)
        sums = torch.cat([dev, torch.tensor([self.sums[k] for k in _HOST_KEYS], **f64)])
        peaks = torch.tensor([self.peaks[k] for k in _MAX_KEYS], **f64)
        if group is not None:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        values = torch.cat([sums, peaks]).tolist()  # one copy to the host per logged step
        s = dict(zip(_DEVICE_KEYS + _HOST_KEYS, values))
        p = dict(zip(_MAX_KEYS, values[len(s):]))
        tokens, seqs = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
        reward_mean, adv_mean = s["reward"] / seqs, s["adv"] / seqs
        out = {
            "grpo/kl": s["kl"] / tokens,
            "grpo/ratio_mean": s["ratio"] / tokens,
            "grpo/clip_fraction_low": s["clip_low"] / tokens,
            "grpo/clip_fraction_high": s["clip_high"] / tokens,
            "grpo/clip_fraction": (s["clip_low"] + s["clip_high"]) / tokens,
            "grpo/entropy": s["entropy"] / tokens,
            "grpo/reward_mean": reward_mean,
            "grpo/reward_std": max(s["reward_sq"] / seqs - reward_mean**2, 0.0) ** 0.5,
            "grpo/advantage_mean": adv_mean,
            "grpo/advantage_std": max(s["adv_sq"] / seqs - adv_mean**2, 0.0) ** 0.5,
            "grpo/completion_length_mean": s["tokens"] / seqs,
            "grpo/skipped_rows": float(self.skipped_rows),
            "grpo/skipped_steps": float(self.skipped_steps),
        }
        if s["computed_tokens"]:
            # padding-free: ~1; padded to seq_len: what the passes do not waste. torchtitan's tps and MFU count computed tokens
            out["grpo/real_token_fraction"] = s["real_tokens"] / s["computed_tokens"]
        if s["mismatch_tokens"]:
            out["online/logprob_mismatch"] = s["mismatch"] / s["mismatch_tokens"]
            out["online/logprob_mismatch_ratio_outside_10pct"] = s["mismatch_out"] / s["mismatch_tokens"]
        if s["ref_passes"]:
            out["grpo/ref_time(s)"] = s["ref_time"] / s["ref_passes"]
            out["grpo/ref_peak_memory(GiB)"] = p["ref_peak_mem"]
            out["grpo/ref_peak_growth(GiB)"] = p["ref_peak_growth"]
        return out


class OnlineStats:
    """Generation and reward figures of the sampled batches since the last log.

    plugin.data.online gathers each batch's figures from every DP rank before recording them, so
    every rank holds the same global values and nothing is reduced at log time.
    """

    def __init__(self, reward_names: list[str], filter_groups: bool = False, tools: bool = False):
        self.reward_names, self.filter_groups, self.tools = reward_names, filter_groups, tools
        self.since = time.perf_counter()  # wall time since the last log: the share's denominator
        self.kv_cache_bytes = 0  # the built-in engine's KV cache on this rank (allocated once; all ranks alike)
        self._clear()

    def _clear(self) -> None:
        self.batches, self.gen_time, self.tokens, self.seqs, self.truncated, self.len_max = 0, 0.0, 0, 0, 0, 0
        self.reward_time = 0.0
        self.groups_dropped, self.extra_rounds = 0, 0
        self.gen_peak = 0
        self.calls, self.failures, self.turns = 0, 0, 0
        self.syncs, self.sync_time, self.sync_bytes, self.sync_gathered = 0, 0.0, 0, 0
        self.prompt_tokens, self.cached_tokens = 0, 0
        self.rewards: list[list[float]] = [[] for _ in self.reward_names]
        # a separate generator: each trained batch's version lag, the generators' version, the trainer's waits for
        # batches, the generators' idle shares; the pushes; batches dropped as too stale
        self.lags, self.generator_version, self.waits, self.idle = [], -1, 0.0, []
        self.pushes, self.push_time, self.push_bytes, self.stale_dropped = 0, 0.0, 0, 0

    def record(self, gen_time: float, gen_peak: int, lengths: list[int], truncated: list[bool],
               rewards: list[list[float]], tools: list | None = None, reward_time: float = 0.0) -> None:
        """One sampled global batch: the slowest rank's generation seconds, the largest rank's peak memory
        during generation (bytes), and every completion's figures: its tokens in the loss (a multi-turn
        one's tool turns are not), and with tools its ToolFigures (plugin.data.turns); the slowest rank's
        seconds scoring it (reward functions and models)."""
        self.reward_time += reward_time
        for f in tools or []:
            self.calls, self.failures, self.turns = self.calls + f.calls, self.failures + f.failures, self.turns + f.turns
        self.batches += 1
        self.gen_peak = max(self.gen_peak, gen_peak)
        self.gen_time += gen_time
        self.tokens += sum(lengths)
        self.seqs += len(lengths)
        self.truncated += sum(truncated)
        self.len_max = max([self.len_max, *lengths])
        for acc, values in zip(self.rewards, rewards):
            acc.extend(v for v in values if v == v)  # a function's None (NaN) rewards do not apply

    def record_sync(self, seconds: float, nbytes: int, gathered: int = 0) -> None:
        """[online] use_vllm: one load of the policy's weights into this rank's engine (every rank loads the same):
        its seconds, the bytes handed to the engine, and the bytes of them collectives gathered."""
        self.syncs, self.sync_time = self.syncs + 1, self.sync_time + seconds
        self.sync_bytes, self.sync_gathered = self.sync_bytes + nbytes, self.sync_gathered + gathered

    def record_prefix(self, cached: int, prompt: int) -> None:
        """[online] use_vllm: one generate call's prompt tokens, and those its prefix cache held (this rank's engine)."""
        self.cached_tokens, self.prompt_tokens = self.cached_tokens + cached, self.prompt_tokens + prompt

    def record_async(self, lag: int, version: int, wait: float, idle_share: float) -> None:
        """A separate generator's batch: versions between its weights and the step that trains it, the version that
        drew it, the seconds the trainer waited for it, the generator's idle share while it was drawn."""
        self.lags.append(lag)
        self.generator_version = max(self.generator_version, version)
        self.waits += wait
        self.idle.append(idle_share)

    def record_push(self, seconds: float, nbytes: int) -> None:
        """One push of the weights to a separate generator (bytes sent by the trainer's rank 0)."""
        self.pushes, self.push_time, self.push_bytes = self.pushes + 1, self.push_time + seconds, self.push_bytes + nbytes

    def record_stale(self, batches: int) -> None:
        self.stale_dropped += batches

    def record_filter(self, groups_dropped: int, extra_rounds: int) -> None:
        """[online] filter_groups: one batch's equal-reward groups left out, and its rounds beyond the first."""
        self.groups_dropped += groups_dropped
        self.extra_rounds += extra_rounds

    def take(self) -> dict[str, float]:
        now = time.perf_counter()
        wall, self.since = now - self.since, now
        out = {}
        if self.pushes:  # per push
            out["async/push_time(s)"] = self.push_time / self.pushes
            out["async/push_GiB"] = self.push_bytes / self.pushes / GIB
        if self.lags or self.pushes:
            out["async/stale_batches_dropped"] = float(self.stale_dropped)
        if self.lags:
            out.update({"async/staleness_mean": sum(self.lags) / len(self.lags),
                        "async/staleness_max": float(max(self.lags)),
                        "async/generator_version": float(self.generator_version),
                        "async/trainer_wait(s)": self.waits / len(self.lags),
                        "async/trainer_wait_share": self.waits / wall if wall > 0 else 0.0,
                        "async/generator_idle_share": sum(self.idle) / len(self.idle)})
        if not self.batches:  # a replay-only stretch: nothing was sampled
            self._clear()
            return out
        out |= {
            "online/generation_time(s)": self.gen_time / self.batches,
            "online/generation_share": self.gen_time / wall if wall > 0 else 0.0,
            # next to torchtitan's memory/max_active(GiB), the training step's
            "online/generation_peak_memory(GiB)": self.gen_peak / GIB,
            "online/kv_cache_GiB": self.kv_cache_bytes / GIB,
            "online/generated_tokens_per_s": self.tokens / self.gen_time if self.gen_time > 0 else 0.0,
            "online/reward_time(s)": self.reward_time / self.batches,
            "online/reward_share": self.reward_time / wall if wall > 0 else 0.0,
            "online/completion_length_mean": self.tokens / self.seqs,
            "online/completion_length_max": float(self.len_max),
            "online/truncated_fraction": self.truncated / self.seqs,
        }
        if self.tools:  # TRL's names: calls per completion, and the share of calls that failed
            out["tools/call_frequency"] = self.calls / self.seqs
            out["tools/failure_frequency"] = self.failures / self.calls if self.calls else 0.0
            out["tools/turns_mean"] = self.turns / self.seqs  # assistant turns per completion
        if self.syncs:  # per sync; generation_time includes them
            out["online/weight_sync_time(s)"] = self.sync_time / self.syncs
            out["online/weight_sync_GiB"] = self.sync_bytes / self.syncs / GIB
            out["online/weight_sync_gathered_GiB"] = self.sync_gathered / self.syncs / GIB
            out["online/weight_sync_share"] = self.sync_time / wall if wall > 0 else 0.0
        if self.prompt_tokens:  # the engine's prompts (a tool round's rows included) its prefix cache held
            out["online/vllm_prefix_cache_hit_rate"] = self.cached_tokens / self.prompt_tokens
        if self.filter_groups:  # per sampled batch
            out["online/groups_dropped"] = self.groups_dropped / self.batches
            out["online/extra_rounds"] = self.extra_rounds / self.batches
        for name, values in zip(self.reward_names, self.rewards):
            if values:
                t = torch.tensor(values, dtype=torch.float64)
                out[f"online/reward/{name}_mean"] = t.mean().item()
                out[f"online/reward/{name}_std"] = t.std(unbiased=False).item()
        self._clear()
        return out
