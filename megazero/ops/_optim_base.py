"""The ``torch.optim.Optimizer`` side shared by megazero's multi-tensor optimizers (``CPUAdam``,
``CPULamb``, ``FusedAdam``, ``FusedLamb``).

State has torch.optim.Adam's layout, ``state[p] = {"step", "exp_avg", "exp_avg_sq"}`` (step a
float32 scalar tensor), with the moments fp32 whatever the parameter dtype, so checkpoints
load both ways. ``step()`` creates the state, advances the step counts and updates each
param group in buckets of parameters that share (step, device, param dtype, grad dtype): one
multi-tensor kernel call per bucket, made by the subclass's ``_update``.
"""

from __future__ import annotations

import torch


class BucketedOptimizer(torch.optim.Optimizer):
    """Optimizer whose ``step()`` calls ``_update(group, step, params, **step_kwargs)`` once
    per bucket of parameters with gradients; ``cpu_only`` refuses tensors off the CPU."""

    cpu_only = False

    def _update(self, group: dict, step: int, params: list, **step_kwargs) -> None:
        """Update ``params`` (one bucket of ``group``, at ``step``); subclasses define it."""
        raise TypeError(f"{type(self).__name__} must define _update")  # pragma: no cover

    @torch.no_grad()
    def step(self, closure=None, **step_kwargs):
        """One step of every param group; returns the closure's loss (None without one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for (step, *_), params in self._buckets(group).items():
                self._update(group, step, params, **step_kwargs)
        return loss

    def _buckets(self, group) -> dict[tuple, list]:
        """Parameters of ``group`` with a gradient, their state created and ``step`` advanced,
        grouped by (step, device, param dtype, grad dtype)."""
        name = type(self).__name__
        buckets: dict[tuple, list] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if self.cpu_only and p.device.type != "cpu":
                raise ValueError(f"{name} steps CPU tensors only, got one on {p.device}")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32,
                                                    memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            state["step"] += 1
            key = (int(state["step"]), p.device, p.dtype, p.grad.dtype)
            buckets.setdefault(key, []).append(p)
        return buckets

    def moments(self, params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(exp_avg list, exp_avg_sq list) of ``params``."""
        return ([self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params])

    def load_state_dict(self, state_dict) -> None:
        """torch's loader casts moments to the parameter dtype; keep them fp32 instead."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    state[key] = saved[key].to(device=p.device, dtype=torch.float32,
                                               copy=True).contiguous()
            if "step" in saved:
                state["step"] = torch.as_tensor(saved["step"],
                                                dtype=torch.float32).detach().clone()
