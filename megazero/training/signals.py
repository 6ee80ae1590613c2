"""``--exit-signal-handler``: leave at the end of an iteration with a checkpoint on a signal.

Preemption (SLURM, Kubernetes, a spot instance) and Ctrl-C send a signal first and kill
later. With the handler installed, the first ``--exit-signal`` (SIGTERM by default) only sets
a flag. At the end of every iteration the ranks agree on it (a one-element MAX all-reduce over
the world group, so a signal that reached one rank stops them all at the same iteration); the
training loop then saves a checkpoint and returns, and the process exits 0. A second signal
restores the default action and re-raises it: the process ends at once, and the last complete
checkpoint stays valid because every save is written to temporary names and renamed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch

from megazero.distributed import comm
from megazero.distributed.device import host_device_type, host_float
from megazero.distributed.parallel_state import ParallelState

logger = logging.getLogger(__name__)


class ExitSignalHandler:
    """Catches ``signame`` (a ``signal`` module name) until ``restore()``."""

    def __init__(self, signame: str = "SIGTERM"):
        self.signum = getattr(signal, signame)
        self.signame = signame
        self.received = False
        self.installed = threading.current_thread() is threading.main_thread()
        self._previous = None
        if self.installed:
            self._previous = signal.signal(self.signum, self._handle)
        else:
            logger.warning("--exit-signal-handler: not on the main thread, %s is not caught",
                           signame)

    def _handle(self, signum, frame) -> None:
        if self.received:  # the second signal: the default action, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = True
        logger.warning("received %s: saving a checkpoint at the end of this iteration and "
                       "exiting (send it again to exit at once)", self.signame)

    def agreed(self, ps: ParallelState) -> bool:
        """Whether any rank received the signal (a collective: every rank calls it). The flag
        travels on the host route (gloo beside NCCL): checking never waits for the GPU."""
        return host_flag_any(self.received, ps)

    def restore(self) -> None:
        if self.installed and self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None


def host_flag_any(flag: bool, ps: ParallelState) -> bool:
    """Whether ``flag`` is set on any rank: a MAX all-reduce of a host tensor over the world
    group's host route (its device's when the backend has none: plain NCCL)."""
    backend = comm.communicator_of(ps.world_group).group_backend(ps.world_group)
    host = host_device_type(backend) or ps.device.type
    t = torch.tensor([1.0 if flag else 0.0],
                     device="cpu" if host == "cpu" else ps.device)
    comm.all_reduce(t, ps.world_group, op=torch.distributed.ReduceOp.MAX,
                    host=host == "cpu")
    return host_float(t) > 0
