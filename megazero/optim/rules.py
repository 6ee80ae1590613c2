"""Update rules (Adam/AdamW, LAMB, SGD) applied to flat fp32 segments of a ZeRO partition.

A segment is a contiguous piece of one parameter in this rank's partition, with its fp32 main
values, its (model-dtype) gradient, and its slice of the optimizer states. ``grad_scale``
multiplies the gradient first (un-scaling of the loss scale, data-parallel averaging and the
clip coefficient in one factor), so the step reads each array once.

Every rule has one interface: ``state_names`` (the fp32 states it keeps per element) and
``apply(segments, *, step, lr, grad_scale, params, skip=None)``, where ``params`` (a
``ParamTable``) gives the per-parameter facts a rule may need beyond its segments. ``step``,
``grad_scale`` and ``skip`` (the overflow flag: leave everything unchanged) are host values,
or device tensors when the optimizer keeps the step's scalars on the device: a rule whose
``takes_device_scalars(device)`` is true updates without reading them (Adam on a GPU, through
torch's fused multi-tensor kernel); the others read them once (``host_scalars``). The
arithmetic of Adam and LAMB is megazero's compiled kernels' (``megazero.ops``), whose PyTorch
reference runs when they are not built or when ``use_fused`` is off: one reference per op, in
``ops``.

LAMB's trust ratio uses the norms of the *whole* parameter (all tp shards and dp fragments),
reduced over the groups passed in, so LAMB too gives the same result at any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.distributed import comm
from megazero.distributed.device import host_values
from megazero.ops import _cpu_ext as cx
from megazero.ops.cpu_lamb import lamb_stage1_, lamb_stage2_, lamb_trust_ratios
from megazero.ops.foreach_adam import adam_update_device_, adam_update_foreach_
from megazero.ops.fused_step import (
    fused_adam_step,
    fused_adam_step_reference,
    fused_step_status,
)


@dataclass
class SegmentView:
    """Tensors of one segment: main fp32 values, gradient, and where to write the model copy."""

    main: torch.Tensor  # [n] fp32
    grad: torch.Tensor  # [n] model dtype
    model_out: torch.Tensor | None  # [n] model dtype view of the parameter, or None
    weight_decay: float
    state: dict  # name -> [n] fp32 views
    param_key: int = 0  # index of the parameter in the ParamTable


@dataclass(frozen=True)
class ParamTable:
    """Per-parameter facts beyond the segments: how many parameters the optimizer holds (the
    same on every dp rank, whatever each owns) and which are split over tp ([count] bool)."""

    count: int
    tp_sharded: torch.Tensor


class AdamRule:
    """Adam (L2) or AdamW (decoupled weight decay), bias-corrected, one pass per segment
    (``megazero.ops.fused_step``; its reference with ``use_fused=False``)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1=0.9, beta2=0.999, eps=1e-8, adam_w_mode=True, use_fused=True,
                 bias_correction=True):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.adam_w_mode, self.bias_correction = adam_w_mode, bias_correction
        self.step_fn = fused_adam_step if use_fused else fused_adam_step_reference

    def takes_device_scalars(self, device: torch.device) -> bool:
        """On a GPU (fake ones included: the dry run), with bias correction, megazero's step
        keeps its scalars on the device: ``ops.foreach_adam.adam_update_device_``."""
        return (device.type == "cuda" and self.step_fn is fused_adam_step
                and self.bias_correction)

    def apply(self, segments: list[SegmentView], *, step, lr: float, grad_scale,
              params: ParamTable | None = None, skip=None) -> None:
        if torch.is_tensor(step):  # the scalars stay on the device
            adam_update_device_(
                [s.main for s in segments], [s.grad for s in segments],
                [s.state["exp_avg"] for s in segments], [s.state["exp_avg_sq"] for s in segments],
                step=step, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                weight_decay=[s.weight_decay for s in segments], adam_w_mode=self.adam_w_mode,
                grad_scale=grad_scale, found_inf=skip, copies=[s.model_out for s in segments])
            return
        step, grad_scale, skip = host_scalars(step, grad_scale, skip)
        if skip:
            return
        if self.step_fn is fused_adam_step and _on_gpu(segments):
            # the compiled step takes CPU tensors; on a GPU, one multi-tensor launch per op
            adam_update_foreach_(
                [s.main for s in segments], [s.grad for s in segments],
                [s.state["exp_avg"] for s in segments], [s.state["exp_avg_sq"] for s in segments],
                step=step, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                weight_decay=[s.weight_decay for s in segments], adam_w_mode=self.adam_w_mode,
                bias_correction=self.bias_correction, grad_scale=grad_scale,
                copies=[s.model_out for s in segments])
            return
        for s in segments:
            self.step_fn(s.main, s.grad, s.state["exp_avg"], s.state["exp_avg_sq"], step=step,
                         lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                         weight_decay=s.weight_decay, adam_w_mode=self.adam_w_mode,
                         bias_correction=self.bias_correction, grad_scale=grad_scale,
                         model_param_out=s.model_out)


def host_scalars(step, grad_scale, skip) -> tuple[int, float, bool]:
    """The step's scalars as host values (one device-to-host copy for those on a device)."""
    values = [step, grad_scale, bool(skip) if skip is None or isinstance(skip, bool) else skip]
    on_device = [i for i, v in enumerate(values) if torch.is_tensor(v)]
    if on_device:
        read = host_values(torch.stack([values[i].reshape(()).double() for i in on_device]))
        for i, v in zip(on_device, read):
            values[i] = v
    return int(values[0]), float(values[1]), bool(values[2])


