"""Look at a pipeline schedule: Chrome trace, PNG timeline and measured bubble per stage.

Reads the JSON that ``--pipeline-trace FILE`` makes pretrain write (``PipelineTrace.save``:
``{"format": "megazero-pipeline-trace-v1", "ranks": [{"rank", "tp_rank", "dp_rank",
"pp_rank", "pp_size", "virtual_pp_size", "events": [{"iteration", "kind", "microbatch",
"chunk", "start", "end"}]}]}``, times in seconds from the first event) and writes

* a Chrome trace (chrome://tracing, https://ui.perfetto.dev): one process per pipeline stage
  (pid = pp rank), one thread per tp/dp coordinate (tid = dp_rank * tp_size + tp_rank), one
  complete event per forward/backward named ``F3`` / ``B3`` (``F3.c1`` for chunk 1 of the
  interleaved schedule), in microseconds;
* a PNG timeline of one iteration (needs matplotlib, the ``test`` extra): one row per stage
  (its dp 0, tp 0 rank; ``--all-ranks`` for one row per rank), forwards and backwards coloured
  apart, micro-batch numbers in the boxes that fit, idle time as grey gaps, and a title with
  p, m, v and the measured bubble against the theory.

The bubble of a rank is its idle time (not inside a forward or backward: waiting for a
neighbour, p2p, schedule overhead) over the iteration's span on its pipeline (first start to
last end over the ranks with the same tp and dp coordinates). For p stages, m micro-batches
and v chunks per rank with uniform stages, the theory is ``(p-1) / (v*m + p-1)`` on every
stage, whatever the ratio of backward to forward time: ``(p-1)/v`` forward+backward times of
idle out of ``m + (p-1)/v``.

    python -m megazero.tools.pipeline_trace trace.json [--chrome OUT.json] [--png OUT.png]
        [--iteration N] [--all-ranks]

Without ``--chrome``/``--png`` it writes ``trace.chrome.json`` and ``trace.png`` beside the
input (the PNG only if matplotlib is installed). ``--iteration`` defaults to the last one
recorded (the first includes warm-up costs); the Chrome trace holds every iteration unless
``--iteration`` is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections import defaultdict

logger = logging.getLogger(__name__)

FORMAT = "megazero-pipeline-trace-v1"
COLORS = {  # (kind, chunk parity) -> colour: darker for even chunks, lighter for odd ones
    ("forward", 0): "#3b75af", ("forward", 1): "#8fb8de",
    ("backward", 0): "#e1812c", ("backward", 1): "#f5bf8a",
}
IDLE_COLOR = "#e6e6e6"


# ---- reading -----------------------------------------------------------------------------
def load(path: str) -> dict:
    """The trace written by ``PipelineTrace.save``; raises ValueError if it is not one."""
    with open(path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or trace.get("format") != FORMAT or "ranks" not in trace:
        raise ValueError(f"{path} is not a megazero pipeline trace (expected format "
                         f"{FORMAT!r}, written by --pipeline-trace)")
    return trace


def iterations(trace: dict) -> list[int]:
    """The iterations that have events, sorted."""
    return sorted({e["iteration"] for r in trace["ranks"] for e in r["events"]})


def _resolve_iteration(trace: dict, iteration: int | None) -> int:
    its = iterations(trace)
    if not its:
        raise ValueError("the trace holds no events")
    if iteration is None:
        return its[-1]
    if iteration not in its:
        raise ValueError(f"iteration {iteration} is not in the trace (it has {its})")
    return iteration


def _events(rank: dict, iteration: int | None) -> list[dict]:
    evs = [e for e in rank["events"] if iteration is None or e["iteration"] == iteration]
    return sorted(evs, key=lambda e: e["start"])


def _pipeline_key(rank: dict) -> tuple[int, int]:
    return rank.get("dp_rank", 0), rank.get("tp_rank", 0)


def describe(trace: dict, iteration: int | None = None) -> dict:
    """p, m, v and the schedule's name for one iteration."""
    it = _resolve_iteration(trace, iteration)
    ranks = trace["ranks"]
    p = max(r.get("pp_size", 1) for r in ranks)
    v = max(r.get("virtual_pp_size", 1) or 1 for r in ranks)
    m = len({e["microbatch"] for r in ranks for e in _events(r, it)})
    schedule = "no pipelining" if p == 1 else "1F1B" if v == 1 else "interleaved 1F1B"
    return {"p": p, "m": m, "v": v, "iteration": it, "schedule": schedule}


