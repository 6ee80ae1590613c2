"""Where training is, and what the current log interval accumulated, kept without host syncs.

Each iteration's results (the losses, averaged over micro-batches and dp ranks; whether the
step was taken; the gradient norm) arrive as device tensors from the schedule and the
optimizer. ``TrainState.accumulate`` folds them into device-side sums and counters (a dozen
one-element kernels) and reads nothing, so an iteration that does not log never waits for the
device. ``settle`` reads everything once (one device-to-host copy of one small tensor) and moves
it into the host fields the log line, the skipped-iterations check and the history use; the
loop calls it at every ``--log-interval`` and before a checkpoint. Host values (an optimizer
that decides on the host) are accepted as well.

The arithmetic is the host's: float64 sums in iteration order, so the logged averages are the
same bits a Python accumulation gives. Local to the rank; nothing here communicates (the
losses arrive reduced over dp, and every rank's optimizer agreed on each step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megazero.distributed.device import host_values

# device counters: loss_iters, interval_skipped, interval_nan, consecutive_skipped,
# iteration of the last good loss (-1: none yet)
_LOSS_ITERS, _SKIPPED, _NAN, _CONSECUTIVE, _LAST_GOOD = range(5)


@dataclass
class TrainState:
    """Host view (settled) plus the device ledger of what is not read yet."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    loss_sums: dict = field(default_factory=dict)
    loss_iters: int = 0
    interval_skipped: int = 0
    interval_nan: int = 0
    last_grad_norm: float | None = None
    last_global_batch_size: int | None = None
    memory_logged: bool = False
    consecutive_skipped: int = 0
    last_finite_loss: tuple | None = None  # (iteration, {name: value}) of the last good step
    last_loss_scale: float | None = None
    # the device ledger (None until the first accumulate after a settle)
    _keys: tuple = ()
    _sums: torch.Tensor | None = None  # [k] float64: this interval's good losses
    _counts: torch.Tensor | None = None  # [5] int64 (see above)
    _last_losses: torch.Tensor | None = None  # [k] float64: the last good step's losses
    _norm: torch.Tensor | float | None = None  # the last step's gradient norm

    def accumulate(self, keys: tuple, losses: torch.Tensor | None, ok, grad_norm,
                   device: torch.device) -> None:
        """Fold one iteration into the ledger: ``losses`` [k] float64 (None on ranks without
        the loss), ``ok`` (bool or bool tensor: the step was taken), ``grad_norm``."""
        if self._counts is None or keys != self._keys:
            self._open(keys, device)
        ok = torch.as_tensor(ok, device=device).reshape(())
        finite = torch.isfinite(losses).all() if losses is not None and len(keys) else None
        good = ok if finite is None else ok & finite
        bad_loss = torch.zeros((), dtype=torch.bool, device=device) if finite is None \
            else ~finite
        c = self._counts
        c[:3] += torch.stack([good, ~ok, bad_loss]).long()
        c[_CONSECUTIVE] = torch.where(ok, 0, c[_CONSECUTIVE] + 1)
        if finite is not None:
            self._sums += torch.where(good, losses, 0.0)
            c[_LAST_GOOD] = torch.where(good, self.iteration, c[_LAST_GOOD])
            self._last_losses = torch.where(good, losses, self._last_losses)
        self._norm = grad_norm

    def _open(self, keys: tuple, device: torch.device) -> None:
        if self._counts is not None:
            self.settle()  # a new set of loss names: settle the old ones first
        self._keys = keys
        self._sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
        self._last_losses = torch.zeros(len(keys), dtype=torch.float64, device=device)
        self._counts = torch.zeros(5, dtype=torch.int64, device=device)
        self._counts[_CONSECUTIVE].fill_(self.consecutive_skipped)  # fill: no host copy
        self._counts[_LAST_GOOD].fill_(-1)

    def settle(self, loss_scale=None) -> None:
        """Read the ledger (one copy to the host) into the host fields; the interval's sums
        and counts move there and restart at zero. ``loss_scale`` (a float or a device
        tensor) is read in the same copy into ``last_loss_scale``."""
        if self._counts is None:
            if loss_scale is not None:
                self.last_loss_scale = float(host_values(torch.as_tensor(loss_scale))[0]) \
                    if torch.is_tensor(loss_scale) else float(loss_scale)
            return
        k = len(self._keys)
        parts = [self._sums, self._counts.double(), self._last_losses]
        norm_on_device = torch.is_tensor(self._norm)
        if norm_on_device:
            parts.append(self._norm.reshape(1).double())
        if torch.is_tensor(loss_scale):
            parts.append(loss_scale.reshape(1).double().to(self._sums.device))
        read = host_values(torch.cat(parts))
        sums, counts, last = read[:k], [int(v) for v in read[k:k + 5]], read[k + 5:2 * k + 5]
        rest = read[2 * k + 5:]
        if counts[_LOSS_ITERS]:  # names appear once a good iteration brought them
            for name, v in zip(self._keys, sums):
                # the first value of an interval enters as 0.0 + v, as the host's sum did
                self.loss_sums[name] = self.loss_sums.get(name, 0.0) + v
        self.loss_iters += counts[_LOSS_ITERS]
        self.interval_skipped += counts[_SKIPPED]
        self.skipped_iters += counts[_SKIPPED]
        self.interval_nan += counts[_NAN]
        self.nan_iters += counts[_NAN]
        self.consecutive_skipped = counts[_CONSECUTIVE]
        if counts[_LAST_GOOD] >= 0:
            self.last_finite_loss = (counts[_LAST_GOOD], dict(zip(self._keys, last)))
        if norm_on_device:
            self.last_grad_norm = rest.pop(0)
        elif self._norm is not None:
            self.last_grad_norm = float(self._norm)
        if torch.is_tensor(loss_scale):
            self.last_loss_scale = rest.pop(0)
        elif loss_scale is not None:
            self.last_loss_scale = float(loss_scale)
        self._counts = None  # the next accumulate opens a fresh ledger
