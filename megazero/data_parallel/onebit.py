"""1-bit Adam (Tang et al. 2021) over the dp group, at ZeRO stage 0, with tp and pp.

Steps 1 .. ``freeze_step``: megazero's Adam/AdamW exactly (gradients all-reduced in full
precision over dp; the same rule, so bit for bit ``--optimizer adam``). Then the variance is
frozen and gradients are no longer all-reduced: each rank folds its local gradient into the
momentum, ``m = b1 m + (1 - b1) g_local``, and the momenta are averaged over dp by
``CompressedAllReduce`` (one bit per element plus a scale per chunk, error feedback on the
worker and the server side: about 1/32 of an fp32 all-reduce's bytes). The update is AdamW's
with the momentum bias-corrected at the current step and the frozen variance at the freeze
step::

    p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^T) + eps)

(Adam with L2 adds ``wd p`` to the local gradient instead). As the momentum is identical on
every rank after each exchange, so are the parameters.

After the freeze there is no averaged gradient: clipping and the logged gradient norm use the
rank's local gradient (summed over the model-parallel group as usual), and an overflow on any
dp rank skips the step on all of them.

Checkpoints: the moments are the usual layout-free fragments (the frozen variance is
``exp_avg_sq``). The error-feedback buffers are per dp rank: every rank's are gathered into dp
rank 0's optimizer state and restored at the same layout; at another layout they restart from
zero (as when compression starts), which costs a few steps of extra compression error.

ZeRO stages 1-2 are refused: their ranks hold disjoint partitions of the momentum, while the
compressed exchange averages a full momentum per rank (DeepSpeed likewise runs 1-bit Adam
without ZeRO).
"""

from __future__ import annotations

import math

import torch

from megazero.data_parallel.zero import ZeroOptimizer
from megazero.distributed import comm
from megazero.distributed.compressed import CompressedAllReduce
from megazero.distributed.device import host_float
from megazero.distributed.parallel_state import ParallelState
from megazero.ops import sign_pack
from megazero.ops.cpu_adam import adam_step_constants, sqrt_f32
from megazero.optim.grad_scaler import host_scale


class CompressedAdamBase(ZeroOptimizer):
    """What 1-bit and 0/1 Adam share: ZeRO stage 0 on the parameters' device, one
    ``CompressedAllReduce`` over a buffer the size of the moments (built on first use), and
    the dp-wide agreement to skip a step on overflow when gradients are local."""

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 unit_policy=None):
        name = opt_config.optimizer
        if opt_config.zero_stage != 0:
            raise ValueError(f"--optimizer {name} runs at --zero-stage 0 (got "
                             f"{opt_config.zero_stage}): its compressed exchange averages "
                             "every rank's full buffers, which ZeRO partitions")
        if opt_config.cpu_offload or opt_config.cpu_torch_adam:
            raise ValueError(f"--optimizer {name} steps on the parameters' device: drop "
                             "--cpu-offload / --cpu-torch-adam")
        runs_on = "nccl" if ps.device.type == "cuda" else "gloo"
        if opt_config.compressed_comm_backend not in (None, runs_on):
            raise ValueError(
                f"ds_config optimizer.params.comm_backend_name is "
                f"{opt_config.compressed_comm_backend}, but {name}'s compressed exchange runs "
                f"on the data-parallel group's {runs_on} ({ps.device.type} tensors): set "
                f"{runs_on} or drop the key")
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         unit_policy=unit_policy)
        self.compressor = None

    def _compressor(self) -> CompressedAllReduce:
        if self.compressor is None:
            m = self.state["exp_avg"]  # [all parameters of this tp/pp cell] fp32
            self.compressor = CompressedAllReduce(self.dp_group, m.numel(), sign_pack,
                                                  device=m.device)
        return self.compressor

    def _overflow(self, sumsq: float, local: bool) -> bool:
        """Non-finite gradients here, or (``local``: each rank's own) on any dp rank."""
        bad = torch.tensor([0.0 if math.isfinite(sumsq) else 1.0], device=self.device)
        if local:
            comm.all_reduce(bad, self.dp_group, op=torch.distributed.ReduceOp.MAX)
        return host_float(bad) > 0


class OneBitAdamOptimizer(CompressedAdamBase):
    """``--optimizer onebitadam --freeze-step T`` (see the module docstring)."""

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 unit_policy=None):
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         unit_policy=unit_policy)
        self.freeze_step = opt_config.freeze_step

    def describe(self) -> str:
        return (f"1-bit Adam (until step {self.freeze_step} {super().describe()}; then the "
                "variance frozen and momenta averaged 1-bit compressed)")

    @property
    def frozen(self) -> bool:
        return self.step_count >= self.freeze_step

    def _sync_reducer(self) -> None:
        self.reducer.suspended = self.frozen  # local gradients from the freeze on

    # ---- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int]:
        if not self.frozen:
            result = super().step()
            self._sync_reducer()
            return result
        scale = host_scale(self.scaler)
        sumsq = host_float(self.grad_norm_sq())  # this rank's local gradient, over mp
        found_inf = self._overflow(sumsq, local=True)
        grad_norm = math.sqrt(sumsq) / scale if not found_inf else float("nan")
        self.scaler.update(found_inf)
        if found_inf:
            return False, grad_norm, 1
        coeff = 1.0
        if self.config.clip_grad > 0:
            coeff = min(1.0, self.config.clip_grad / (grad_norm + 1e-6))
        lr = self.lr_scheduler.get_lr() if self.lr_scheduler is not None else self.config.lr
        self.step_count += 1
        self._compressed_update(lr, coeff / scale)
        return True, grad_norm, 0

    def _compressed_update(self, lr: float, grad_scale: float) -> None:
        rule, views = self.rule, self.views
        b1 = rule.beta1
        for v in views:  # the momentum, from this rank's gradient
            g = v.grad.float() * grad_scale
            if not rule.adam_w_mode and v.weight_decay != 0.0:
                g += v.main * v.weight_decay
            v.state["exp_avg"].mul_(b1).add_(g, alpha=1.0 - b1)
        self._compressor().all_reduce_mean_(self.state["exp_avg"])
        bc = rule.bias_correction
        step_size, _ = adam_step_constants(lr, b1, rule.beta2, self.step_count, bc)
        _, bc2 = adam_step_constants(lr, b1, rule.beta2, self.freeze_step, bc)
        for v in views:
            denom = sqrt_f32(v.state["exp_avg_sq"]) / bc2 + rule.eps
            if rule.adam_w_mode and v.weight_decay != 0.0:
                v.main.mul_(1.0 - lr * v.weight_decay)
            v.main.sub_(v.state["exp_avg"] * step_size / denom)
            if v.model_out is not None:
                v.model_out.copy_(v.main)

    # ---- checkpoints ----------------------------------------------------------------------
    def gather_rank_states(self) -> list | None:
        """Every dp rank's error-feedback buffers (collective over dp; on dp rank 0 the list,
        elsewhere None), for the checkpoint."""
        mine = self.compressor.state_dict() if self.compressor is not None else None
        states = comm.all_gather_object(mine, self.dp_group)
        return states if self.dp_rank == 0 else None

    def load_sharded_state_dict(self, state: dict, fragment_reader=None) -> None:
        super().load_sharded_state_dict(state, fragment_reader)
        self._sync_reducer()
        ranks = state.get("rank_states")
        self.compressor = None
        if self.frozen and ranks and state.get("same_layout") \
                and ranks[self.dp_rank] is not None:
            self._compressor().load_state_dict(ranks[self.dp_rank])


__all__ = ["CompressedAdamBase", "OneBitAdamOptimizer"]
