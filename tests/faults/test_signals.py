"""Signals and preemption (issue 14, finding 6): with --exit-signal-handler a SIGTERM (to any
rank) makes every rank finish the iteration, save and exit 0, and the run resumes from that
checkpoint; a second signal exits at once and the last complete checkpoint stays loadable."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.faults.launch import TINY, Job

FLAGS = f"{TINY} --global-batch-size 4 --train-iters 100000 --exit-signal-handler"


def tracker(save) -> int:
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_on_every_rank_and_exits_zero(tmp_path):
    save = str(tmp_path / "ckpt")
    job = Job(f"{FLAGS} --save {save} --save-interval 100000", world=2)
    try:
        job.wait_for(1, "iteration        3/")
        os.kill(job.procs[1].pid, signal.SIGTERM)  # preemption reaches one rank first
        rcs = [p.wait(timeout=120) for p in job.procs]
    finally:
        job.kill()
    assert rcs == [0, 0], [job.output(r)[-2000:] for r in range(2)]
    it = tracker(save)
    assert it >= 3
    assert f"exiting program at iteration {it} after SIGTERM" in job.output(0)
    last_logged = max(int(m) for m in re.findall(r" iteration\s+(\d+)/", job.output(1)))
    assert last_logged == it  # the iteration in flight was finished, not lost
    # the run resumes from the saved iteration
    resumed = Job(f"{TINY} --global-batch-size 4 --train-iters {it + 2} --load {save} "
                  f"--save {save}", world=2)
    try:
        rcs = [p.wait(timeout=120) for p in resumed.procs]
    finally:
        resumed.kill()
    assert rcs == [0, 0], resumed.output(1)[-2000:]
    assert f"iteration {it + 1:8d}/" in resumed.output(1)


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_the_last_checkpoint_stays_valid(tmp_path):
    save = str(tmp_path / "ckpt")
    job = Job(f"{FLAGS} --save {save} --save-interval 2 --distributed-timeout-minutes 0.25",
              world=1)
    try:
        job.wait_for(0, "saved checkpoint at iteration 4")
        os.kill(job.procs[0].pid, signal.SIGTERM)
        time.sleep(0.05)
        os.kill(job.procs[0].pid, signal.SIGTERM)
        rc = job.procs[0].wait(timeout=60)
    finally:
        job.kill()
    assert rc == -signal.SIGTERM
    it = tracker(save)
    resumed = Job(f"{TINY} --global-batch-size 4 --train-iters {it + 1} --load {save}",
                  world=1)
    try:
        assert resumed.procs[0].wait(timeout=120) == 0, resumed.output(0)[-2000:]
    finally:
        resumed.kill()
    assert f"iteration {it + 1:8d}/" in resumed.output(0)
