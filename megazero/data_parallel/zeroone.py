"""0/1 Adam (Lu et al. 2022) over the dp group, at ZeRO stage 0, with tp and pp.

Two phases, as DeepSpeed's ``ZeroOneAdam``:

* Until ``var_freeze_step``: the variance is updated only on steps ``t`` with
  ``t % var_interval == 0``, whose gradients are all-reduced in full precision; the interval
  starts at 1 and doubles after every ``var_update_scaler`` variance updates. On the other
  steps the gradients are averaged by the 1-bit ``CompressedAllReduce`` (error feedback) and
  only the momentum takes them.
* From then on, local steps: every rank updates its parameters from its own gradients (no
  communication but a one-element overflow flag, so that all ranks skip a step alike).
  Every ``local_step_interval`` steps the ranks synchronise: each rank's change since the
  last synchronisation ``u = p - p_sync`` (rescaled to momentum space) is averaged 1-bit
  compressed, the momentum is rebuilt from it and ``p = p_sync + mean(u)``: bitwise the same
  on every rank (``p_sync`` is kept rather than undoing the local updates, whose rounding
  would differ from rank to rank).
  The interval doubles every ``local_step_scaler`` steps, up to ``local_step_clipper``.

megazero applies Adam's bias corrections (``bias_correction``, on by default; DeepSpeed's
0/1 Adam omits them whatever its flag): the momentum's at the current step, the variance's at
its number of updates ``k``::

    p <- p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^k)) + eps)

Clipping and the logged gradient norm use the all-reduced gradient on full-precision steps and
the rank's local gradient otherwise. Parameters agree across dp after every synchronisation
(and on every step before ``var_freeze_step``). Checkpoints: the moments as layout-free
fragments, the per-rank error feedback, the phase counters and ``lrs`` in dp rank 0's optimizer
state (with ``p_sync``); exact at the same layout; at another the local phase restarts from
the loaded parameters (a synchronisation point) with fresh error feedback.
ZeRO stages 1-3 are refused, as for 1-bit Adam.
"""

from __future__ import annotations

import math

import torch

from megazero.data_parallel.onebit import CompressedAdamBase
from megazero.distributed import comm
from megazero.distributed.device import host_float
from megazero.distributed.parallel_state import ParallelState
from megazero.ops.cpu_adam import sqrt_f32
from megazero.optim.grad_scaler import host_scale

_COUNTERS = ("var_interval", "var_counter", "var_updates", "local_step_interval",
             "local_step_counter")


