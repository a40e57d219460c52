"""The GRPO metrics processor: torchtitan's, plus the job's grpo/* and online/* statistics (plugin.runtime.stats) and an
MoE policy's moe/* (plugin.model.moe)."""

import sys
import time

import torch
import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor

from plugin import cpu
from plugin.job import GRPOJob
from plugin.runtime.export import complete_hf_export
from plugin.runtime.stats import GIB, GRPOStats


class PeakKeepingMemoryMonitor:
    """torchtitan's device memory monitor, with the peaks that reference passes reset folded back in."""

    def __init__(self, monitor, stats: GRPOStats):
        self._monitor, self._stats = monitor, stats

    def __getattr__(self, name):
        return getattr(self._monitor, name)

    def get_peak_stats(self):
        mem = self._monitor.get_peak_stats()
        stats = self._stats
        active = max(mem.max_active_gib, stats.device_peaks[0] / GIB)
        reserved = max(mem.max_reserved_gib, stats.device_peaks[1] / GIB)
        pct = 100 / self._monitor.device_capacity_gib
        return mem._replace(max_active_gib=active, max_active_pct=active * pct,
                            max_reserved_gib=reserved, max_reserved_pct=reserved * pct)

    def reset_peak_stats(self):
        self._monitor.reset_peak_stats()
        self._stats.device_peaks = (0, 0)


class GRPOMetricsProcessor(MetricsProcessor):
    """torchtitan's processor plus the grpo/* and online/* metrics, so they land in the same TensorBoard run."""

    def __init__(self, job_config, parallel_dims, tag=None, *, job: GRPOJob):
        super().__init__(job_config, parallel_dims, tag)
        self.job, self.stats, self.online = job, job.stats, job.online_stats
        self.device_memory_monitor = PeakKeepingMemoryMonitor(self.device_memory_monitor, job.stats)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        # TP/CP ranks hold copies of the same batch: reduce over the data-parallel ranks only
        mesh = self.parallel_dims.get_optional_mesh("batch") if self.parallel_dims.dp_enabled else None
        device = torch.device(self.device_memory_monitor.device)
        group = mesh.get_group() if mesh else None
        extra = self.stats.reduce(group, device)
        self.stats.reset()
        routing = getattr(self.job.policy, "routing", None)
        if routing is not None:  # an MoE policy: moe/* (plugin.model.moe)
            extra.update(routing.take(group))
        if self.online is not None:
            extra.update(self.online.take())
        if "grpo/real_token_fraction" in extra:
            # torchtitan's tps counts every position of the labels, padding included; the same per device, real only
            elapsed = (time.perf_counter() - self.time_last_log) * self.parallel_dims.non_data_parallel_size
            extra["grpo/real_tps"] = self.ntokens_since_last_log * extra["grpo/real_token_fraction"] / elapsed
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **extra})

    def close(self):
        # Trainer.close closes the checkpointer first: a last_save_in_hf export is complete on disk here
        complete_hf_export(self.job_config)
        super().close()
        leave_together()
        if getattr(self.job, "remote", None) is not None:  # stop the generators (and wait for local ones)
            self.job.remote.close()
            self.job.remote = None
        if getattr(self.job, "vllm", None) is not None:  # [online] use_vllm: its teardown destroys the process groups
            self.job.vllm.close()
            self.job.vllm = None
        if sys.exc_info()[1] is None:
            cpu.exit_before_shutdown()  # on CPU, gloo's threads can abort the interpreter's shutdown


def leave_together() -> None:
    """After a run that ended well, every rank waits for the others before torchtitan tears the process groups down.

    torchtitan's main lets rank 0 sleep 2 s after the last step while the other ranks destroy their
    groups and exit at once. CI (2 loaded CPU cores, gloo) has seen such a rank abort there, rarely,
    after its work was done (SIGABRT), as the in-process test ranks did (tests/conftest.py). The
    barrier's round trip gives gloo's threads time to finish, and the ranks leave together; a thread
    that still asks for the GIL in the interpreter's shutdown aborts the rank even so, which
    plugin.cpu.exit_before_shutdown prevents (docs/reliability.md, "The end of a run").
    Trainer.close also runs while an error propagates; a peer may be gone then, so no barrier.
    """
    if dist.is_initialized() and sys.exc_info()[1] is None:
        dist.barrier()


def build_grpo_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    job = GRPOJob.of(job_config)
    return GRPOMetricsProcessor(job_config, parallel_dims, tag, job=job)