def _on_gpu(segments: list[SegmentView]) -> bool:
    """Whether the segments' values are on a GPU (and real: the dry run's fake tensors are not)."""
    return bool(segments) and all(s.main.is_cuda and cx.holds_data(s.main) for s in segments)


def describe_rule(rule, device: torch.device | None = None) -> str:
    """The update that runs on main values on ``device``, in words (DeepSpeed users read
    "Using ... optimizer")."""
    if isinstance(rule, AdamRule):
        kind = "AdamW" if rule.adam_w_mode else "Adam (L2 weight decay)"
        if rule.step_fn is fused_adam_step_reference:
            return f"{kind}: megazero's step, PyTorch reference (--no-fused-optimizer-step)"
        if device is not None and device.type == "cuda":
            return f"{kind}: megazero's step, multi-tensor (torch._foreach) on the GPU"
        status = fused_step_status()
        if status["built"]:
            return f"{kind}: megazero's fused step ({status['simd']})"
        return f"{kind}: megazero's step, PyTorch reference ({status['reason']})"
    if isinstance(rule, TorchAdamRule):
        return "torch.optim." + ("AdamW" if rule.adam_w_mode else "Adam") + " (fused)"
    if isinstance(rule, LambRule):
        return "LAMB: megazero's kernels, trust ratio from the whole parameter"
    return f"SGD with momentum {rule.momentum}"


class TorchAdamRule:
    """torch's own Adam/AdamW (``torch.optim.adam.adam``, fused on CPU and CUDA) run on the
    segments' fp32 main values and megazero's state tensors (``--cpu-torch-adam``)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1=0.9, beta2=0.999, eps=1e-8, adam_w_mode=True):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.adam_w_mode = adam_w_mode

    def apply(self, segments, *, step, lr, grad_scale, params=None, skip=None):
        from torch.optim.adam import adam

        step, grad_scale, skip = host_scalars(step, grad_scale, skip)
        if skip:
            return
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

    def apply(self, segments, *, step, lr, grad_scale, params=None, skip=None):
        step, grad_scale, skip = host_scalars(step, grad_scale, skip)
        if skip:
            return
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

    in two passes of megazero's LAMB kernels (``megazero.ops.cpu_lamb``: moments and the
    partial sums of squares, then the update). ``||w||`` and ``||u||`` are norms of the whole
    parameter: this rank's per-segment sums are added per parameter, all-reduced over
    ``dp_group`` (ZeRO fragments) and, for tensor-parallel parameters, ``tp_group``.
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1=0.9, beta2=0.999, eps=1e-6, min_trust=0.01, max_trust=10.0,
                 dp_group=None, tp_group=None, device=None):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.min_trust, self.max_trust = min_trust, max_trust
        self.dp_group, self.tp_group = dp_group, tp_group
        self.device = torch.device(device or "cpu")  # where the norm sums are reduced

    def apply(self, segments, *, step, lr, grad_scale, params: ParamTable, skip=None):
        step, grad_scale, skip = host_scalars(step, grad_scale, skip)
        if skip:
            return
        mains = [s.main for s in segments]
        ms = [s.state["exp_avg"] for s in segments]
        vs = [s.state["exp_avg_sq"] for s in segments]
        wds = [s.weight_decay for s in segments]
        w_seg, u_seg, _ = lamb_stage1_(mains, [s.grad for s in segments], ms, vs, step=step,
                                       beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                       weight_decay=wds, grad_scale=grad_scale)
        dev = self.device
        keys = torch.tensor([s.param_key for s in segments], dtype=torch.int64, device=dev)
        # [||w||^2, ||u||^2] per parameter, summed over its segments, then over the groups
        sums = torch.zeros(2, params.count, dtype=torch.float64, device=dev)
        sums[0].index_add_(0, keys, torch.as_tensor(w_seg, dtype=torch.float64, device=dev))
        sums[1].index_add_(0, keys, torch.as_tensor(u_seg, dtype=torch.float64, device=dev))
        comm.all_reduce(sums, self.dp_group)
        if comm.group_size(self.tp_group) > 1:
            mask = params.tp_sharded.to(device=dev, dtype=torch.float64)
            tp_part = sums * mask
            comm.all_reduce(tp_part, self.tp_group)
            sums = tp_part + sums * (1 - mask)
        trust = lamb_trust_ratios(sums[0], sums[1], self.min_trust, self.max_trust)
        copies = [s.model_out for s in segments]
        lamb_stage2_(mains, ms, vs, step=step, lr=lr, beta1=self.beta1, beta2=self.beta2,
                     eps=self.eps, trust_ratios=host_values(trust[keys]), weight_decay=wds,
                     copies=None if any(c is None for c in copies) else copies)


def build_rule(opt_config, ps):
    """The update rule for ``--optimizer``; the table of Adam variants is in the README."""
    if opt_config.optimizer == "adam" and opt_config.cpu_torch_adam:
        return TorchAdamRule(opt_config.adam_beta1, opt_config.adam_beta2, opt_config.adam_eps,
                             opt_config.adam_w_mode)
    if opt_config.optimizer in ("adam", "onebitadam", "zerooneadam"):  # their Adam parts
        return AdamRule(opt_config.adam_beta1, opt_config.adam_beta2, opt_config.adam_eps,
                        opt_config.adam_w_mode, use_fused=opt_config.use_fused_step,
                        bias_correction=opt_config.adam_bias_correction)
    if opt_config.optimizer == "lamb":
        return LambRule(opt_config.adam_beta1, opt_config.adam_beta2, opt_config.adam_eps,
                        dp_group=ps.dp_group if opt_config.zero_stage > 0 else None,
                        tp_group=ps.tp_group, device=ps.device)
    return SGDRule(opt_config.sgd_momentum)
