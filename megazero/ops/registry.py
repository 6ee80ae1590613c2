"""Registry of megazero's compiled ops, read by the report (``python -m megazero.ops``).

Every module wrapping a compiled kernel calls ``register_op`` once at import time, naming the
op, the extension it needs (``megazero.ops._<extension>``, loaded by
``megazero.ops._loader.load_extension``) and, optionally, a function returning the SIMD
level (or device) the op runs on. ``OP_MODULES`` lists those modules, so the report imports
them all without knowing them: add one line per new module.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from megazero.ops import _loader

logger = logging.getLogger(__name__)

# Modules that register ops; the report imports each (one line per module).
OP_MODULES: tuple[str, ...] = (
    "megazero.ops.cpu_adam",
    "megazero.ops.fused_step",
    "megazero.ops.cpu_lamb",
    "megazero.ops.fused_bias_gelu",
    "megazero.ops.fused_dropout",
    "megazero.ops.fused_layer_norm",
    "megazero.ops.fused_softmax",
    "megazero.ops.fused_rms_norm",
    "megazero.ops.fused_swiglu",
    "megazero.ops.fused_rope",
    "megazero.ops.cuda_fused",
    "megazero.ops.cuda_elementwise",
    "megazero.ops.cuda_rope_norm",
    "megazero.ops.cuda_cross_entropy",
    "megazero.ops.cuda_optim",
    "megazero.ops.sign_pack",
    "megazero.ops.aio",
)


@dataclass(frozen=True)
class OpSpec:
    name: str
    extension: str  # megazero.ops._<extension>
    description: str
    simd_level_fn: Callable[[], str | None] | None = None


_REGISTRY: dict[str, OpSpec] = {}


def register_op(name: str, extension: str, description: str,
                simd_level_fn: Callable[[], str | None] | None = None) -> OpSpec:
    """Record an op for the report; registering a name again replaces the entry."""
    spec = OpSpec(name, extension, description, simd_level_fn)
    _REGISTRY[name] = spec
    return spec


def registered_ops() -> list[OpSpec]:
    """The ops registered so far, in registration order."""
    return list(_REGISTRY.values())


def import_op_modules(modules: tuple[str, ...] = OP_MODULES) -> dict[str, str]:
    """Import every op module; returns {module: error} for those that failed to import."""
    errors = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the report shows any failure
            errors[name] = f"{type(exc).__name__}: {exc}"
            logger.warning("megazero: could not import op module %s: %s", name, exc)
    return errors


def op_status(spec: OpSpec) -> dict:
    """Built or not, SIMD level, and why missing, for one op."""
    module = _loader.load_extension(spec.extension)
    info = _loader.status().get(spec.extension, {})
    simd = None
    if module is not None and spec.simd_level_fn is not None:
        try:
            simd = spec.simd_level_fn()
        except Exception as exc:  # noqa: BLE001
            simd = f"error: {exc}"
    return {
        "name": spec.name,
        "extension": f"_{spec.extension}",
        "description": spec.description,
        "built": module is not None,
        "simd": simd,
        "reason": "" if module is not None else info.get("reason", "not built"),
        "path": getattr(module, "__file__", None),
    }