class ZeroOneAdamOptimizer(CompressedAdamBase):
    """``--optimizer zerooneadam`` (see the module docstring)."""

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 unit_policy=None):
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         unit_policy=unit_policy)
        o = opt_config
        self.var_freeze_step, self.var_update_scaler = o.var_freeze_step, o.var_update_scaler
        self.local_step_scaler, self.local_step_clipper = o.local_step_scaler, \
            o.local_step_clipper
        self.counters = dict(var_interval=1, var_counter=0, var_updates=0,
                             local_step_interval=1, local_step_counter=0)
        self.lrs = 0.0  # sum of the learning rates since the last synchronisation
        self.anchor = None  # [numel] fp32: the parameters at the last synchronisation
        self._sync_reducer()

    def describe(self) -> str:
        return (f"0/1 Adam (variance updates at exponentially spaced steps until step "
                f"{self.var_freeze_step}, 1-bit gradients between them; then local steps, "
                f"synchronised 1-bit compressed every 1 to {self.local_step_clipper} steps)")

    # ---- the phases -------------------------------------------------------------------------
    def _full_step(self, t: int) -> bool:
        """Whether step ``t`` all-reduces full-precision gradients (a variance update)."""
        return t <= self.var_freeze_step and t % self.counters["var_interval"] == 0

    def _sync_reducer(self) -> None:
        self.reducer.suspended = not self._full_step(self.step_count + 1)

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int]:
        t = self.step_count + 1
        full = self._full_step(t)
        views = self.views
        divisor = host_scale(self.scaler) * (self.dp_size if full else 1)
        sumsq = host_float(self.grad_norm_sq())
        found_inf = self._overflow(sumsq, local=not full)
        grad_norm = math.sqrt(sumsq) / divisor if not found_inf else float("nan")
        self.scaler.update(found_inf)
        if found_inf:
            return False, grad_norm, 1
        coeff = 1.0
        if self.config.clip_grad > 0:
            coeff = min(1.0, self.config.clip_grad / (grad_norm + 1e-6))
        lr = self.lr_scheduler.get_lr() if self.lr_scheduler is not None else self.config.lr
        self.step_count = t
        grads = self._flat_grads(views, coeff / divisor)
        if t > self.var_freeze_step:
            self._local_step(views, grads, lr, t)
        else:
            self._moment_step(views, grads, full, lr, t)
        self._sync_reducer()
        return True, grad_norm, 0

    def _flat_grads(self, views, scale: float) -> torch.Tensor:
        """[numel] fp32: the (scaled) gradients at the offsets of the optimizer states."""
        flat = torch.zeros_like(self.state["exp_avg"])
        for seg, v in zip(self.layout.segments, views):
            flat[seg.offset:seg.offset + seg.numel] = v.grad.float() * scale
        if not self.rule.adam_w_mode:  # Adam with L2: the decay joins the gradient
            for seg, v in zip(self.layout.segments, views):
                if v.weight_decay != 0.0:
                    flat[seg.offset:seg.offset + seg.numel] += v.main * v.weight_decay
        return flat

    def _moment_step(self, views, grads, full: bool, lr: float, t: int) -> None:
        b1, b2 = self.rule.beta1, self.rule.beta2
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        if full:
            v.mul_(b2).addcmul_(grads, grads, value=1.0 - b2)
            c = self.counters
            c["var_updates"] += 1
            c["var_counter"] += 1
            if c["var_counter"] == self.var_update_scaler:
                c["var_counter"], c["var_interval"] = 0, c["var_interval"] * 2
        elif self.dp_size > 1:
            self._compressor().all_reduce_mean_(grads)
        m.mul_(b1).add_(grads, alpha=1.0 - b1)
        if t == self.var_freeze_step:  # the local phase starts with fresh error feedback
            self._compressor().reset_errors()
        self._apply(views, lr, t)

    def _c1(self, t: int) -> float:
        return 1.0 - self.rule.beta1 ** t if self.rule.bias_correction else 1.0

    def _denominator(self) -> torch.Tensor:
        k = max(1, self.counters["var_updates"])
        bc2 = math.sqrt(1.0 - self.rule.beta2 ** k) if self.rule.bias_correction else 1.0
        return sqrt_f32(self.state["exp_avg_sq"]) / bc2 + self.rule.eps

    def _apply(self, views, lr: float, t: int):
        """p <- p (1 - lr wd) - lr m_hat / denominator."""
        step_size = lr / self._c1(t)
        denom = self._denominator()
        m = self.state["exp_avg"]
        for seg, v in zip(self.layout.segments, views):
            s = slice(seg.offset, seg.offset + seg.numel)
            delta = m[s] * (-step_size) / denom[s]
            if self.rule.adam_w_mode and v.weight_decay != 0.0:
                delta -= v.main * (lr * v.weight_decay)
            v.main.add_(delta)
            if v.model_out is not None:
                v.model_out.copy_(v.main)

    def _local_step(self, views, grads, lr: float, t: int) -> None:
        b1 = self.rule.beta1
        m = self.state["exp_avg"]
        if self.anchor is None:  # the parameters every rank shares now
            self.anchor = self._flat_main(views)
        m.mul_(b1).add_(grads, alpha=1.0 - b1)
        self.lrs += lr
        self._apply(views, lr, t)
        c = self.counters
        if t % c["local_step_interval"] == 0:
            self._synchronise(views, t)
        c["local_step_counter"] += 1
        if c["local_step_counter"] == self.local_step_scaler:
            c["local_step_counter"] = 0
            c["local_step_interval"] = min(self.local_step_clipper,
                                           c["local_step_interval"] * 2)

    def _flat_main(self, views) -> torch.Tensor:
        flat = torch.zeros_like(self.state["exp_avg"])
        for seg, v in zip(self.layout.segments, views):
            flat[seg.offset:seg.offset + seg.numel] = v.main
        return flat

    def _synchronise(self, views, t: int) -> None:
        """Average the ranks' changes since the last synchronisation (1-bit, in momentum
        space) and apply the mean to the parameters they started from."""
        denom = self._denominator()
        u = self._flat_main(views).sub_(self.anchor)
        u.mul_(denom)
        if self.dp_size > 1:
            self._compressor().all_reduce_mean_(u)
        # the momentum the averaged updates imply (bias correction of step t undone)
        self.state["exp_avg"].copy_(u * (-self._c1(t) / self.lrs))
        u.div_(denom)
        self.anchor.add_(u)
        for seg, v in zip(self.layout.segments, views):
            v.main.copy_(self.anchor[seg.offset:seg.offset + seg.numel])
            if v.model_out is not None:
                v.model_out.copy_(v.main)
        self.lrs = 0.0

    # ---- checkpoints ----------------------------------------------------------------------
    def gather_rank_states(self) -> list | None:
        between = self.anchor is not None and self.lrs > 0  # local steps since the last sync
        mine = {"counters": dict(self.counters), "lrs": self.lrs,
                "anchor": None if self.anchor is None else self.anchor.clone(),
                # the model file holds dp rank 0's parameters and momentum; between
                # synchronisations every rank's own differ, and an exact resume needs them
                "main": self._flat_main(self.views) if between else None,
                "exp_avg": self.state["exp_avg"].clone() if between else None,
                "errors": None if self.compressor is None else self.compressor.state_dict()}
        states = comm.all_gather_object(mine, self.dp_group)
        return states if self.dp_rank == 0 else None

    def load_sharded_state_dict(self, state: dict, fragment_reader=None) -> None:
        super().load_sharded_state_dict(state, fragment_reader)
        ranks = state.get("rank_states")
        self.compressor, self.anchor, self.lrs = None, None, 0.0
        mine = ranks[self.dp_rank] if ranks and state.get("same_layout") else None
        if mine is not None:
            self.counters = {k: int(mine["counters"][k]) for k in _COUNTERS}
            self.lrs = float(mine["lrs"])
            a = mine["anchor"]
            self.anchor = None if a is None else a.to(self.state["exp_avg"].device)
            if mine.get("exp_avg") is not None:
                self.state["exp_avg"].copy_(mine["exp_avg"])
            if mine.get("main") is not None:
                main = mine["main"].to(self.state["exp_avg"].device)
                for seg, v in zip(self.layout.segments, self.views):
                    v.main.copy_(main[seg.offset:seg.offset + seg.numel])
                    if v.model_out is not None:
                        v.model_out.copy_(v.main)
            if mine["errors"] is not None:
                self._compressor().load_state_dict(mine["errors"])
        else:  # another layout: the schedule from the step count, the accumulators empty
            self.counters = _counters_at(self.step_count, self.var_freeze_step,
                                         self.var_update_scaler, self.local_step_scaler,
                                         self.local_step_clipper)
        self._sync_reducer()


def _counters_at(step: int, freeze: int, var_scaler: int, local_scaler: int,
                 clipper: int) -> dict:
    """The phase counters after ``step`` steps (the schedule depends on nothing else)."""
    c = dict(var_interval=1, var_counter=0, var_updates=0, local_step_interval=1,
             local_step_counter=0)
    for t in range(1, step + 1):
        if t <= freeze:
            if t % c["var_interval"] == 0:
                c["var_updates"] += 1
                c["var_counter"] += 1
                if c["var_counter"] == var_scaler:
                    c["var_counter"], c["var_interval"] = 0, c["var_interval"] * 2
        else:
            c["local_step_counter"] += 1
            if c["local_step_counter"] == local_scaler:
                c["local_step_counter"] = 0
                c["local_step_interval"] = min(clipper, c["local_step_interval"] * 2)
    return c


__all__ = ["ZeroOneAdamOptimizer"]
