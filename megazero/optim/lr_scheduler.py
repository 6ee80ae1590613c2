"""Learning-rate schedule of Megatron (``OptimizerParamScheduler``): linear warmup, then
constant, linear or cosine decay to ``--min-lr``. Steps are counted in samples, so
``--train-iters`` and ``--train-samples`` runs (and rampup-free resumes) agree."""

from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str):
        if decay_steps <= 0:
            raise ValueError(f"lr decay steps must be positive, got {decay_steps}")
        if warmup_steps >= decay_steps and decay_style != "constant":
            raise ValueError(f"--lr-warmup-* ({warmup_steps} samples) must be shorter than the "
                             f"lr decay ({decay_steps} samples: --lr-decay-iters/samples or "
                             "the whole run)")
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.num_steps = 0

    def get_lr(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
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
                "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        # Like Megatron (without --override-opt_param-scheduler), the checkpoint's schedule
        # wins; only the step count must carry over for a resume to be exact.
        for key in ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style",
                    "num_steps"):
            setattr(self, key, state[key])


def build_lr_scheduler(opt_config, global_batch_size: int, train_samples: int) -> LRScheduler:
    """Steps in samples: decay over --lr-decay-samples, else --lr-decay-iters x global batch,
    else the whole run; warmup from --lr-warmup-fraction|iters|samples."""
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
    return LRScheduler(opt_config.lr, opt_config.min_lr, warmup, decay,
                       opt_config.lr_decay_style)
