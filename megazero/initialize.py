"""Start torch.distributed, build the ``ParallelState`` and seed every random stream.

Launched by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the
environment) it joins the job's process group; launched as a plain process it creates a world
of one in memory (no port, no file). The backend is NCCL when CUDA is available and gloo
otherwise, unless ``--distributed-backend`` says; collectives time out after
``--distributed-timeout-minutes`` instead of hanging.

Calling the module, ``megazero.initialize(model, optimizer_config, parallel_state)``, builds a
ZeRO engine around any model (see ``megazero.engine``), as DeepSpeed users expect.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import sys
import types

import numpy as np
import torch
import torch.distributed as dist

from megazero.config import ConfigError, ParallelConfig
from megazero.parallel_state import ParallelState
from megazero.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed

logger = logging.getLogger(__name__)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(parallel: ParallelConfig | None = None) -> ParallelState:
    """Initialise the default process group (if needed) and build this rank's ParallelState."""
    parallel = parallel or ParallelConfig()
    backend = parallel.distributed_backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        if launched_by_torchrun():
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=timeout)
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


def set_random_seed(seed: int, state: ParallelState,
                    tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Seed python, numpy and torch (CPU and CUDA) and the tracker's model-parallel stream.

    As in Megatron, each pipeline stage offsets the seed by ``100 * pp_rank`` (its layers'
    dropout differs from other stages'); tp ranks share the default stream and get
    ``seed + 2718 + tp_rank`` in the model-parallel stream. Parameter initialisation does not
    use these streams (it is keyed by name, see ``tensor_parallel.initializers``).
    """
    stage_seed = seed + 100 * state.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    return model_parallel_manual_seed(stage_seed, state.tp_rank, tracker)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class _CallableModule(types.ModuleType):
    """``megazero.initialize`` is this module (distributed init) and, called, the engine
    constructor ``megazero.engine.initialize(model, optimizer_config, parallel_state)``."""

    def __call__(self, *args, **kwargs):
        from megazero.engine import initialize as engine_initialize

        return engine_initialize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
