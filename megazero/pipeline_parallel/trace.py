"""Pipeline schedule trace: when each forward and backward of each micro-batch ran, per rank.

With ``--pipeline-trace FILE`` every rank records (iteration, kind, micro-batch, chunk,
start, end) around each ``forward_step``/``backward_step`` of the schedules; at the end of
training the events of all ranks are gathered to rank 0 and written to ``FILE`` as JSON (wall
times relative to the first event, in seconds, with each rank's tp/dp/pp coordinates).
``python -m megazero.tools.pipeline_trace FILE`` turns it into a Chrome trace
(chrome://tracing, Perfetto) and a PNG timeline with one row per pipeline stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState


class PipelineTrace:
    def __init__(self, ps: ParallelState, clock=time.perf_counter):
        self.ps, self.clock = ps, clock
        self.iteration = 0
        self.events: list[dict] = []
        # A shared epoch: wall clock offsets are comparable across processes on one host.
        self.wall0 = time.time()
        self.t0 = clock()

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int, chunk: int = 0):
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            self.events.append({"iteration": self.iteration, "kind": kind,
                                "microbatch": microbatch, "chunk": chunk,
                                "start": self.wall0 + (start - self.t0),
                                "end": self.wall0 + (end - self.t0)})

    def gather(self) -> list[dict] | None:
        """All ranks' records on rank 0 (None elsewhere). Collective over the world."""
        ps = self.ps
        mine = {"rank": ps.rank, "tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank,
                "pp_rank": ps.pp_rank, "pp_size": ps.pp_size,
                "virtual_pp_size": ps.virtual_pp_size or 1, "events": self.events}
        everyone = comm.all_gather_object(mine, ps.world_group)
        return everyone if ps.rank == 0 else None

    def save(self, path: str) -> None:
        ranks = self.gather()
        if ranks is None:
            return
        t_min = min((e["start"] for r in ranks for e in r["events"]), default=0.0)
        for r in ranks:
            for e in r["events"]:
                e["start"] -= t_min
                e["end"] -= t_min
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"format": "megazero-pipeline-trace-v1", "ranks": ranks}, f)
        os.replace(tmp, path)
