"""Loading of compiled extensions with a recorded reason when one is missing.

``load_extension("adam")`` imports ``megazero.ops._adam`` (built by setup.py from
``csrc/adam/``) and returns it, or returns ``None`` after logging one warning per extension;
every caller then takes its PyTorch reference path. ``MEGAZERO_DISABLE_OPS`` (comma-separated
extension names, or ``all``) simulates a missing extension, for tests and comparisons.
``status()`` feeds ``python -m megazero.ops``.
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger(__name__)

_CACHE: dict[str, object] = {}
_STATUS: dict[str, dict] = {}


def _disabled(name: str) -> bool:
    value = os.environ.get("MEGAZERO_DISABLE_OPS", "")
    names = {v.strip() for v in value.split(",") if v.strip()}
    return "all" in names or name in names


def _missing_reason(name: str, exc: ImportError) -> tuple[str, bool]:
    """Why ``_<name>`` could not be imported, and whether that is expected on this machine.

    CUDA kernels are never built against a CPU-only torch (setup.py skips them), so their
    absence there is the expected state, not a broken install.
    """
    if name.endswith("_cuda"):
        import torch

        if torch.version.cuda is None:
            return (f"CUDA kernels are not built with a CPU-only torch ({torch.__version__}); "
                    "install a CUDA torch and nvcc of the same major version, then "
                    "`pip install -e .`", True)
        if not torch.cuda.is_available():
            return ("not built (no GPU was visible at install; set TORCH_CUDA_ARCH_LIST and "
                    "reinstall to build it)", True)
    return (f"extension megazero.ops._{name} is not built ({exc}); reinstall with "
            "`pip install -e .` (MEGAZERO_BUILD_OPS unset) to build it", False)


def load_extension(name: str):
    """The compiled module ``megazero.ops._<name>``, or None (reason kept in ``status()``)."""
    if _disabled(name):
        _STATUS[name] = {"built": False, "reason": "disabled by MEGAZERO_DISABLE_OPS"}
        return None
    if name in _CACHE:
        return _CACHE[name]
    try:
        module = importlib.import_module(f"megazero.ops._{name}")
        _STATUS[name] = {"built": True, "reason": ""}
    except ImportError as exc:
        module = None
        reason, expected = _missing_reason(name, exc)
        _STATUS[name] = {"built": False, "reason": reason}
        log = logger.debug if expected else logger.warning
        log("megazero: %s; using the PyTorch reference path", reason)
    _CACHE[name] = module
    return module


def reset_cache() -> None:
    """Forget loaded modules (after changing MEGAZERO_DISABLE_OPS in tests)."""
    _CACHE.clear()
    _STATUS.clear()


def status() -> dict[str, dict]:
    return dict(_STATUS)
