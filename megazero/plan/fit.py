"""Fit a GPU system's four efficiency constants to published Megatron-LM runs, and score the
fit on rows it did not see (``python -m megazero.plan.fit``).

What is fitted: ``Efficiency``'s ``gemm_max``, ``gemm_half_dim``, ``hbm`` and ``network``
of ``a100-80g`` (the only GPU with published rows: ``published.py``). Every other number of
a system file is a datasheet figure with its source in ``_sources``. ``h100-80g`` has no
published row: it takes the A100 fit, and its file says so.

The fit:

* **Data**: the 18 rows of ``published.ROWS`` (Narayanan et al. 2021 Table 1, Korthikanti et
  al. 2022 Table 5), each predicted as ``published.predict`` does for a user: the planner's
  recommended micro-batch/interleave (its fastest candidate), at the published tp/pp/dp,
  batch and recompute.
* **Objective**: the mean squared ``log(predicted / published)`` over the rows fitted on
  (TFLOP/s per GPU and seconds per iteration are both inverse-proportional in step time, so
  the log error is the relative error of the time, symmetric in over- and under-prediction).
* **Search**: exhaustive over ``GRID``. With the runtime of the published runs
  (``MEGATRON_2021``: nothing overlapped) a fixed layout's step time is exactly linear in
  ``x = (1/gemm_max, gemm_half_dim/gemm_max, 1/hbm, 1/network, 1)`` (GEMMs, memory-bound
  kernels and ring collectives each scale with one of them), so five ``cost.step_time``
  evaluations give each candidate's time over the whole grid; ``_coefficients`` checks the
  linearity at a sixth point and fails if the cost model stops being linear.
* **Held-out error**: leave-one-paper-out (fit on one paper's rows, predict the other's)
  and leave-one-model-out (12 folds: every row of a model is held out together, so the two
  papers' 530B and 1T rows never predict each other). Each held-out row is predicted at
  the candidate the planner would recommend under that fold's constants.
* **Spread**: at the shipped constants, the error of every other fitting candidate of a
  row (what a user gets at a micro-batch the planner did not pick).

``python -m megazero.plan.fit`` refits, prints the report and exits 1 if the shipped files'
constants differ from the fit; ``--out DIR`` writes the fitted system files there (the
repository's ``megazero/plan/systems`` to update them); ``--json`` writes the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np

from megazero.plan.cost import OVERLAP_LOSS, step_time
from megazero.plan.published import (
    ROWS,
    PublishedRun,
    candidate_layouts,
    job,
    metric,
    predict,
    predict_published,
    published_layout,
    runtime,
)
from megazero.plan.system import (
    SYSTEMS_DIR,
    Efficiency,
    PlanInputError,
    read_system,
    system_from_dict,
)

FITTED = ("gemm_max", "gemm_half_dim", "hbm", "network")
# the grid searched (inclusive ranges): an efficiency is a fraction of a datasheet figure
GRID = {"gemm_max": np.round(np.arange(0.50, 1.0001, 0.01), 2),
        "gemm_half_dim": np.arange(0.0, 512.1, 8.0),
        "hbm": np.round(np.arange(0.30, 1.0001, 0.05), 2),
        "network": np.round(np.arange(0.30, 1.0001, 0.05), 2)}
# the system fitted and the systems that take its constants (no published rows of their own)
FITTED_SYSTEM = "a100-80g"
TRANSFERRED = ("h100-80g",)
FLAT = 1.01  # a constant's "flat range": grid values within 1% of the best objective


def _features(e: Efficiency) -> np.ndarray:
    return np.array([1 / e.gemm_max, e.gemm_half_dim / e.gemm_max, 1 / e.hbm, 1 / e.network,
                     1.0])


def _at(system, e: Efficiency):
    return dataclasses.replace(system, efficiency=e)


def _coefficients(run: PublishedRun, system) -> np.ndarray:
    """[3, 5]: the published layout's step time without its data-parallel exposure, the
    data-parallel collectives' duration, and the compute that hides them, each
    ``coefficients[i] @ _features(efficiency)``; ``_time`` combines them as ``cost.step_time``
    does, checked at a point not solved for."""
    points = [Efficiency(1.0, 0.0, 1.0, 1.0), Efficiency(0.5, 0.0, 1.0, 1.0),
              Efficiency(1.0, 10.0, 1.0, 1.0), Efficiency(1.0, 0.0, 0.5, 1.0),
              Efficiency(1.0, 0.0, 1.0, 0.5)]
    check = Efficiency(0.73, 37.0, 0.61, 0.83)
    lay, rt = published_layout(run), runtime(run)

    def parts(e):
        st = step_time(job(run), lay, _at(system, e), rt)
        return [st.total - st.dp_exposed, st.dp_comm, st.parts["dp_window"]]
    X = np.array([_features(e) for e in points])  # [5 points, 5 features]
    coef = np.linalg.solve(X, np.array([parts(e) for e in points])).T  # [3, 5]
    want = step_time(job(run), lay, _at(system, check), rt).total
    got = _time(run, *(c @ _features(check) for c in coef))
    if abs(got - want) > 1e-9 * want:
        raise RuntimeError(f"the step time of {run.model} at {lay.short()} is not linear in "
                           "the efficiency features: the fit's search is invalid")
    return coef


def _time(run: PublishedRun, rest, busy, window):
    """cost.step_time's total from its parts (numbers or arrays over the grid)."""
    if not run.ddp_overlap:
        return rest + busy
    return rest + np.maximum(busy * OVERLAP_LOSS, busy - window * (1 - OVERLAP_LOSS))


