"""The benchmarks' shared harness (``benchmarks/harness.py``): its own logic, no benchmark.

* ``spawn`` on real processes: two gloo ranks all-reduce and return their rank (results in rank
  order); a failing rank comes back as ``RankFailed`` with that rank and its traceback; a
  ``Skip`` on the ranks as ``Skip``; a rank that does not answer as ``TimeoutError``.
* ``interleave``: the order rotates by one each round (alternates for two contenders), a
  skipped or failing contender leaves the later rounds with its reason.
* ``slowest_rank``/``step_summary``: a step's time is its slowest rank's, phase by phase; the
  median over every step of every round and the range of the per-round medians.
* ``summarize``, ``markdown_table``, ``contender_rows``, ``step_cells``, the memory readers,
  ``write_json``'s host block and ``add_round_args``.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.harness import RankFailed, Skip


# ---- functions the spawned ranks run (module level: they are pickled by name) ----------------
def _all_reduce_rank(base):
    t = torch.tensor([float(dist.get_rank() + base)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one breaks here")
    return "fine"


def _skip_rank(reason):
    raise Skip(reason)


def _sleep_rank(seconds):
    time.sleep(seconds)


# ---- spawn -------------------------------------------------------------------------------------
def test_spawn_two_gloo_ranks_all_reduce_and_return_their_rank():
    results = harness.spawn(_all_reduce_rank, 2, 10, timeout=120)
    assert results == [(0, 2, 21.0), (1, 2, 21.0)]  # (0 + 10) + (1 + 10), in rank order


def test_spawn_reports_the_failing_rank_with_its_traceback():
    with pytest.raises(RankFailed) as info:
        harness.spawn(_fail_on_rank_one, 2, timeout=120)
    assert info.value.rank == 1
    assert info.value.text.startswith("ValueError: rank one breaks here")
    assert "Traceback" in info.value.text and "_fail_on_rank_one" in info.value.text


def test_spawn_skip_and_timeout_without_a_group():
    with pytest.raises(Skip, match="no such library"):
        harness.spawn(_skip_rank, 1, "no such library", timeout=120, gloo=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no result in 3 s"):
        harness.spawn(_sleep_rank, 1, 600, timeout=3, gloo=False)
    assert time.monotonic() - t0 < 60  # the sleeping rank was killed, not waited for


# ---- interleave --------------------------------------------------------------------------------
def test_rotated():
    assert [harness.rotated("ab", k) for k in range(4)] == [["a", "b"], ["b", "a"]] * 2
    assert [harness.rotated((1, 2, 3), k) for k in range(4)] == [
        [1, 2, 3], [2, 3, 1], [3, 1, 2], [1, 2, 3]]
    assert harness.rotated([], 3) == []


def test_interleave_alternates_and_keeps_every_round():
    order = []
    results, skips = harness.interleave(["a", "b"], 4, lambda c: order.append(c) or len(order))
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert results == {"a": [1, 4, 5, 8], "b": [2, 3, 6, 7]} and skips == {}


def test_interleave_drops_skipped_and_failed_contenders(capsys):
    order = []

    def run(c):
        order.append(c)
        if c == "skip":
            raise Skip("not installed")
        if c == "fail" and len(order) > 3:
            raise RankFailed(1, "RuntimeError: boom\nTraceback ...")
        return c

    results, skips = harness.interleave(["ok", "skip", "fail"], 3, run,
                                        name=lambda c: f"<{c}>")
    # round 1 starts at "skip" (left out), round 2 at "fail" (left out)
    assert order == ["ok", "skip", "fail", "fail", "ok", "ok"]
    assert results == {"ok": ["ok", "ok", "ok"], "skip": [], "fail": ["fail"]}
    assert skips == {"skip": "not installed", "fail": "failed: RuntimeError: boom"}
    err = capsys.readouterr().err
    assert "<fail> failed (round 1):\nRuntimeError: boom" in err


# ---- statistics --------------------------------------------------------------------------------
def test_summarize():
    assert harness.summarize([3, 1, 2, 10]) == {"median": 2.5, "min": 1, "max": 10, "n": 4}
    assert harness.summarize(iter([5.0]))["median"] == 5.0
    with pytest.raises(ValueError):
        harness.summarize([])


def test_slowest_rank_per_step_and_phase():
    rank0 = [(1.0, 0.2, 0.8), (5.0, 4.0, 1.0)]
    rank1 = [(3.0, 2.5, 0.5), (2.0, 0.5, 1.5)]
    assert harness.slowest_rank([rank0, rank1]) == [(3.0, 2.5, 0.8), (5.0, 4.0, 1.5)]
    assert harness.slowest_rank([[1.0, 5.0], [3.0, 2.0]]) == [3.0, 5.0]


def test_step_summary_of_the_slowest_ranks():
    round0 = harness.slowest_rank([[(1.0, 1.0), (9.0, 2.0)], [(4.0, 3.0), (1.0, 1.0)]])
    round1 = harness.slowest_rank([[(2.0, 0.5), (2.0, 0.5)], [(1.0, 1.0), (3.0, 0.5)]])
    s = harness.step_summary([round0, round1], ("fwd",))
    # slowest steps: round 0 -> 4, 9 (median 6.5); round 1 -> 2, 3 (median 2.5)
    assert s["step"] == 3.5 and s["range"] == (2.5, 6.5)
    assert s["phases"] == {"fwd": 1.5}  # the median of 3, 2, 1, 0.5
    assert harness.step_summary([[1.0, 3.0], [2.0]]) == {"step": 2.0, "range": (2.0, 2.0),
                                                         "phases": {}}


# ---- memory ------------------------------------------------------------------------------------
def test_memory_readers():
    peak, hwm, rss = harness.peak_rss_kib(), harness.status_kib("VmHWM"), \
        harness.status_kib("VmRSS")
    assert 0 < rss <= hwm and peak > 10_000  # a process with torch holds more than 10 MiB
    assert harness.status_kib("NoSuchField") == 0
    assert harness.reset_peak_rss() in (True, False)


# ---- output ------------------------------------------------------------------------------------
def test_markdown_table():
    text = harness.markdown_table(["name", "ms", "note"], [["a", 1.5, "x"], ["b", "SKIP: no"]],
                                  align="lr")
    assert text.splitlines() == ["| name | ms | note |", "|---|---:|---|",
                                 "| a | 1.5 | x |", "| b | SKIP: no | |"]
    with pytest.raises(ValueError):
        harness.markdown_table(["a"], [["1", "2"]])
    with pytest.raises(ValueError):
        harness.markdown_table(["a"], [], align="c")


def test_contender_rows_and_step_cells():
    rows = {"a": {"step": 0.002, "range": (0.0015, 0.0031)}, "ref": {"step": 0.004,
                                                                     "range": (0.004, 0.004)}}
    cells = lambda r: harness.step_cells(r, rows["ref"])
    assert harness.contender_rows(["a", "gone", "ref"], rows, {"gone": "why"}, cells) == [
        ["a", "2.0", "1.5-3.1", "0.50x"], ["gone", "SKIP: why"],
        ["ref", "4.0", "4.0-4.0", "1.00x"]]
    assert harness.step_cells(rows["a"], None)[-1] == "n/a"


def test_write_json_with_the_host(tmp_path):
    path = tmp_path / "out.json"
    harness.write_json(str(path), {"rows": {"a": {"range": (1, 2)}}})
    doc = json.loads(path.read_text())
    assert doc["rows"] == {"a": {"range": [1, 2]}}
    host = doc["host"]
    assert set(host) == {"cpu", "avx512", "cpus", "torch", "python", "date"}
    assert host["torch"] == torch.__version__ and isinstance(host["avx512"], list)
    assert all(flag.startswith("avx512") for flag in host["avx512"]) and host["cpu"]


def test_add_round_args(capsys):
    parser = argparse.ArgumentParser()
    harness.add_round_args(parser, warmup=1, steps=3, rounds=5, timeout=60,
                           contenders=("x", "y"))
    args = parser.parse_args(["--rounds", "2", "--contenders", "y"])
    assert (args.warmup, args.steps, args.rounds, args.timeout, args.contenders, args.json) \
        == (1, 3, 2, 60, ["y"], None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "0"])
    assert "must be at least 1" in capsys.readouterr().err
