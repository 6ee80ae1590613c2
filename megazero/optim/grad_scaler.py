"""Loss scaling for fp16 (Megatron's constant and dynamic scalers). Local; no communication.

The dynamic scaler multiplies the scale by ``growth_factor`` after ``growth_interval``
(``--loss-scale-window``) steps without overflow, and after ``hysteresis`` overflows (not
necessarily consecutive) multiplies it by ``backoff_factor``, never below ``min_scale``. The
caller agrees ``found_inf`` across all ranks before calling ``update``.

Its state lives on the device (``device``, 0-dim tensors: the scale in float64, the trackers
in int64) and ``update`` takes the overflow flag as a device tensor, so deciding and updating
never waits for the device, as Megatron's ``DynamicGradScaler`` keeps its scale on the GPU.
``scale`` is that 0-dim tensor (a multiplier for the loss); ``state_dict`` reads it to the
host (a checkpoint waits anyway). The constant scaler's scale is a Python float.
"""

from __future__ import annotations

import torch

from megazero.distributed.device import host_values


class ConstantGradScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, device=None):
        if not (initial_scale > 0 and min_scale > 0 and growth_factor > 1
                and 0 < backoff_factor < 1 and growth_interval > 0 and hysteresis > 0):
            raise ValueError("invalid dynamic loss-scaler settings")
        self.device = torch.device(device or "cpu")
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._set(float(initial_scale), 0, hysteresis)

    def _set(self, scale: float, growth: int, hysteresis: int) -> None:
        self.scale = torch.tensor(scale, dtype=torch.float64, device=self.device)  # []
        self.growth_tracker = torch.tensor(growth, dtype=torch.int64, device=self.device)
        self.hysteresis_tracker = torch.tensor(hysteresis, dtype=torch.int64,
                                               device=self.device)

    def update(self, found_inf) -> None:
        """One step's overflow flag (a bool tensor of one element, or a bool), on the device."""
        found = torch.as_tensor(found_inf, device=self.device).reshape(())
        # overflow: growth restarts, one hysteresis down, back off once it is spent
        growth = torch.where(found, 0, self.growth_tracker + 1)
        hyst = torch.where(found, self.hysteresis_tracker - 1, self.hysteresis_tracker)
        backoff = found & (hyst <= 0)
        scale = torch.where(backoff, (self.scale * self.backoff_factor).clamp(
            min=self.min_scale), self.scale)
        # growth_interval good steps in a row: grow, restore the hysteresis
        grow = growth == self.growth_interval
        self.growth_tracker = torch.where(grow, 0, growth)
        self.hysteresis_tracker = torch.where(grow, self.hysteresis, hyst)
        self.scale = torch.where(grow, scale * self.growth_factor, scale)

    def state_dict(self) -> dict:
        scale, growth, hyst = host_values(torch.stack([
            self.scale, self.growth_tracker.double(), self.hysteresis_tracker.double()]))
        return {"scale": scale, "growth_tracker": int(growth), "hysteresis_tracker": int(hyst)}

    def load_state_dict(self, state: dict) -> None:
        self._set(float(state["scale"]), int(state["growth_tracker"]),
                  int(state["hysteresis_tracker"]))


def host_scale(scaler) -> float:
    """The current loss scale as a float (a host read for the dynamic scaler): for the
    optimizers that decide on the host (1-bit and 0/1 Adam)."""
    scale = scaler.scale
    return float(host_values(scale.reshape(1))[0]) if torch.is_tensor(scale) else scale


def build_grad_scaler(opt_config, device=None):
    """fp16: dynamic unless ``--loss-scale`` is set (its state on ``device``); bf16/fp32: a
    constant scale of one."""
    if opt_config.fp16:
        if opt_config.loss_scale is not None:
            return ConstantGradScaler(opt_config.loss_scale)
        return DynamicGradScaler(opt_config.initial_loss_scale, opt_config.min_loss_scale,
                                 growth_interval=opt_config.loss_scale_window,
                                 hysteresis=opt_config.hysteresis, device=device)
    return ConstantGradScaler(opt_config.loss_scale or 1.0)
