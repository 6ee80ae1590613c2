"""What every config dataclass checks with: ``ConfigError`` and the range checks whose
messages name the flag, the value and the valid range; ``Needs``, a flag that acts in one
mode only; dtypes and signal names."""

from __future__ import annotations

import dataclasses
import math
import numbers
import signal
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Needs:
    """A flag that acts in one mode only (``mode(section)`` says whether the config section
    is in it): given outside that mode, it is refused with ``{flag} {acts}: it needs
    {needs}`` (``needs`` formatted with the section's fields), never accepted and ignored.

    ``check_given`` refuses the flag given on the command line, at any value (its default
    too). ``by_value`` also makes the dataclass refuse a value other than the field's default
    outside the mode (API and ds_config users too); it is off where a saved config is
    legitimately rebuilt outside the mode (generation and conversion retarget to ZeRO-0 and
    one pipeline stage, the dry run drops --load and --tensorboard-dir, --compile turns the
    fusions off), and for checkpoints written before the flag was refused."""

    flags: tuple[str, ...]  # its spellings; a refused value names the first
    field: str  # the section's field that the flag sets
    mode: Callable[[object], bool]
    acts: str  # what the flag does, after its name
    needs: str  # the mode, in flags
    by_value: bool = False

    def message(self, section, flag: str | None = None) -> str:
        needs = self.needs.format(**vars(section))
        return f"{flag or self.flags[0]} {self.acts}: it needs {needs}"


def field_default(cls, name: str):
    """The default of dataclass field ``cls.name``."""
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def check_modes(section, table) -> None:
    """The dataclass's own refusal: a ``by_value`` flag's field away from its default outside
    the flag's mode (called last in ``__post_init__``, after the range checks)."""
    for n in table:
        if n.by_value and not n.mode(section) \
                and getattr(section, n.field) != field_default(type(section), n.field):
            raise ConfigError(n.message(section))


def given_outside_mode(section, table, given) -> list[str]:
    """One message per flag of ``table`` in ``given`` (the spellings on the command line)
    whose mode ``section`` is not in."""
    return [n.message(section, flag) for n in table for flag in n.flags
            if flag in given and not n.mode(section)]


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
