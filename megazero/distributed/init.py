"""Start torch.distributed and build this rank's ``ParallelState``.

Launched by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the
environment) it joins the job's process group; launched as a plain process it creates a world
of one in memory (no port, no file). With CUDA available the default group is device-mapped,
``cpu:gloo,cuda:nccl``: CUDA tensors (every hot-path collective, on ``ParallelState.device``)
go over NCCL and CPU tensors (object gathers, host-side metadata) keep a route over gloo.
Without CUDA it is gloo. ``--distributed-backend nccl`` asks for the mapped backend too,
``gloo`` for plain gloo. Collectives time out after ``--distributed-timeout-minutes``
instead of hanging, on every group (``ParallelState`` gives the timeout to each group it
creates); under NCCL the watchdog's async error handling is on (``NCCL_ENV_DEFAULTS``).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist

# Imported before any process group exists: its functions' ``group=group.WORLD`` defaults are
# evaluated at import, and imported later (torch.compile imports it) they would hold the
# default group past ``destroy_distributed``, its gloo threads into interpreter teardown.
import torch.distributed.nn  # noqa: F401

from megazero.config import ConfigError, ParallelConfig
from megazero.distributed.device import MAPPED_BACKEND
from megazero.distributed.parallel_state import ParallelState

logger = logging.getLogger(__name__)


# NCCL's watchdog turns a collective stuck past the group's timeout into an exception on the
# rank's next wait (communicators aborted, the process not killed), instead of a silent hang:
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 ("clean up only"). Set the variable yourself to choose
# another policy (1 also tears the process down; 0 turns the watchdog's handling off).
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def process_group_backend(backend: str) -> str:
    """The backend string given to ``init_process_group``: NCCL comes device-mapped with a
    gloo route for CPU tensors."""
    return MAPPED_BACKEND if backend == "nccl" else backend


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(parallel: ParallelConfig | None = None) -> ParallelState:
    """Initialise the default process group (if needed) and build this rank's ParallelState."""
    parallel = parallel or ParallelConfig()
    backend = parallel.distributed_backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if backend == "nccl":
        for key, value in NCCL_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    if not dist.is_initialized():
        if launched_by_torchrun():
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=process_group_backend(backend),
                                    store=_job_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=process_group_backend(backend),
                                    store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    world = dist.get_world_size()
    if world != parallel.world_size:
        # The config was validated against WORLD_SIZE; re-check against the real group.
        parallel = ParallelConfig(**{**parallel.__dict__, "world_size": world})
    device = None
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    state = ParallelState.from_config(parallel, device=device)
    if state.rank == 0:
        logger.info("initialized torch.distributed: backend %s, world %d (tp %d, pp %d, dp %d)",
                    backend, world, state.tp_size, state.pp_size, state.dp_size)
    return state


def _job_store(timeout: datetime.timedelta):
    """The rendezvous store of this incarnation of the job. Under torchrun the agent hosts one
    store for all restarts (``--max-restarts``), so a restarted group could read the dead
    group's addresses (gloo: "connectFullMesh failed ... Connection refused"): the keys of each
    restart live under their own prefix (``TORCHELASTIC_RESTART_COUNT``)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]),
                          is_master=not agent and int(os.environ["RANK"]) == 0,
                          timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/megazero/restart_{restart}", store)


def destroy_distributed() -> None:
    """Destroy every process group and join their threads now, while the interpreter is
    whole. ``destroy_process_group`` only unregisters the groups: a group's gloo threads end
    when its last reference goes, and a finished run's model and optimizer hold theirs in
    reference cycles (module hooks) until the cycle collector runs. Left to interpreter
    teardown, a gloo thread that still drops a tensor then needs the GIL and aborts the
    process ("terminate called without an active exception", exit code -6)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # --compile: its caches hold the groups its graphs traced
        dynamo.reset()
    gc.collect()
