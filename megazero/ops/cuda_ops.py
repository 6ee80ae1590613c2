"""All of megazero's CUDA custom ops at once: registration before ``torch.compile``, and how many
kernels each launches.

The ops register themselves on first eager use (``cuda_fused.defined``); code that compiles a
model before running it eagerly calls :func:`register_cuda_ops` first, else the compiled graph
traces each op's eager formula instead (see ``cuda_fused``).

:data:`KERNELS_PER_CALL` lists the ops that launch more than one kernel per call (every other
``megazero::`` op launches exactly one), in the dry-run counter's naming
(``megazero.dryrun.launches.MULTI_KERNEL``): the RMSNorm backward is ATen's, which launches an
input-gradient and a weight-gradient kernel. tests/test_ops_cuda.py checks every count against
torch.profiler on a GPU.
"""

from __future__ import annotations

from megazero.ops import cuda_cross_entropy, cuda_elementwise, cuda_fused, cuda_rope_norm
from megazero.ops import fused_common as fc

KERNELS_PER_CALL = {"megazero.rms_norm_backward.default": 2}

# every op of the namespace: forward ops, then the ones their autograd formulas call
OPS = ("bias_gelu", "bias_dropout_add", "bias_swiglu", "rope", "rms_norm", "causal_softmax",
       "vocab_ce_forward", "vocab_ce_stats", "vocab_ce_rescale", "vocab_ce_loss",
       "bias_gelu_backward", "bias_dropout_add_backward", "bias_swiglu_backward",
       "column_sum", "rope_backward", "rms_norm_backward", "causal_softmax_backward",
       "vocab_ce_backward")


def register_cuda_ops() -> bool:
    """Register every megazero CUDA op with torch (idempotent) and load the extension; True
    when the kernels are built (the ops then run on a GPU; fake tensors take them either way)."""
    for define in (cuda_fused.define_ops, cuda_elementwise.define_ops, cuda_rope_norm.define_ops,
                   cuda_cross_entropy.define_ops):
        define()
    return fc.cuda_extension() is not None
