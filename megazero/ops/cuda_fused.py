"""megazero's CUDA kernels as torch custom ops: the routing rule, lazy registration, and the
causal softmax (``megazero.ops._fused_cuda``, built from ``csrc/fused/*.cu`` + ``fused_cuda.cc``
by setup.py where the build has a CUDA torch and a GPU or ``TORCH_CUDA_ARCH_LIST``).

Every fused op of the transformer layer has a CUDA face (``cuda_elementwise``: bias-GELU,
bias-dropout-add, bias-SwiGLU and the bias gradients' column sum; ``cuda_rope_norm``: RoPE,
RMSNorm; ``cuda_cross_entropy``: the vocab-parallel cross entropy; here: the causal softmax).
Each is a ``torch.library`` custom op in the ``megazero`` namespace with a fake implementation
that allocates what the CUDA one allocates, and an autograd formula that calls the backward op.
So one chain is one dispatched op: one kernel on a GPU, one launch in the dry run's counter
(``megazero.dryrun.launches``), and an opaque node for ``torch.compile`` (no graph break).

Routing (:func:`cuda_route`): a CUDA tensor goes to the custom ops when the extension is built,
and when it is a fake tensor (``FakeTensorMode``: the dry run counts what a GPU host, where
``pip install -e .`` builds the kernels, would launch); otherwise the op's face runs its eager
PyTorch formula, as before. Ops are registered with torch on first use (:func:`defined`), never
at import; :func:`register_cuda_ops` registers them all, for callers that compile before the
first eager call (under ``torch.compile`` nothing is registered, and an op not yet registered
is traced as its eager formula).
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

NAMESPACE = "megazero"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cuda_route(*tensors, needs_kernels: bool = True) -> bool:
    """Whether these tensors (None entries skipped) go to megazero's CUDA custom ops: all on
    CUDA in a dtype the kernels take, and either fake (the dry run) or the extension built
    (not asked with ``needs_kernels=False``: an op over ATen's kernels)."""
    first = None
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda" or t.dtype not in DTYPES:
            return False
        first = t if first is None else first
    if first is None:
        return False
    return not needs_kernels or isinstance(first, FakeTensor) or fc.cuda_extension() is not None


def kernels():
    """The compiled module, for the custom ops' CUDA implementations."""
    ext = fc.cuda_extension()
    if ext is None:
        raise RuntimeError("megazero's CUDA kernels are not built (megazero.ops._fused_cuda); "
                           "`python -m megazero.ops` says why")
    return ext


def defined(probe: str, define) -> bool:
    """Whether the ops that ``define`` registers (``probe`` among them) exist, registering them
    first outside ``torch.compile`` (``define`` is cached: it runs once per process)."""
    if torch.compiler.is_compiling():
        return hasattr(torch.ops.megazero, probe)
    define()
    return True


def op_name(name: str) -> str:
    return f"{NAMESPACE}::{name}"


# ----------------------------------------------------------------------------- causal softmax
@functools.cache
def define_ops() -> None:
    """Register megazero::causal_softmax and its backward."""

    @torch.library.custom_op(op_name("causal_softmax"), mutates_args=(), device_types="cuda")
    def causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.empty_like(scores)
        kernels().softmax_fwd(scores, scale, y)
        return y

    @causal_softmax.register_fake
    def _(scores, scale):
        return torch.empty_like(scores)

    @torch.library.custom_op(op_name("causal_softmax_backward"), mutates_args=(),
                             device_types="cuda")
    def causal_softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        dx = torch.empty_like(y)
        kernels().softmax_bwd(dy, y, scale, dx)
        return dx

    @causal_softmax_backward.register_fake
    def _(dy, y, scale):
        return torch.empty_like(y)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.scale = inputs[1]

    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return torch.ops.megazero.causal_softmax_backward(dy.contiguous(), y, ctx.scale), None

    causal_softmax.register_autograd(backward, setup_context=setup)


def softmax_available(scores) -> bool:
    """True when the causal-softmax op takes ``scores`` [..., sq, sk] (CUDA, built or fake)."""
    return scores.numel() > 0 and cuda_route(scores) and defined("causal_softmax", define_ops)


def scaled_upper_triang_masked_softmax(scores, scale: float) -> torch.Tensor:
    """Causal softmax(scale * scores), one kernel each way (after :func:`softmax_available`).
    Forward: y, saved. Backward: dx = scale * y * (dy - sum(dy * y))."""
    return torch.ops.megazero.causal_softmax(scores.contiguous(), float(scale))


register_op("cuda_causal_softmax", fc.CUDA_EXTENSION,
            "scaled upper-triangular masked softmax fwd/bwd (CUDA)", simd_level_fn=lambda: "cuda")
