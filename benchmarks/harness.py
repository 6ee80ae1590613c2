"""The benchmarks' shared harness: spawn gloo ranks, interleave contenders, stats, output.

Every multi-process benchmark in ``benchmarks/`` measures the same way, and this module holds
that way once:

* ``spawn(fn, world, *args)``: ``fn(*args)`` on ``world`` freshly spawned processes
  (``torch.multiprocessing`` spawn) that form a gloo group through a ``TCPStore`` on a free
  port, one thread per rank (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), the
  repository root on ``sys.path``. Returns every rank's result, in rank order; a rank that
  raises ``Skip`` makes the call raise ``Skip`` (a contender that cannot run here), a rank
  that fails makes it raise ``RankFailed`` with that rank's traceback, and no result within
  ``timeout`` seconds raises ``TimeoutError``. Fresh processes per call, so a process's peak
  RSS is its contender's own.
* ``interleave(contenders, rounds, run)``: every contender once per round, the order rotated
  by one each round (``rotated``: with two contenders the order alternates), so that machine
  noise hits all alike; a contender that skips or fails is left out of later rounds, its
  reason kept for the table.
* ``slowest_rank`` (a step's time is that of its slowest rank, phase by phase),
  ``step_summary`` (median over every measured step of every round, the range of the
  per-round medians, the median of each phase) and ``summarize`` (median, min, max).
* memory: ``peak_rss_kib`` (``ru_maxrss``), ``status_kib`` (a ``/proc/self/status`` field:
  ``VmRSS``, ``VmHWM``, ``RssAnon``) and ``reset_peak_rss`` (``VmHWM`` back to the current RSS).
* command line: ``add_round_args`` (``--contenders --warmup --steps --rounds --timeout
  --json``) and ``add_gpt_args`` (a GPT-2's shape).
* output: ``markdown_table`` (SKIP rows by ``contender_rows``, the timing cells by
  ``step_cells``, the protocol by ``rounds_text``), the ``start_line``/``end_line`` a run is
  framed by, and ``write_json`` (the payload with the host: CPU model and AVX-512 flags, core
  count, torch version, date).

The benchmarks import it as ``from benchmarks import harness`` (the repository root goes on
``sys.path`` first when they run as scripts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import resource
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Skip(Exception):
    """A contender that cannot run here (the reason is printed in the table)."""


class RankFailed(RuntimeError):
    """A rank of ``spawn`` raised: ``rank`` and ``text`` (``Type: message`` and traceback)."""

    def __init__(self, rank: int, text: str):
        super().__init__(text)
        self.rank, self.text = rank, text


# ---- processes -------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, out, pg_timeout):
    """One spawned rank: the gloo group, ``fn(*args)``, its result (or skip/error) to ``out``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    try:
        if port is not None:
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            out.put(("ok", rank, fn(*args)))
        except Skip as e:
            out.put(("skip", rank, str(e)))
        if port is not None:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        out.put(("err", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def spawn(fn: Callable, world: int, *args, timeout: float = 900.0, pg_timeout: float = 600.0,
          gloo: bool = True) -> list:
    """``fn(*args)`` on ``world`` fresh processes, a gloo group of them (``gloo=False``: plain
    processes, no group); every rank's return value, in rank order. ``fn`` must be picklable
    (a module-level function). Raises ``Skip`` if a rank raised it, ``RankFailed`` with the
    first failing rank's traceback, ``TimeoutError`` when not all ranks answered within
    ``timeout`` seconds. ``pg_timeout``: the process group's own timeout (seconds)."""
    ctx = mp.get_context("spawn")
    store = port = None
    if gloo:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        port = store.port
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, fn, args, out, pg_timeout)) for r in range(world)]
    for p in procs:
        p.start()
    results, skip, failed = [None] * world, None, None
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world):
            status, rank, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if status == "ok":
                results[rank] = value
            elif status == "skip":
                skip = skip or value
            else:
                failed = RankFailed(rank, value)
                break  # the others may wait for it in a collective: no use waiting for them
    except queue.Empty:
        failed = TimeoutError(f"no result in {timeout:g} s")
    finally:
        for p in procs:
            p.join(timeout=1 if failed else 30)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if failed is not None:
        raise failed
    if skip is not None:
        raise Skip(skip)
    return results


