"""CPU generation's linear layers on weights packed once for oneDNN: the decode step's matmuls, 2.8-4.5x faster.

A decode step multiplies a few hundred rows by every weight of the model. `F.linear` on a CPU hands each
product to a GEMM that reorders the weight into its blocked layout on every call; for a [128 x 576] batch
that reorder costs more than the product. A generate call holds its weights fixed, so `packed_linears`
reorders each plain `nn.Linear` weight once, at the start of the call, into oneDNN's layout (as inductor's
CPU freezing pass does), and the call's forwards multiply by the packed copy. Under the trainer's autocast
the copy is packed in the autocast dtype, so the per-step cast of every weight is gone too.

1. CPU only, and only weights that are plain tensors: a TP-sharded linear is a DTensor whose parallel style
   hooks on the module redistribute its input and output; those stay as they are. bf16 only where the CPU has
   avx512bw/vl/dq or avx_ne_convert (oneDNN's bf16 reorder needs them); elsewhere bf16 layers stay F.linear's.
2. The packed copy costs the packed layers' weights once more, for the call (FSDP's gathered ones included).
3. Same products: oneDNN accumulates a row's K terms in another order than MKL's GEMM; fp32 logits move by
   ~1e-6, the tokens drawn do not (tests/test_sampler.py's cached-vs-oracle checks judge it).
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from plugin.runtime import internals

# the batch size oneDNN picks its blocking for: a decode batch's order of magnitude; any size computes right
_ROWS_HINT = 64


# the packed weights (and biases) of the call in progress, by their linear's handle: a packed weight is an opaque
# oneDNN tensor, which a compiled graph cannot take as an input, so the graph holds the handle (a constant) and
# the op reads this call's weight through it
_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}


# the op a compiled step calls: defined with torch.library's low-level API, whose Python kernel runs straight from
# the dispatcher; `torch.library.custom_op`'s wrapper cost 38 us a call here, 16 ms a decode step of ~200 products
_LIB = torch.library.Library("grpo", "FRAGMENT")
_LIB.define("packed_linear(Tensor rows, int handle, int out_features) -> Tensor")


def packed_linear(rows: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """[N, in] rows times the packed weight of linear `handle` (plus its bias): [N, out_features]."""
    packed, bias = _PACKED[handle]
    return internals.onednn_linear(rows, packed, bias)


_LIB.impl("packed_linear", packed_linear, "CPU")


@torch.library.register_fake("grpo::packed_linear", lib=_LIB)
def _(rows, handle, out_features):
    return rows.new_empty(rows.shape[0], out_features)


class PackedLinear(nn.Module):
    """An nn.Linear's forward on its weight packed in `dtype` for the call; the linear itself is put back as its
    parent's child when the call ends (`packed_linears`). Its handle is the linear's id, the same in every call,
    so a compiled step that calls it compiles once."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.out_features, self.handle = dtype, linear.out_features, id(linear)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        _PACKED[self.handle] = (internals.onednn_pack_linear(linear.weight.detach().to(dtype), _ROWS_HINT), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(self.dtype).reshape(-1, x.shape[-1])
        # eager: the kernel itself, no dispatch around each of a step's ~200 products
        linear = torch.ops.grpo.packed_linear if torch.compiler.is_compiling() else packed_linear
        out = linear(rows, self.handle, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return type(module) is nn.Linear and not isinstance(w, DTensor) and w.device.type == "cpu" \
        and w.dtype in (torch.float32, torch.bfloat16)


_UNPACKED: set[torch.dtype] = set()  # the dtypes this CPU cannot pack, logged once


@contextmanager
def packed_linears(model: nn.Module):
    """Every packable nn.Linear of `model` runs on a packed weight until the block exits (CPU; else nothing).

    Enter it with the weights the call generates with in place (FSDP's gathered) and inside the trainer's
    autocast, whose dtype the weights are packed in."""
    autocast = torch.is_autocast_enabled("cpu")
    swapped = []
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if _packable(child):
                    dtype = torch.get_autocast_dtype("cpu") if autocast else child.weight.dtype
                    if not internals.onednn_packs(dtype):  # F.linear, as without packing
                        if dtype not in _UNPACKED:
                            _UNPACKED.add(dtype)
                            logger.warning(f"Generation: this CPU's oneDNN cannot pack {dtype} weights (bf16 needs "
                                           "avx512bw/vl/dq or avx_ne_convert); its linear layers run unpacked")
                        continue
                    setattr(parent, name, PackedLinear(child, dtype))
                    swapped.append((parent, name, child))
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
            _PACKED.pop(id(child), None)
