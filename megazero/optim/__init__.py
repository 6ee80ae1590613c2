"""Optimizer arithmetic with no communication of its own: update rules, loss scaling, lr.

- ``rules``: Adam/AdamW, LAMB and SGD applied to flat fp32 segments (one interface).
- ``grad_scaler``: Megatron's constant and dynamic loss scalers.
- ``lr_scheduler``: Megatron's warmup + constant/linear/cosine decay, counted in samples.
"""

from megazero.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from megazero.optim.lr_scheduler import LRScheduler, build_lr_scheduler

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "LRScheduler", "build_grad_scaler",
           "build_lr_scheduler"]