# ---- interleaved rounds ----------------------------------------------------------------------
def rotated(items: Sequence, k: int) -> list:
    """``items`` rotated left by ``k``: round k's order (the order alternates for two)."""
    items = list(items)
    k %= len(items) or 1
    return items[k:] + items[:k]


def interleave(contenders: Sequence, rounds: int, run: Callable,
               name: Callable = str) -> tuple[dict, dict]:
    """Every contender once per round, in ``rotated(contenders, round)`` order, over ``rounds``
    rounds: ``({contender: [run(contender) per round]}, {contender: reason})``. ``run``
    raising ``Skip`` leaves the contender out from then on with that reason; any other
    exception does too, printed to stderr (labelled ``name(contender)``), reason
    ``failed: <its first line>``."""
    results = {c: [] for c in contenders}
    skips: dict = {}
    for rnd in range(rounds):
        for c in rotated(contenders, rnd):
            if c in skips:
                continue
            try:
                results[c].append(run(c))
            except Skip as e:
                skips[c] = str(e)
            except Exception as e:  # noqa: BLE001 - reported, the other contenders go on
                text = str(e) if isinstance(e, RankFailed | TimeoutError) else \
                    f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                print(f"{name(c)} failed (round {rnd}):\n{text}", file=sys.stderr)
                skips[c] = f"failed: {(text.strip().splitlines() or ['?'])[0]}"
    return results, skips