class Fit:
    """Every row's log error at its published layout at every grid point, and fits over any
    subset of rows."""

    def __init__(self, system, rows=ROWS):
        self.system, self.rows = system, list(rows)
        mesh = np.meshgrid(*(GRID[k] for k in FITTED), indexing="ij")
        self.points = np.stack([m.ravel() for m in mesh], axis=1)  # [n_grid, 4]
        gm, d, hbm, net = self.points.T
        feats = [1 / gm, d / gm, 1 / hbm, 1 / net]
        self.log_err = np.empty((len(self.points), len(self.rows)))  # [n_grid, n_rows]
        for j, run in enumerate(self.rows):
            # elementwise (the same on every host), not a BLAS product
            parts = [feats[0] * c[0] + feats[1] * c[1] + feats[2] * c[2] + feats[3] * c[3]
                     + c[4] for c in _coefficients(run, system)]
            self.log_err[:, j] = np.log(metric(run, _time(run, *parts)) / run.published)

    def objective(self, rows: list[int]) -> np.ndarray:
        # rounded so that hosts agreeing to 1e-12 pick the same grid point
        return np.round(np.mean(self.log_err[:, rows] ** 2, axis=1), 12)

    def best(self, rows: list[int]) -> Efficiency:
        i = int(np.argmin(self.objective(rows)))
        return Efficiency(**{k: float(v) for k, v in zip(FITTED, self.points[i])})

    def held_out(self, groups: dict) -> tuple[list, list]:
        """(error at the published layout, error at the planner's recommendation) of each
        row, predicted with the constants fitted on the other groups' rows."""
        pub, rec = [math.nan] * len(self.rows), [math.nan] * len(self.rows)
        for rows in groups.values():
            e = self.best([j for j in range(len(self.rows)) if j not in rows])
            for j in rows:
                pub[j], rec[j] = _errors(self.rows[j], _at(self.system, e))
        return pub, rec


def _errors(run: PublishedRun, system) -> tuple[float, float]:
    """Relative errors at the published layout and at the planner's recommendation."""
    return (predict_published(run, system)[0] / run.published - 1,
            predict(run, system)[0] / run.published - 1)


def candidate_errors(run: PublishedRun, system) -> list[tuple]:
    """(layout, relative error, seconds) of every candidate of ``run``, fastest first (the
    planner's recommendation)."""
    out = []
    for lay in candidate_layouts(run):
        t = step_time(job(run), lay, system, runtime(run)).total
        out.append((lay, metric(run, t) / run.published - 1, t))
    return sorted(out, key=lambda x: x[2])


def _groups(rows, key) -> dict:
    out: dict = {}
    for j, run in enumerate(rows):
        out.setdefault(key(run), []).append(j)
    return out


def report(fit: Fit) -> dict:
    """The fitted constants, their flat ranges, and every row's in-sample, held-out and
    candidate-spread errors."""
    every = list(range(len(fit.rows)))
    obj = fit.objective(every)
    eff = fit.best(every)
    near = fit.points[obj <= obj.min() * FLAT]
    system = _at(fit.system, eff)
    lopo, lopo_rec = fit.held_out(_groups(fit.rows, lambda r: r.paper))
    lomo, lomo_rec = fit.held_out(_groups(fit.rows, lambda r: r.model))
    rows = []
    for j, run in enumerate(fit.rows):
        pub, _ = predict_published(run, system)
        cands = candidate_errors(run, system)
        others = [err for _, err, _ in cands[1:]]
        rows.append({"paper": run.paper, "source": run.source,
                     "layout_source": run.layout_source, "model": run.model,
                     "recompute": run.recompute, "published": run.published,
                     "layout": published_layout(run).short(), "predicted": pub,
                     "in_sample": pub / run.published - 1,
                     "leave_one_paper_out": lopo[j], "leave_one_model_out": lomo[j],
                     "recommended": cands[0][0].short(), "recommended_in_sample": cands[0][1],
                     "recommended_leave_one_model_out": lomo_rec[j],
                     "others": [min(others), max(others)] if others else None,
                     "candidates": len(cands)})

    def summary(errs):
        a = [abs(x) for x in errs]
        return {"mean_abs": sum(a) / len(a), "max_abs": max(a)}
    return {
        "fitted": {k: getattr(eff, k) for k in FITTED},
        "flat_range": {k: [float(near[:, n].min()), float(near[:, n].max())]
                       for n, k in enumerate(FITTED)},
        "objective": "mean squared log(predicted / published) at the published layouts",
        "grid": {k: [float(v[0]), float(v[-1]), float(v[1] - v[0])] for k, v in GRID.items()},
        "rows": rows,
        "in_sample": summary([r["in_sample"] for r in rows]),
        "leave_one_paper_out": summary(lopo),
        "leave_one_model_out": summary(lomo),
        "recommended_in_sample": summary([r["recommended_in_sample"] for r in rows]),
        "recommended_leave_one_model_out": summary(lomo_rec),
        "command": "python -m megazero.plan.fit",
    }


