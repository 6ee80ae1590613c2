"""Update rules (Adam/AdamW, LAMB, SGD) applied to flat fp32 segments of a ZeRO partition.

A segment is a contiguous piece of one parameter in this rank's partition, with its fp32 main
values, its (model-dtype) gradient, and its slice of the optimizer states. ``grad_scale``
multiplies the gradient first (un-scaling of the loss scale, data-parallel averaging and the
clip coefficient in one factor), so the step reads each array once. When megazero's compiled
fused step is built it does the whole Adam update of a segment in one pass and writes the
model-dtype copy; otherwise the PyTorch reference below runs (same arithmetic).

LAMB's trust ratio uses the norms of the *whole* parameter (all tp shards and dp fragments),
reduced over the groups passed in, so LAMB too gives the same result at any layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megazero.distributed import comm


@dataclass
class SegmentView:
    """Tensors of one segment: main fp32 values, gradient, and where to write the model copy."""

    main: torch.Tensor  # [n] fp32
    grad: torch.Tensor  # [n] model dtype
    model_out: torch.Tensor | None  # [n] model dtype view of the parameter, or None
    weight_decay: float
    state: dict  # name -> [n] fp32 views
    param_key: int = 0  # index of the parameter (for LAMB's per-parameter norms)


def _fused_step():
    try:
        from megazero.ops import fused_step  # compiled one-pass Adam (issue 7)
    except ImportError:
        return None
    return fused_step if hasattr(fused_step, "fused_adam_step") else None


class AdamRule:
    """Adam (L2) or AdamW (decoupled weight decay), as torch.optim.Adam/AdamW compute them."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1=0.9, beta2=0.999, eps=1e-8, adam_w_mode=True, use_fused=True):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.adam_w_mode = adam_w_mode
        self.fused = _fused_step() if use_fused else None

    def apply(self, segments: list[SegmentView], *, step: int, lr: float,
              grad_scale: float) -> None:
        for s in segments:
            if self.fused is not None:
                self.fused.fused_adam_step(
                    s.main, s.grad, s.state["exp_avg"], s.state["exp_avg_sq"], step=step,
                    lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=s.weight_decay, adam_w_mode=self.adam_w_mode,
                    bias_correction=True, grad_scale=grad_scale, model_param_out=s.model_out)
            else:
                self._reference(s, step, lr, grad_scale)

    def _reference(self, s: SegmentView, step, lr, grad_scale):
        p, m, v = s.main, s.state["exp_avg"], s.state["exp_avg_sq"]
        g = s.grad.float() * grad_scale
        wd = s.weight_decay
        if wd != 0 and not self.adam_w_mode:
            g = g.add(p, alpha=wd)
        m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        bc1 = 1 - self.beta1 ** step
        bc2_sqrt = math.sqrt(1 - self.beta2 ** step)
        denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
        if wd != 0 and self.adam_w_mode:
            p.mul_(1 - lr * wd)
        p.addcdiv_(m, denom, value=-lr / bc1)
        if s.model_out is not None:
            s.model_out.copy_(p)


