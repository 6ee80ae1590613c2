"""Learning-rate schedule of Megatron (``OptimizerParamScheduler``): linear warmup, then
constant, linear, cosine or inverse-square-root decay to ``--min-lr``, or WSD (warmup, stable
at the peak, then a final decay over ``--lr-wsd-decay-*`` by ``--lr-wsd-decay-style``). Steps
are counted in samples, so ``--train-iters`` and ``--train-samples`` runs (and rampup-free
resumes) agree."""

from __future__ import annotations

import math

from megazero.optim.ds_schedulers import DeepSpeedScheduler

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str, wsd_decay_steps: int | None = None,
                 wsd_decay_style: str = "exponential"):
        if decay_steps <= 0:
            raise ValueError(f"lr decay steps must be positive, got {decay_steps}")
        if warmup_steps >= decay_steps and decay_style != "constant":
            raise ValueError(f"--lr-warmup-* ({warmup_steps} samples) must be shorter than the "
                             f"lr decay ({decay_steps} samples: --lr-decay-iters/samples or "
                             "the whole run)")
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        if decay_style == "WSD":
            if wsd_decay_steps is None or not 0 < wsd_decay_steps <= decay_steps:
                raise ValueError(f"--lr-decay-style WSD needs --lr-wsd-decay-iters/samples in "
                                 f"(0, lr decay steps = {decay_steps} samples], got "
                                 f"{wsd_decay_steps}")
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.num_steps = 0

    def get_lr(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":  # lr * sqrt(warmup / n), at least min
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup_steps, 1)
                                                            / max(n, 1)))
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "WSD":
            anneal = self.decay_steps - self.wsd_decay_steps
            ratio = max(n - anneal, 0) / self.wsd_decay_steps
            coeff = {"linear": lambda r: 1.0 - r,
                     "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": lambda r: 2.0 * 0.5 ** r - 1.0,
                     "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.wsd_decay_style](ratio)
            return self.min_lr + coeff * (self.max_lr - self.min_lr)
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"unknown lr decay style {self.decay_style!r}")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int) -> float:
        self.num_steps += increment
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.decay_style,
                "num_steps": self.num_steps, "wsd_decay_steps": self.wsd_decay_steps,
                "wsd_decay_style": self.wsd_decay_style}

    def load_state_dict(self, state: dict) -> None:
        # Like Megatron (without --override-opt_param-scheduler), the checkpoint's schedule
        # wins; only the step count must carry over for a resume to be exact.
        for key in ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style",
                    "num_steps"):
            setattr(self, key, state[key])
        for key in ("wsd_decay_steps", "wsd_decay_style"):  # absent before WSD existed
            if key in state:
                setattr(self, key, state[key])


def build_lr_scheduler(opt_config, global_batch_size: int, train_samples: int):
    """Steps in samples: decay over --lr-decay-samples, else --lr-decay-iters x global batch,
    else the whole run; warmup from --lr-warmup-fraction|iters|samples. With a ds_config's
    scheduler, DeepSpeed's (``DeepSpeedScheduler``), counting one step per global batch."""
    if getattr(opt_config, "ds_scheduler", None):
        return DeepSpeedScheduler(opt_config.ds_scheduler, opt_config.ds_scheduler_params or {},
                                  base_lr=opt_config.lr, samples_per_step=global_batch_size)
    if opt_config.lr_decay_samples is not None:
        decay = opt_config.lr_decay_samples
    elif opt_config.lr_decay_iters is not None:
        decay = opt_config.lr_decay_iters * global_batch_size
    else:
        decay = train_samples
    decay = max(decay, 1)
    if opt_config.lr_warmup_fraction is not None:
        warmup = int(opt_config.lr_warmup_fraction * decay)
    elif opt_config.lr_warmup_samples:
        warmup = opt_config.lr_warmup_samples
    else:
        warmup = opt_config.lr_warmup_iters * global_batch_size
    wsd = opt_config.lr_wsd_decay_samples
    if wsd is None and opt_config.lr_wsd_decay_iters is not None:
        wsd = opt_config.lr_wsd_decay_iters * global_batch_size
    return LRScheduler(opt_config.lr, opt_config.min_lr, warmup, decay,
                       opt_config.lr_decay_style, wsd_decay_steps=wsd,
                       wsd_decay_style=opt_config.lr_wsd_decay_style)
