"""Loss scaling for fp16 (Megatron's constant and dynamic scalers). Local; no communication.

The dynamic scaler multiplies the scale by ``growth_factor`` after ``growth_interval``
(``--loss-scale-window``) steps without overflow, and after ``hysteresis`` overflows (not
necessarily consecutive) multiplies it by ``backoff_factor``, never below ``min_scale``. The
caller agrees ``found_inf`` across all ranks before calling ``update``.
"""

from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2):
        if not (initial_scale > 0 and min_scale > 0 and growth_factor > 1
                and 0 < backoff_factor < 1 and growth_interval > 0 and hysteresis > 0):
            raise ValueError("invalid dynamic loss-scaler settings")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(opt_config):
    """fp16: dynamic unless ``--loss-scale`` is set; bf16/fp32: a constant scale of one."""
    if opt_config.fp16:
        if opt_config.loss_scale is not None:
            return ConstantGradScaler(opt_config.loss_scale)
        return DynamicGradScaler(opt_config.initial_loss_scale, opt_config.min_loss_scale,
                                 growth_interval=opt_config.loss_scale_window,
                                 hysteresis=opt_config.hysteresis)
    return ConstantGradScaler(opt_config.loss_scale or 1.0)
