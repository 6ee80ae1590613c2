"""The A100's efficiency constants are the output of ``python -m megazero.plan.fit`` on the
published Megatron-LM rows (the shipped files are what the fit writes, and a changed constant
is caught), every row is predicted at the layout its run used, and the held-out errors that
README.md and RESULTS.md quote are the ones the fit computes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from megazero.plan import fit
from megazero.plan.published import ROWS, candidate_layouts, published_layout
from megazero.plan.system import SYSTEMS_DIR, load_system

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report():
    return fit.report(fit.Fit(load_system(fit.FITTED_SYSTEM)))


def test_fit_reproduces_the_shipped_constants(capsys):
    assert fit.main([]) == 0
    out = capsys.readouterr()
    assert "leave_one_model_out" in out.out and out.err == ""


def test_a_constant_set_by_hand_is_caught(tmp_path, capsys):
    for p in SYSTEMS_DIR.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    path = tmp_path / "h100-80g.json"
    data = json.loads(path.read_text())
    data["efficiency"]["hbm"] = 0.7
    path.write_text(json.dumps(data))
    assert fit.main(["--systems", str(tmp_path)]) == 1
    assert "h100-80g.json" in capsys.readouterr().err


def test_written_files_are_the_shipped_ones(tmp_path, capsys):
    assert fit.main(["--out", str(tmp_path)]) == 0
    for name in (fit.FITTED_SYSTEM, *fit.TRANSFERRED):
        written = json.loads((tmp_path / f"{name}.json").read_text())
        assert written == json.loads((SYSTEMS_DIR / f"{name}.json").read_text())
        assert written["_fit"]["rows"] == [f"{r.source}: {r.model} {r.recompute}"
                                           for r in ROWS]
        assert "python -m megazero.plan.fit" in written["_sources"]["efficiency"]


def test_every_row_is_predicted_at_its_published_layout(report):
    for run, row in zip(ROWS, report["rows"]):
        assert run.layout_source and run.source
        assert published_layout(run) in candidate_layouts(run)  # recommended among them
        assert row["layout"] == published_layout(run).short()
        assert row["predicted"] == pytest.approx(run.published * (1 + row["in_sample"]))


def test_held_out_errors_are_the_documented_ones(report):
    """README.md's headline and RESULTS.md's summary are these numbers."""
    lomo, rec = report["leave_one_model_out"], report["recommended_leave_one_model_out"]
    headline = (f"held out (leave one model out): {lomo['mean_abs']:.1%} mean, "
                f"{lomo['max_abs']:.1%} worst")
    for doc in ("README.md", "benchmarks/RESULTS.md"):
        text = re.sub(r"\s+", " ", (ROOT / doc).read_text())
        assert headline in text, (doc, headline)
    results = re.sub(r"\s+", " ", (ROOT / "benchmarks/RESULTS.md").read_text())
    lopo = report["leave_one_paper_out"]
    assert (f"leave one paper out: {lopo['mean_abs']:.1%} mean, {lopo['max_abs']:.1%} worst"
            in results)
    assert (f"the planner's recommendation, held out: {rec['mean_abs']:.1%} mean, "
            f"{rec['max_abs']:.1%} worst") in results


def test_bad_input_is_named(tmp_path, capsys):
    assert fit.main(["--systems", str(tmp_path / "none")]) == 2
    assert "--systems: no such file" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert fit.main(["--out", str(tmp_path / "file" / "x")]) == 2
    assert "file" in capsys.readouterr().err
