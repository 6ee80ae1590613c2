"""What every config dataclass checks with: ``ConfigError`` and the range checks whose
messages name the flag, the value and the valid range; dtypes and signal names."""

from __future__ import annotations

import math
import numbers
import signal

import torch


class ConfigError(ValueError):
    """A flag value or combination of flags that megazero cannot run with."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _int_at_least(value, flag: str, low: int, note: str = "") -> None:
    """``value`` is an integer >= ``low`` (``note`` says what the edge value means)."""
    _check(isinstance(value, numbers.Integral) and not isinstance(value, bool)
           and value >= low,
           f"{flag} must be an integer >= {low}{note}, got {value!r}")


def _optional_int_at_least(value, flag: str, low: int) -> None:
    if value is not None:
        _int_at_least(value, flag, low)


def _finite(value, flag: str, *, positive: bool) -> None:
    """``value`` is a finite number, > 0 (``positive``) or >= 0."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > 0 if positive else value >= 0)
    _check(ok, f"{flag} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def _in_unit(value, flag: str, *, closed: bool = False) -> None:
    """``value`` is in [0, 1) (or [0, 1] when ``closed``); NaN is outside."""
    ok = isinstance(value, numbers.Real) and 0.0 <= value and \
        (value <= 1.0 if closed else value < 1.0)
    _check(ok, f"{flag} must be in [0, 1{']' if closed else ')'}, got {value!r}")


SEED_LIMIT = 2**63  # torch.manual_seed takes < 2^64, and megazero adds offsets to the seed
# Signals that --exit-signal-handler cannot catch.
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def signal_name(name) -> str | None:
    """The canonical name (``SIGTERM``) of a catchable signal given as ``SIGTERM``, ``TERM``
    or ``sigterm``; None when there is no such signal or it cannot be caught."""
    if not isinstance(name, str):
        return None
    canonical = name.strip().upper()
    if not canonical.startswith("SIG"):
        canonical = "SIG" + canonical
    if canonical in _UNCATCHABLE or canonical not in signal.Signals.__members__:
        return None
    return canonical


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