# ---- statistics ------------------------------------------------------------------------------
def summarize(samples: Iterable[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of the samples."""
    xs = list(samples)
    if not xs:
        raise ValueError("summarize: no samples")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def slowest_rank(per_rank: Sequence[Sequence]) -> list:
    """Per step, the slowest rank: ``per_rank[r][i]`` is rank r's step i, a time or a tuple
    (the step and its phases); the result's step i is the max over ranks (per component)."""
    steps = list(zip(*per_rank))
    if steps and isinstance(steps[0][0], tuple | list):
        return [tuple(max(col) for col in zip(*step)) for step in steps]
    return [max(step) for step in steps]


def step_summary(rounds: Sequence[Sequence], phases: Sequence[str] = ()) -> dict:
    """From each round's slowest-rank steps (times, or tuples ``(step, *phases)``):
    ``{"step": median over all steps of all rounds, "range": (min, max) of the per-round
    medians, "phases": {phase: median over all steps}}``."""
    total = lambda s: s[0] if isinstance(s, tuple | list) else s
    every = [s for steps in rounds for s in steps]
    medians = summarize(statistics.median(total(s) for s in steps) for steps in rounds)
    return {"step": statistics.median(total(s) for s in every),
            "range": (medians["min"], medians["max"]),
            "phases": {p: statistics.median(s[j + 1] for s in every)
                       for j, p in enumerate(phases)}}


# ---- memory ----------------------------------------------------------------------------------
def peak_rss_kib() -> int:
    """Peak resident set of this process so far, KiB (``getrusage(RUSAGE_SELF).ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``, ``RssAnon``...); 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs``, Linux >= 4.0); False
    where that is not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---- command line ----------------------------------------------------------------------------
def at_least_one(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_round_args(parser: argparse.ArgumentParser, *, warmup: int, steps: int, rounds: int,
                   timeout: float, contenders: Sequence[str] = ()) -> None:
    """The flags of an interleaved benchmark: ``--contenders`` (when given: all by default),
    ``--warmup`` and ``--steps`` (per contender-round), ``--rounds``, ``--timeout`` (seconds
    per contender-round) and ``--json FILE``."""
    if contenders:
        parser.add_argument("--contenders", nargs="+", default=list(contenders),
                            choices=contenders)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=at_least_one, default=steps,
                        help="measured steps per round")
    parser.add_argument("--rounds", type=at_least_one, default=rounds)
    parser.add_argument("--timeout", type=float, default=timeout,
                        help="seconds per contender-round")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the rows, the arguments and the host here")


def add_gpt_args(parser: argparse.ArgumentParser, *, layers: int, hidden: int, heads: int,
                 seq: int, vocab: int, micro_batch: int | None = None,
                 micro_batch_help: str | None = None) -> None:
    """A GPT-2's shape: ``--layers --hidden --heads --seq --vocab`` (and ``--micro-batch``)."""
    for flag, default in (("--layers", layers), ("--hidden", hidden), ("--heads", heads),
                          ("--seq", seq), ("--vocab", vocab)):
        parser.add_argument(flag, type=int, default=default)
    if micro_batch is not None:
        parser.add_argument("--micro-batch", type=int, default=micro_batch,
                            help=micro_batch_help)


# ---- output ----------------------------------------------------------------------------------
def markdown_table(columns: Sequence[str], rows: Iterable[Sequence], align: str = "") -> str:
    """A markdown table: ``columns`` the header, each row's cells ``str()``-ed (a short row is
    padded with empty cells, as a SKIP row), ``align`` one letter per column, ``l`` (the
    default) or ``r``."""
    align = align.ljust(len(columns), "l")
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of l/r per column ({len(columns)})")

    def line(cells):
        cells = [str(c) for c in cells]
        if len(cells) > len(columns):
            raise ValueError(f"{len(cells)} cells for {len(columns)} columns: {cells}")
        cells += [""] * (len(columns) - len(cells))
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join([line(columns), rule, *(line(r) for r in rows)])


def contender_rows(keys: Iterable, rows: dict, skips: dict, cells: Callable,
                   label: Callable = lambda key: [key]) -> list[list]:
    """Table rows in ``keys`` order: ``label(key)`` and then ``cells(rows[key])``, or one
    ``SKIP: <reason>`` cell for a key in ``skips``."""
    return [[*label(k), f"SKIP: {skips[k]}"] if k in skips else [*label(k), *cells(rows[k])]
            for k in keys]


def step_cells(row: dict, ref: dict | None) -> list[str]:
    """A ``step_summary`` row's cells: step ms (median), round medians (ms, min-max) and the
    ratio to ``ref``'s step (``n/a`` without one)."""
    lo, hi = row["range"]
    ratio = f"{row['step'] / ref['step']:.2f}x" if ref else "n/a"
    return [f"{row['step'] * 1e3:.1f}", f"{lo * 1e3:.1f}-{hi * 1e3:.1f}", ratio]


def rounds_text(args, unit: str = "contender-round") -> str:
    """How an interleaved run measured, for the line above its table."""
    return (f"{args.rounds} rounds x {args.steps} measured steps (after {args.warmup} "
            f"warm-up), fresh processes per {unit}")


def start_line(*parts: str) -> str:
    """The line a run starts with: torch version, ``parts``, gloo with one thread per rank,
    the core count and the load average."""
    return ", ".join([f"torch {torch.__version__}", *parts, "gloo, 1 thread per rank",
                      f"{os.cpu_count()} CPUs",
                      f"load average {os.getloadavg()[0]:.1f} at start"])


def end_line(t_start: float) -> str:
    """The line a run ends with: its wall time since ``t_start`` (``time.perf_counter``) and
    the load average."""
    return (f"\ntotal time {time.perf_counter() - t_start:.0f} s, load average "
            f"{os.getloadavg()[0]:.1f} at the end")


def host() -> dict:
    """The machine a result was measured on: CPU model and AVX-512 flags (``/proc/cpuinfo``),
    core count, torch and Python versions, the date (UTC, ISO 8601)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = sorted(x for x in value.split() if x.startswith("avx512"))
                    break
    except OSError:
        pass
    return {"cpu": model, "avx512": flags, "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def write_json(path: str, payload: dict) -> dict:
    """Write ``{"host": host(), **payload}`` to ``path`` (tuples become lists); returns it."""
    doc = {"host": host(), **payload}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    return doc
