"""Launch the ranks of a pretrain_gpt2.py job as plain processes (torchrun's environment),
so a test can stop, kill or signal one of them and watch the others."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--mock-data --vocab-size 96 --make-vocab-size-divisible-by 8 --num-layers 4 "
        "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--log-interval 1 --eval-iters 0 --lr 1e-3 --attention-dropout 0 --hidden-dropout 0 "
        "--seed 1234")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """``world`` processes of ``pretrain_gpt2.py <flags>``; their output is collected."""

    def __init__(self, flags: str, world: int, env: dict | None = None):
        port = free_port()
        self.procs, self.out, self._drains = [], [], []
        for rank in range(world):
            e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                     **(env or {}))
            proc = subprocess.Popen([sys.executable, "pretrain_gpt2.py", *flags.split()],
                                    cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            lines: list[str] = []
            drain = threading.Thread(target=_drain, args=(proc, lines), daemon=True)
            drain.start()
            self.procs.append(proc)
            self._drains.append(drain)
            self.out.append(lines)

    def output(self, rank: int) -> str:
        """What rank printed so far; all of it once the process has exited (the reader
        thread may lag the exit: a traceback's last lines were missing under load)."""
        if self.procs[rank].poll() is not None:
            self._drains[rank].join(timeout=30)
        return "".join(self.out[rank])

    def wait_for(self, rank: int, text: str, timeout: float = 120) -> None:
        end = time.time() + timeout
        while text not in self.output(rank):
            if time.time() > end or self.procs[rank].poll() is not None:
                raise AssertionError(f"rank {rank} never printed {text!r}:\n"
                                     + self.output(rank)[-3000:])
            time.sleep(0.1)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def _drain(proc, lines):
    for line in proc.stdout:
        lines.append(line)
