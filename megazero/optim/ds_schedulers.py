"""DeepSpeed's learning-rate schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``),
counted in optimizer steps, with the interface of megazero's ``LRScheduler`` (``get_lr``,
``step(increment)``, ``state_dict``) so that the optimizer and checkpoints take either.

DeepSpeed's semantics: the scheduler starts at step index -1 (the learning rate of the first
update is the warmup's start), and ``step()`` after each update advances it. During the
warmup of ``warmup_num_steps`` steps the fraction ``gamma`` rises as
``log(i + 1) / log(warmup_num_steps)`` ("log", DeepSpeed's default) or ``i /
warmup_num_steps`` ("linear"), and ``lr = warmup_min_lr + gamma (warmup_max_lr -
warmup_min_lr)``; then WarmupLR holds ``warmup_max_lr``, WarmupDecayLR decays ``gamma`` linearly
to 0 at ``total_num_steps``, and WarmupCosineLR multiplies the optimizer's lr by a ratio that
warms from ``warmup_min_ratio`` to 1 and decays by a half cosine to ``cos_min_ratio``.

``samples_per_step``: what one ``step(increment)`` unit is worth, so that pretrain (which
advances schedules by samples) and the engine (by steps) both count optimizer steps. Local
arithmetic only.
"""

from __future__ import annotations

import math

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
WARMUP_TYPES = ("log", "linear")


class DeepSpeedScheduler:
    """One of DeepSpeed's three warmup schedules (``kind``) over ``base_lr`` (the optimizer's
    lr: WarmupCosineLR's reference; the others set their own range)."""

    def __init__(self, kind: str, params: dict, base_lr: float, samples_per_step: int = 1):
        if kind not in SCHEDULERS:
            raise ValueError(f"scheduler type must be one of {', '.join(SCHEDULERS)}, got "
                             f"{kind!r}")
        self.kind, self.base_lr = kind, float(base_lr)
        self.samples_per_step = max(int(samples_per_step), 1)
        self.warmup_num_steps = max(int(params.get("warmup_num_steps", 1000)), 2)
        self.warmup_type = params.get("warmup_type", "log")
        if self.warmup_type not in WARMUP_TYPES:
            raise ValueError(f"scheduler.params.warmup_type must be log or linear, got "
                             f"{self.warmup_type!r}")
        self.min_lr = float(params.get("warmup_min_lr", 0.0))
        self.max_lr = float(params.get("warmup_max_lr", 0.001))
        self.total_num_steps = int(params.get("total_num_steps", 0))
        self.warmup_min_ratio = float(params.get("warmup_min_ratio", 0.0))
        self.cos_min_ratio = float(params.get("cos_min_ratio", 0.0001))
        self.last_batch_iteration = -1  # DeepSpeed's index of the last step taken
        self._pending = 0  # samples not yet worth a whole step

    def _warmup_fraction(self, i: int) -> float:
        if self.warmup_type == "log":
            return math.log(i + 1) / math.log(self.warmup_num_steps)
        return i / self.warmup_num_steps

    def get_lr(self, num_steps: int | None = None) -> float:
        """The learning rate of the next update (after ``last_batch_iteration``)."""
        i = self.last_batch_iteration if num_steps is None else num_steps - 1
        if self.kind == "WarmupCosineLR":
            return self.base_lr * self._cosine_ratio(i)
        if i < 0:
            return self.min_lr
        if i < self.warmup_num_steps:
            gamma = self._warmup_fraction(i)
        elif self.kind == "WarmupLR":
            gamma = 1.0
        else:  # WarmupDecayLR
            gamma = max(0.0, (self.total_num_steps - i)
                        / max(1.0, self.total_num_steps - self.warmup_num_steps))
        return self.min_lr + gamma * (self.max_lr - self.min_lr)

    def _cosine_ratio(self, i: int) -> float:
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction(i) * (1 - self.warmup_min_ratio)
        done = i - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cos = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cos)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` units (``samples_per_step`` units make one step)."""
        self._pending += int(increment)
        steps, self._pending = divmod(self._pending, self.samples_per_step)
        self.last_batch_iteration += steps
        return self.get_lr()

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken (DeepSpeed's ``last_batch_iteration + 1``)."""
        return self.last_batch_iteration + 1

    def state_dict(self) -> dict:
        return {"deepspeed_scheduler": self.kind, "last_batch_iteration":
                self.last_batch_iteration, "pending_samples": self._pending}

    def load_state_dict(self, state: dict) -> None:
        kind = state.get("deepspeed_scheduler")
        if kind is None:
            raise ValueError("the checkpoint's learning-rate schedule is megazero's "
                             "(Megatron's); this run uses DeepSpeed's "
                             f"{self.kind}: drop the config's scheduler, or load with "
                             "load_lr_scheduler_states=False / --finetune")
        if kind != self.kind:
            raise ValueError(f"the checkpoint's schedule is {kind}, this run's {self.kind}")
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._pending = int(state.get("pending_samples", 0))


__all__ = ["SCHEDULERS", "DeepSpeedScheduler"]