class TorchAdamRule:
    """torch's own Adam/AdamW (``torch.optim.adam.adam``, fused on CPU and CUDA) run on the
    segments' fp32 main values and megazero's state tensors (``--cpu-torch-adam``)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1=0.9, beta2=0.999, eps=1e-8, adam_w_mode=True):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.adam_w_mode = adam_w_mode

    def apply(self, segments, *, step, lr, grad_scale):
        from torch.optim.adam import adam

        groups: dict[float, list] = {}
        for s in segments:
            if s.main.numel():
                groups.setdefault(s.weight_decay, []).append(s)
        for wd, segs in groups.items():
            grads = [s.grad.float() * grad_scale for s in segs]
            steps = [torch.tensor(float(step - 1)) for _ in segs]  # adam increments first
            adam([s.main for s in segs], grads, [s.state["exp_avg"] for s in segs],
                 [s.state["exp_avg_sq"] for s in segs], [], steps,
                 fused=segs[0].main.device.type in ("cpu", "cuda"),
                 decoupled_weight_decay=self.adam_w_mode, amsgrad=False, beta1=self.beta1,
                 beta2=self.beta2, lr=lr, weight_decay=wd, eps=self.eps, maximize=False)
            for s in segs:
                if s.model_out is not None:
                    s.model_out.copy_(s.main)


class SGDRule:
    """SGD with momentum and L2 weight decay (torch.optim.SGD semantics)."""

    state_names = ("momentum_buffer",)

    def __init__(self, momentum=0.9):
        self.momentum = momentum

    def apply(self, segments, *, step, lr, grad_scale):
        for s in segments:
            g = s.grad.float() * grad_scale
            if s.weight_decay:
                g = g.add(s.main, alpha=s.weight_decay)
            buf = s.state["momentum_buffer"]
            if self.momentum:
                if step == 1:
                    buf.copy_(g)
                else:
                    buf.mul_(self.momentum).add_(g)
                g = buf
            s.main.add_(g, alpha=-lr)
            if s.model_out is not None:
                s.model_out.copy_(s.main)


class LambRule:
    """LAMB (You et al.) with bias-corrected Adam moments and decoupled weight decay:

        u = m_hat / (sqrt(v_hat) + eps) + wd * w
        r = clamp(||w|| / ||u||, min_trust, max_trust)   (1 when either norm is zero)
        w = w - lr * r * u

    ``||w||`` and ``||u||`` are norms of the whole parameter: partial sums over this rank's
    segments are all-reduced over ``dp_group`` (ZeRO fragments) and, for tensor-parallel
    parameters, ``tp_group``.
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1=0.9, beta2=0.999, eps=1e-6, min_trust=0.01, max_trust=10.0,
                 dp_group=None, tp_group=None):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.min_trust, self.max_trust = min_trust, max_trust
        self.dp_group, self.tp_group = dp_group, tp_group

    def apply(self, segments, *, step, lr, grad_scale, num_params=None, tp_sharded=None):
        bc1 = 1 - self.beta1 ** step
        bc2 = 1 - self.beta2 ** step
        updates = []
        n = num_params if num_params is not None else 1 + max((s.param_key for s in segments),
                                                              default=-1)
        w_sq = torch.zeros(n, dtype=torch.float64)
        u_sq = torch.zeros(n, dtype=torch.float64)
        for s in segments:
            g = s.grad.float() * grad_scale
            m, v = s.state["exp_avg"], s.state["exp_avg_sq"]
            m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            u = (m / bc1) / ((v / bc2).sqrt_().add_(self.eps))
            if s.weight_decay:
                u.add_(s.main, alpha=s.weight_decay)
            updates.append(u)
            w_sq[s.param_key] += s.main.double().pow(2).sum()
            u_sq[s.param_key] += u.double().pow(2).sum()
        sums = torch.stack([w_sq, u_sq])  # [2, n]
        comm.all_reduce(sums, self.dp_group)
        if tp_sharded is not None and comm.group_size(self.tp_group) > 1:
            mask = tp_sharded.to(torch.float64)
            tp_part = sums * mask
            comm.all_reduce(tp_part, self.tp_group)
            sums = tp_part + sums * (1 - mask)
        w_norm, u_norm = sums[0].sqrt(), sums[1].sqrt()
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                            torch.ones_like(w_norm)).clamp(self.min_trust, self.max_trust)
        for s, u in zip(segments, updates):
            s.main.add_(u, alpha=-lr * float(trust[s.param_key]))
            if s.model_out is not None:
                s.model_out.copy_(s.main)


def build_rule(opt_config, ps):
    """The update rule for ``--optimizer``; the table of Adam variants is in the README."""
    if opt_config.optimizer == "adam" and opt_config.cpu_torch_adam:
        return TorchAdamRule(opt_config.adam_beta1, opt_config.adam_beta2, opt_config.adam_eps,
                             opt_config.adam_w_mode)
    if opt_config.optimizer == "adam":
        return AdamRule(opt_config.adam_beta1, opt_config.adam_beta2, opt_config.adam_eps,
                        opt_config.adam_w_mode,
                        use_fused=opt_config.use_fused_step and not opt_config.cpu_torch_adam)
    if opt_config.optimizer == "lamb":
        return LambRule(opt_config.adam_beta1, opt_config.adam_beta2, opt_config.adam_eps,
                        dp_group=ps.dp_group if opt_config.zero_stage > 0 else None,
                        tp_group=ps.tp_group)
    return SGDRule(opt_config.sgd_momentum)
