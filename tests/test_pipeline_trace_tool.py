"""The pipeline trace tool: Chrome trace, PNG timeline and bubble on known traces."""

import json
import sys

import pytest

from megazero.tools import pipeline_trace as tool
from tests.train_helper import TINY, run_training

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def ev(iteration, kind, microbatch, start, end, chunk=0):
    return {"iteration": iteration, "kind": kind, "microbatch": microbatch, "chunk": chunk,
            "start": start, "end": end}


def stage_events(pp_rank, shift=0.0):
    """Iteration 1: 1F1B with p=2, m=2, backward = 2x forward (times in seconds).
    Iteration 2: m=1."""
    if pp_rank == 0:  # busy 6 of the pipeline's [0, 9]; 2 of [20, 25]+1 -> idle 3/9, 2/5
        one = [ev(1, "forward", 0, 0, 1), ev(1, "forward", 1, 1, 2),
               ev(1, "backward", 0, 4, 6), ev(1, "backward", 1, 7, 9)]
        two = [ev(2, "forward", 0, 20, 21), ev(2, "backward", 0, 23, 25)]
    else:  # busy 6 of [0, 9] (its own span [1, 7] is all busy); 2 of [20, 25] -> 3/5
        one = [ev(1, "forward", 0, 1, 2), ev(1, "backward", 0, 2, 4),
               ev(1, "forward", 1, 4, 5), ev(1, "backward", 1, 5, 7)]
        two = [ev(2, "forward", 0, 21, 22), ev(2, "backward", 0, 22, 23)]
    for e in one:  # the second data-parallel pipeline runs half a second later
        e["start"] += shift
        e["end"] += shift
    return one + two


def synthetic_trace(virtual=1):
    """pp=2 x dp=2 (tp=1): rank = dp + 2 * pp, as in ParallelState."""
    ranks = []
    for pp in range(2):
        for dp in range(2):
            ranks.append({"rank": dp + 2 * pp, "tp_rank": 0, "dp_rank": dp, "pp_rank": pp,
                          "pp_size": 2, "virtual_pp_size": virtual,
                          "events": stage_events(pp, shift=0.5 * dp)})
    return {"format": tool.FORMAT, "ranks": ranks}


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(synthetic_trace()))
    return path


def test_bubble_fraction_matches_hand_computed():
    trace = synthetic_trace()
    assert tool.iterations(trace) == [1, 2]
    assert tool.bubble_fraction(trace, 1) == pytest.approx({0: 3 / 9, 1: 3 / 9})
    # default: the last iteration; each dp pipeline is measured over its own span
    assert tool.bubble_fraction(trace) == pytest.approx({0: 2 / 5, 1: 3 / 5})
    assert tool.bubble_fraction(trace, 1, window="stage") == pytest.approx({0: 3 / 9, 1: 0})
    assert tool.rank_bubbles(trace, 2) == pytest.approx({0: 0.4, 1: 0.4, 2: 0.6, 3: 0.6})
    assert tool.describe(trace, 1) == {"p": 2, "m": 2, "v": 1, "iteration": 1,
                                       "schedule": "1F1B"}
    assert tool.theory_bubble(4, 8) == pytest.approx(3 / 11)
    assert tool.theory_bubble(4, 8, 2) == pytest.approx(3 / 19)


def test_chrome_trace_structure():
    trace = synthetic_trace()
    chrome = tool.to_chrome(trace)
    events = chrome["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 4 * 6  # 4 ranks x (4 + 2) events
    assert len(tool.to_chrome(trace, iteration=1)["traceEvents"]) - len(events) == -4 * 2
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "stage 0"), (1, "stage 1")}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(0, 0), (0, 1), (1, 0), (1, 1)}  # pid = pp rank, tid = dp * tp + tp
    b0 = next(e for e in complete if e["args"]["rank"] == 0 and e["name"] == "B0"
              and e["args"]["iteration"] == 1)
    assert (b0["pid"], b0["tid"], b0["cat"]) == (0, 0, "backward")
    assert b0["ts"] == pytest.approx(4e6) and b0["dur"] == pytest.approx(2e6)
    assert {e["name"] for e in complete} == {"F0", "F1", "B0", "B1"}
    interleaved = tool.to_chrome(synthetic_trace(virtual=2))["traceEvents"]
    assert {e["name"] for e in interleaved if e["ph"] == "X"} == {"F0.c0", "F1.c0", "B0.c0",
                                                                   "B1.c0"}


def test_cli_writes_chrome_and_png(trace_file, tmp_path, caplog):
    pytest.importorskip("matplotlib")
    caplog.set_level("INFO", logger="megazero.tools.pipeline_trace")
    chrome, png = tmp_path / "out.json", tmp_path / "out.png"
    assert tool.main([str(trace_file), "--chrome", str(chrome), "--png", str(png),
                      "--iteration", "1"]) == 0
    assert len([e for e in json.loads(chrome.read_text())["traceEvents"]
                if e["ph"] == "X"]) == 4 * 4
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    out = caplog.text
    assert "p=2 m=2 v=1" in out and "33.3%" in out and f"wrote {png}" in out
    # no output flags: both files beside the input
    assert tool.main([str(trace_file)]) == 0
    assert (tmp_path / "trace.chrome.json").exists()
    assert (tmp_path / "trace.png").read_bytes()[:8] == PNG_MAGIC


def test_png_all_ranks_and_interleaved(tmp_path):
    pytest.importorskip("matplotlib")
    info = tool.write_png(synthetic_trace(virtual=2), str(tmp_path / "all.png"), 1,
                          all_ranks=True)
    assert (tmp_path / "all.png").read_bytes()[:8] == PNG_MAGIC
    assert info["bubble"] == pytest.approx(1 / 3)
    assert info["theory"] == pytest.approx(1 / 5)  # (p-1)/(vm+p-1) with v=2, m=2


def test_clear_errors(tmp_path, monkeypatch, trace_file):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a megazero pipeline trace"):
        tool.load(str(bad))
    with pytest.raises(ValueError, match=r"iteration 7 is not in the trace \(it has \[1, 2\]\)"):
        tool.bubble_fraction(synthetic_trace(), 7)
    # without matplotlib: a clear error for --png, and the Chrome trace still works
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match="PNG timeline needs matplotlib"):
        tool.write_png(synthetic_trace(), str(tmp_path / "x.png"))
    with pytest.raises(SystemExit):
        tool.main([str(trace_file), "--png", str(tmp_path / "x.png")])
    assert tool.main([str(trace_file)]) == 0
    assert (tmp_path / "trace.chrome.json").exists() and not (tmp_path / "trace.png").exists()


def test_tool_on_a_real_two_stage_run(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "trace.json"
    run_training(TINY + f" --train-iters 3 --pipeline-model-parallel-size 2 "
                 f"--pipeline-trace {path}", 2)
    trace = tool.load(str(path))
    m = 4  # global batch 8 / micro-batch 2
    assert tool.describe(trace) == {"p": 2, "m": m, "v": 1, "iteration": 3,
                                    "schedule": "1F1B"}
    bubbles = tool.bubble_fraction(trace)
    assert set(bubbles) == {0, 1} and all(0 <= b < 1 for b in bubbles.values())
    assert tool.main([str(path), "--png", str(tmp_path / "t.png"),
                      "--chrome", str(tmp_path / "t.json")]) == 0
    chrome = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len([e for e in chrome if e["ph"] == "X"]) == 2 * 3 * 2 * m  # ranks x iters x F/B
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
