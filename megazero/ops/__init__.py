"""Python faces of megazero's compiled kernels, each with a PyTorch reference path.

Kernels live in ``csrc/<name>/`` and are built by setup.py as ``megazero.ops._<name>``;
``megazero.ops._loader.load_extension`` returns the module or ``None`` (then the reference path
runs). Modules wrapping a kernel register their ops in ``megazero.ops.registry``;
``python -m megazero.ops`` reports what is built, for which SIMD level, and why any is missing.

CPU optimizers: ``CPUAdam`` (cpu_adam.py), ``CPULamb`` (cpu_lamb.py); the fused ZeRO
optimizer step and the global gradient norm: ``megazero.ops.fused_step``.

Fused model ops (CPU kernels in ``csrc/fused``; on CUDA megazero's custom ops, ``cuda_fused``
and the ``cuda_*`` modules), each an autograd op with a PyTorch fallback: ``fused_bias_gelu``,
``fused_bias_dropout_add``, ``fused_layer_norm`` / ``FusedLayerNorm``,
``scaled_upper_triang_masked_softmax``; for the Llama family ``fused_rms_norm``,
``fused_bias_swiglu``, ``fused_rope`` (with their ``*_reference`` eager formulas). Multi-tensor
CUDA optimizers: ``FusedAdam``, ``FusedLamb`` (cuda_optim.py).

The 1-bit sign codec of the compressed all-reduce: ``pack_signs`` / ``unpack_signs``
(sign_pack.py).

NVMe offload I/O (ZeRO-Infinity): ``AsyncIO`` (thread pool of pread/pwrite with O_DIRECT,
C++ in ``csrc/aio`` or Python threads) and ``aligned_empty`` (aio.py).
"""

from megazero.ops._loader import load_extension
from megazero.ops.aio import AsyncIO, aligned_empty
from megazero.ops.cpu_adam import CPUAdam
from megazero.ops.cpu_lamb import CPULamb
from megazero.ops.cuda_optim import FusedAdam, FusedLamb
from megazero.ops.fused_bias_gelu import fused_bias_gelu
from megazero.ops.fused_dropout import fused_bias_dropout_add
from megazero.ops.fused_layer_norm import FusedLayerNorm, fused_layer_norm
from megazero.ops.fused_rms_norm import fused_rms_norm, rms_norm_reference
from megazero.ops.fused_rope import fused_rope, rope_reference
from megazero.ops.fused_softmax import scaled_upper_triang_masked_softmax
from megazero.ops.fused_swiglu import fused_bias_swiglu, swiglu_reference
from megazero.ops.registry import OP_MODULES, register_op
from megazero.ops.sign_pack import pack_signs, unpack_signs

__all__ = ["CPUAdam", "CPULamb", "OP_MODULES", "load_extension", "register_op",
           "FusedAdam", "FusedLamb", "FusedLayerNorm", "fused_bias_dropout_add", "fused_bias_gelu",
           "fused_layer_norm", "scaled_upper_triang_masked_softmax", "fused_bias_swiglu",
           "fused_rms_norm", "fused_rope", "rms_norm_reference", "rope_reference",
           "swiglu_reference", "pack_signs", "unpack_signs", "AsyncIO", "aligned_empty"]