def fitted_file(name: str, data: dict, rep: dict) -> dict:
    """``data`` (a system file's JSON) with the fitted efficiency and its provenance."""
    out = dict(data)
    out["efficiency"] = dict(rep["fitted"])
    sources = dict(out.get("_sources", {}))
    held = rep["leave_one_model_out"]
    what = (f"fitted by python -m megazero.plan.fit on {len(rep['rows'])} published "
            f"Megatron-LM runs on A100-80GB (megazero/plan/published.py); held-out error "
            f"(leave one model out) {held['mean_abs']:.1%} mean, {held['max_abs']:.1%} worst")
    if name != FITTED_SYSTEM:
        what = (f"taken from {FITTED_SYSTEM} (no published {name} rows to fit on): " + what
                + "; expect this GPU to reach a different fraction of its peak")
    sources["efficiency"] = what
    out["_sources"] = sources
    out["_fit"] = {"fitted_on": FITTED_SYSTEM, "command": rep["command"],
                   "objective": rep["objective"], "grid": rep["grid"],
                   "flat_range": rep["flat_range"],
                   "rows": [f"{r['source']}: {r['model']} {r['recompute']}"
                            for r in rep["rows"]],
                   "leave_one_paper_out": rep["leave_one_paper_out"],
                   "leave_one_model_out": rep["leave_one_model_out"]}
    return out


def table(rep: dict) -> list[str]:
    lines = [f"{'model':<14}{'recompute':<10}{'layout':<24}{'published':>9}{'predicted':>10}"
             f"{'fit':>7}{'LOPO':>7}{'LOMO':>7}  {'recommended':<24}{'fit':>7}{'LOMO':>7}"
             "  others"]
    for r in rep["rows"]:
        spread = ("-" if r["others"] is None
                  else f"{r['others'][0]:+.0%}..{r['others'][1]:+.0%}")
        lines.append(f"{r['model']:<14}{r['recompute']:<10}{r['layout']:<24}"
                     f"{r['published']:>9.2f}{r['predicted']:>10.2f}{r['in_sample']:>+7.1%}"
                     f"{r['leave_one_paper_out']:>+7.1%}{r['leave_one_model_out']:>+7.1%}  "
                     f"{r['recommended']:<24}{r['recommended_in_sample']:>+7.1%}"
                     f"{r['recommended_leave_one_model_out']:>+7.1%}  {spread}")
    for k in ("in_sample", "leave_one_paper_out", "leave_one_model_out",
              "recommended_in_sample", "recommended_leave_one_model_out"):
        s = rep[k]
        lines.append(f"{k}: mean |error| {s['mean_abs']:.1%}, worst {s['max_abs']:.1%}")
    lines.append("fitted: " + ", ".join(
        f"{k} {v:g} (flat {rep['flat_range'][k][0]:g}..{rep['flat_range'][k][1]:g})"
        for k, v in rep["fitted"].items()))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megazero.plan.fit",
                                description=__doc__.split("\n")[0])
    p.add_argument("--systems", default=str(SYSTEMS_DIR),
                   help="folder of the system files compared with the fit (default: shipped)")
    p.add_argument("--out", help="write the fitted system files into this folder")
    p.add_argument("--json", help="write the report as JSON")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (PlanInputError, OSError) as exc:  # a missing system file, an unwritable --out
        sys.stderr.write(f"python -m megazero.plan.fit: {exc}\n")
        return 2


def _run(args) -> int:
    folder = Path(args.systems)
    files = {n: read_system(str(folder / f"{n}.json"), "--systems")
             for n in (FITTED_SYSTEM, *TRANSFERRED)}
    rep = report(Fit(system_from_dict(files[FITTED_SYSTEM][1])))
    for line in table(rep):
        sys.stdout.write(line + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, (_, data) in files.items():
            (out / f"{name}.json").write_text(
                json.dumps(fitted_file(name, data, rep), indent=2) + "\n")
        return 0
    stale = [f"{path}: {data.get('efficiency')} (fit: {rep['fitted']})"
             for path, data in files.values() if data.get("efficiency") != rep["fitted"]]
    for s in stale:
        sys.stderr.write(f"not the fit's constants: {s}\n")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