def theory_bubble(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage for uniform stages: ``(p-1) / (v*m + p-1)``."""
    return (p - 1) / (v * m + p - 1)


def event_name(event: dict, virtual: bool) -> str:
    """``F3`` / ``B3``, or ``F3.c1`` when ranks hold several chunks."""
    name = f"{event['kind'][0].upper()}{event['microbatch']}"
    return f"{name}.c{event['chunk']}" if virtual else name


# ---- bubble ------------------------------------------------------------------------------
def _busy(events: list[dict], t0: float, t1: float) -> float:
    """Length of the union of the spans, clipped to [t0, t1]."""
    busy, cursor = 0.0, t0
    for e in events:  # sorted by start
        s, t = max(e["start"], cursor), min(e["end"], t1)
        if t > s:
            busy += t - s
        cursor = max(cursor, e["end"])
    return busy


def rank_bubbles(trace: dict, iteration: int | None = None,
                 window: str = "iteration") -> dict[int, float]:
    """Idle fraction of each rank (by global rank) in one iteration.

    ``window="iteration"``: over the iteration's span on the rank's pipeline (first start to
    last end over the ranks with the same tp and dp coordinates); this is what the theory
    ``(p-1)/(v*m+p-1)`` describes. ``window="stage"``: over the rank's own first start to last
    end (a later stage starts later and ends earlier, so its share is smaller).
    """
    if window not in ("iteration", "stage"):
        raise ValueError(f"window must be 'iteration' or 'stage', not {window!r}")
    it = _resolve_iteration(trace, iteration)
    per_rank = {r["rank"]: _events(r, it) for r in trace["ranks"]}
    spans = defaultdict(list)
    for r in trace["ranks"]:
        spans[_pipeline_key(r)].extend(per_rank[r["rank"]])
    out = {}
    for r in trace["ranks"]:
        evs = per_rank[r["rank"]]
        if not evs:
            continue
        pool = spans[_pipeline_key(r)] if window == "iteration" else evs
        t0, t1 = min(e["start"] for e in pool), max(e["end"] for e in pool)
        total = t1 - t0
        out[r["rank"]] = max(0.0, 1.0 - _busy(evs, t0, t1) / total) if total > 0 else 0.0
    return out


def bubble_fraction(trace: dict, iteration: int | None = None,
                    window: str = "iteration") -> dict[int, float]:
    """Measured bubble of each pipeline stage in one iteration: {pp_rank: idle / total}.

    Averaged over the tp and dp ranks of the stage; see ``rank_bubbles`` for ``window``.
    ``iteration=None`` takes the last iteration recorded.
    """
    per_rank = rank_bubbles(trace, iteration, window)
    by_stage = defaultdict(list)
    for r in trace["ranks"]:
        if r["rank"] in per_rank:
            by_stage[r["pp_rank"]].append(per_rank[r["rank"]])
    return {s: sum(v) / len(v) for s, v in sorted(by_stage.items())}


# ---- Chrome trace ------------------------------------------------------------------------
def to_chrome(trace: dict, iteration: int | None = None) -> dict:
    """Chrome trace events: one process per stage, one thread per (dp, tp) rank, one "X"
    event per forward/backward (all iterations unless ``iteration`` is given)."""
    ranks = trace["ranks"]
    tp_size = max(r.get("tp_rank", 0) for r in ranks) + 1
    virtual = max(r.get("virtual_pp_size", 1) or 1 for r in ranks) > 1
    out, stages = [], set()
    for r in sorted(ranks, key=lambda r: r["rank"]):
        pid = r["pp_rank"]
        tid = r.get("dp_rank", 0) * tp_size + r.get("tp_rank", 0)
        if pid not in stages:
            stages.add(pid)
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"stage {pid}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                        "args": {"sort_index": pid}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": f"dp {r.get('dp_rank', 0)} tp {r.get('tp_rank', 0)} "
                                     f"(rank {r['rank']})"}})
        for e in _events(r, iteration):
            out.append({"ph": "X", "name": event_name(e, virtual), "cat": e["kind"],
                        "pid": pid, "tid": tid, "ts": e["start"] * 1e6,
                        "dur": (e["end"] - e["start"]) * 1e6,
                        "args": {"iteration": e["iteration"], "microbatch": e["microbatch"],
                                 "chunk": e["chunk"], "rank": r["rank"]}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome(trace: dict, path: str, iteration: int | None = None) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome(trace, iteration), f)


# ---- PNG timeline ------------------------------------------------------------------------
def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("the PNG timeline needs matplotlib: pip install matplotlib "
                          "(or megazero's 'test' extra); --chrome works without it") from e
    return Figure, FigureCanvasAgg, Patch


def write_png(trace: dict, path: str, iteration: int | None = None,
              all_ranks: bool = False) -> dict:
    """Timeline of one iteration, one row per stage (or per rank); returns ``describe()``
    with the measured bubbles. No pyplot: the global matplotlib backend is left alone."""
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    info = describe(trace, iteration)
    it = info["iteration"]
    rows = sorted(trace["ranks"], key=lambda r: (r["pp_rank"], *_pipeline_key(r)))
    if not all_ranks:
        rows = [r for r in rows if _pipeline_key(r) == (0, 0)]
    bubbles = rank_bubbles(trace, it)
    stage_bubbles = bubble_fraction(trace, it)
    info["bubble"] = sum(stage_bubbles.values()) / len(stage_bubbles)
    info["theory"] = theory_bubble(info["p"], info["m"], info["v"])
    t0 = min(e["start"] for r in rows for e in _events(r, it))
    t1 = max(e["end"] for r in rows for e in _events(r, it))
    span_ms = (t1 - t0) * 1e3

    fig = Figure(figsize=(14, 1.2 + 0.55 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0, span_ms)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # stage 0 on top: the staircase runs down-right
    fig.subplots_adjust(left=0.1, right=0.92, top=1 - 0.75 / fig.get_figheight(),
                        bottom=0.5 / fig.get_figheight() + 0.02)
    px_per_ms = ax.get_window_extent().width / span_ms
    fontsize = 8
    char_px = 0.62 * fontsize * fig.dpi / 72
    for y, r in enumerate(rows):
        ax.broken_barh([(0, span_ms)], (y - 0.4, 0.8), facecolors=IDLE_COLOR)
        for e in _events(r, it):
            x, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), edgecolor="white", linewidth=0.5,
                           facecolors=COLORS[(e["kind"], e["chunk"] % 2)])
            label = str(e["microbatch"])
            if w * px_per_ms >= len(label) * char_px + 3:
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=fontsize,
                        color="black" if e["chunk"] % 2 else "white")
        ax.text(span_ms * 1.005, y, f"{bubbles[r['rank']]:.1%} idle", va="center",
                fontsize=fontsize)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {r['pp_rank']}" + (f" dp{r.get('dp_rank', 0)} tp"
                                                    f"{r.get('tp_rank', 0)}" if all_ranks else "")
                        + f" (rank {r['rank']})" for r in rows], fontsize=fontsize + 1)
    ax.set_xlabel(f"ms from the iteration's first forward (iteration {it})")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=COLORS[("forward", 0)], label="forward"),
               Patch(color=COLORS[("backward", 0)], label="backward")]
    if info["v"] > 1:
        handles = [Patch(color=COLORS[(k, c)], label=f"{k} (chunk {'even' if c == 0 else 'odd'})")
                   for k in ("forward", "backward") for c in (0, 1)]
    handles.append(Patch(color=IDLE_COLOR, label="idle"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(handles),
              fontsize=fontsize, frameon=False)
    fig.suptitle(f"{info['schedule']}: p={info['p']}, m={info['m']}, v={info['v']}; bubble "
                 f"{info['bubble']:.1%} measured (mean of stages), {info['theory']:.1%} "
                 f"theory (p-1)/(vm+p-1)", fontsize=11, y=1 - 0.12 / fig.get_figheight())
    fig.savefig(path)
    return info


# ---- command line ------------------------------------------------------------------------
def _summary(trace: dict, iteration: int | None) -> str:
    info = describe(trace, iteration)
    stages = bubble_fraction(trace, info["iteration"])
    theory = theory_bubble(info["p"], info["m"], info["v"])
    lines = [f"{info['schedule']}: p={info['p']} m={info['m']} v={info['v']}, iteration "
             f"{info['iteration']}; theory (p-1)/(vm+p-1) = {theory:.1%}",
             f"{'stage':>6}{'bubble':>9}"]
    lines += [f"{s:>6}{b:>9.1%}" for s, b in stages.items()]
    lines.append(f"{'mean':>6}{sum(stages.values()) / len(stages):>9.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazero.tools.pipeline_trace",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="JSON written by --pipeline-trace")
    parser.add_argument("--chrome", help="Chrome trace to write (default: <trace>.chrome.json "
                                         "when neither --chrome nor --png is given)")
    parser.add_argument("--png", help="PNG timeline to write (default: <trace>.png when "
                                      "neither is given and matplotlib is installed)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to draw and measure (default: the last one); also "
                             "restricts the Chrome trace to it")
    parser.add_argument("--all-ranks", action="store_true",
                        help="one PNG row per rank instead of per stage (dp 0, tp 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    trace = load(args.trace)
    _resolve_iteration(trace, args.iteration)  # a clear error before writing anything
    chrome, png, png_optional = args.chrome, args.png, False
    if chrome is None and png is None:
        stem = os.path.splitext(args.trace)[0]
        chrome, png, png_optional = stem + ".chrome.json", stem + ".png", True
    if chrome:
        write_chrome(trace, chrome, args.iteration)
        logger.info("wrote %s (open in chrome://tracing or https://ui.perfetto.dev)", chrome)
    if png:
        try:
            write_png(trace, png, args.iteration, args.all_ranks)
            logger.info("wrote %s", png)
        except ImportError as e:
            if not png_optional:
                parser.error(str(e))
            logger.info("no PNG: %s", e)
    logger.info("%s", _summary(trace, args.iteration))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
