"""What stops a run rather than let it train on garbage: a checkpoint it cannot resume from, and
non-finite values, checked once per step before the optimizer applies it.

The loss records, per microbatch and on the device, how many advantages, reference and policy
log-probs and per-token losses are NaN or infinite (GRPOStats.record_nonfinite). Before the
optimizer step, those counts and the gradients' norm are checked with one all-reduce: the run
stops with the term and the step, or with [grpo] on_nonfinite = "skip" the step's update is
dropped and counted (grpo/skipped_steps).
"""

import os
import re

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

# what GRPOStats.record_nonfinite counts, in the order data flows, then the gradients
TERMS = ("advantages", "reference log-probs", "policy log-probs", "loss")


class NonFiniteError(RuntimeError):
    """A non-finite value reached the update; the message names the term and the step."""


def nonfinite_terms(stats, grads: list[torch.Tensor]) -> list[str]:
    """The TERMS (and "gradients") with a NaN/inf since the last step on any rank: one all-reduce, every rank agrees."""
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    counts = stats.take_nonfinite(grad_norm.device)
    flags = torch.cat([counts, (~torch.isfinite(grad_norm)).reshape(1).to(counts)])
    if dist.is_initialized():  # data-parallel ranks hold other batches
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [term for term, flag in zip(TERMS + ("gradients",), flags.tolist()) if flag > 0]


def refuse_step(bad: list[str], step: int, stats) -> None:
    """Raise, or with [grpo] on_nonfinite = "skip" count and log, a step whose update is not applied."""
    where = f"step {step}: non-finite {', '.join(bad)} (NaN or infinite)"
    if stats.on_nonfinite == "raise":
        raise NonFiniteError(f"{where}; the update was not applied. Set [grpo] on_nonfinite = \"skip\" to drop "
                             "such steps and go on (counted in grpo/skipped_steps)")
    stats.skipped_steps += 1
    logger.warning(f"{where}: the step's update is dropped ([grpo] on_nonfinite = 'skip'); "
                   f"{stats.skipped_steps} skipped so far")


def check_resume_checkpoint(job_config) -> None:
    """Stop at start-up, naming the folder, if torchtitan would resume or start from a checkpoint it cannot load.

    torchtitan resumes from the latest step folder of [checkpoint] folder (or load_step). Its
    last save is model-only by default, and DCP then fails deep inside the load with "Missing
    key in checkpoint state_dict: dataloader.dp_rank_0"; a truncated file fails mid-load.
    Reading the folder's metadata here touches nothing in it.
    """
    ckpt = job_config.checkpoint
    folder = os.path.join(job_config.job.dump_folder, ckpt.folder)
    if not ckpt.enable:
        return
    if not os.path.isdir(folder):  # a first run; torchtitan's error for a wrong initial_load_path names no path
        if ckpt.initial_load_path and not os.path.isdir(ckpt.initial_load_path):
            raise ValueError(f"[checkpoint] initial_load_path = {ckpt.initial_load_path!r} is not a folder (from "
                             f"{os.getcwd()}): run the job whose weights this one starts from first, or fix the path")
        return
    steps = {int(m.group(1)): name for name in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))}
    loadable = [n for n, name in steps.items() if os.path.isfile(os.path.join(folder, name, ".metadata"))
                or os.path.isfile(os.path.join(folder, name, "model.safetensors.index.json"))]
    step = ckpt.load_step if ckpt.load_step != -1 else max(loadable, default=-1)
    if step <= 0 or step not in steps:  # nothing to resume, a seed checkpoint (step 0), or torchtitan's own error
        return
    path = os.path.join(folder, steps[step])
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001  any failure to read means the same thing to the user
        if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            metadata = None  # an HF export ([checkpoint] last_save_in_hf): the model alone
        else:
            raise RuntimeError(f"{path}: the checkpoint's .metadata cannot be read ({type(e).__name__}: {e}); "
                               "it is truncated or corrupted. Resume from an earlier step with "
                               "[checkpoint] load_step, or move this folder away") from None
    if metadata is None or not any(k.startswith("dataloader") for k in metadata.state_dict_metadata):
        full = sorted(n for n in loadable if n != step and n > 0)
        raise RuntimeError(
            f"{path} holds only the model (torchtitan saves its last step model-only while [checkpoint] "
            "last_save_model_only = true), so training cannot resume from it. Resume from a full step with "
            f"[checkpoint] load_step ({'full steps here: ' + str(full) if full else 'none is here'}); keep "
            "last_save_model_only = false for runs you will resume; or start a new run from these weights "
            f"with [checkpoint] initial_load_path = {path!r} and a new [job] dump_folder"
        )
    for item in metadata.storage_data.values():  # a truncated or missing data file
        file = os.path.join(path, item.relative_path)
        if not os.path.isfile(file) or os.path.getsize(file) < item.offset + item.length:
            raise RuntimeError(f"{path}: {item.relative_path} is missing or truncated; the checkpoint is incomplete. "
                               "Resume from an earlier step with [checkpoint] load_step, or move this folder away")


def check_restart_launch() -> None:
    """Warn when torchrun may restart the workers on its shared store, where a restart may never reconnect.

    Since torch 2.5 the workers share the torchrun agent's TCPStore, kept across restarts with the
    killed attempt's keys: a restarted rank can read a dead peer's address (gloo's connectFullMesh
    is refused or hangs; NCCL gets a stale id), pytorch/pytorch#135712.
    """
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        logger.warning("torchrun --max-restarts is on, but the workers share the agent's TCPStore: a restart may fail "
                       "to reconnect. Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/reliability.md)")
