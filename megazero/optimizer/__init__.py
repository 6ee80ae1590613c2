"""Data-parallel optimizers: ZeRO stages 0-3 over the dp group, with mixed precision.

``build_optimizer`` picks the implementation from ``--zero-stage``: stages 0-2 share the flat
buffers of ``zero.py``; stage 3 partitions the parameters themselves (``zero3.py``).
"""

from __future__ import annotations

from megazero.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megazero.optimizer.lr_scheduler import LRScheduler, build_lr_scheduler
from megazero.optimizer.zero import ZeroOptimizer


def build_optimizer(model_chunks, opt_config, ps, lr_scheduler=None, seed: int = 0):
    """``seed`` initialises ZeRO-3 parameters built on the meta device (by name)."""
    if opt_config.zero_stage == 3:
        from megazero.optimizer.zero3 import Zero3Optimizer

        return Zero3Optimizer(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                              seed=seed)
    return ZeroOptimizer(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler)


__all__ = ["ZeroOptimizer", "build_optimizer", "build_lr_scheduler", "LRScheduler",
           "ConstantGradScaler", "DynamicGradScaler"]
