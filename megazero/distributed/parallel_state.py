"""The rank grid (tensor x data x pipeline) and its process groups, built once, passed explicitly.

Rank order is Megatron's: tensor-parallel rank varies fastest, then data-parallel, then
pipeline, so a tp group is a block of neighbouring ranks (one node):

    rank = tp_rank + tp_size * dp_rank + tp_size * dp_size * pp_rank

Example, 8 ranks with tp=2, pp=2 (so dp=2)::

    pp stage 0:  dp0 -> [0 1]   dp1 -> [2 3]
    pp stage 1:  dp0 -> [4 5]   dp1 -> [6 7]

    tp groups        [0,1] [2,3] [4,5] [6,7]
    dp groups        [0,2] [1,3] [4,6] [5,7]
    pp groups        [0,4] [1,5] [2,6] [3,7]
    model-parallel   [0,1,4,5] [2,3,6,7]      (tp x pp: one full model replica)
    embedding        [0,4] [1,5] [2,6] [3,7]  (first + last stage: the tied word embedding)

``ParallelState`` holds sizes, ranks and groups, and the ``Communicator`` its groups are bound
to (collective statistics, ring choices: ``ps.comm``); layers, schedules, optimizers and
checkpointing receive it (or one of its groups) as an argument. With one
process and no torch.distributed initialised, every group is ``None`` and every collective in
megazero short-circuits, so the same code runs as plain single-process PyTorch.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero.config import ConfigError
from megazero.distributed.comm import Communicator, bind


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    return tp_rank + tp * dp_rank + tp * dp * pp_rank


def coords_of(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def rank_grid(world_size: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks, in a fixed creation order."""
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ConfigError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
            f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}")
    dp = world_size // (tp * pp)
    r = lambda t, d, p: rank_of(t, d, p, tp, dp)  # noqa: E731
    grid = {
        "tp": [[r(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[r(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[r(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [sorted(r(t, d, p) for p in range(pp) for t in range(tp)) for d in range(dp)],
    }
    grid["embedding"] = [[g[0], g[-1]] if pp > 1 else [g[0]] for g in grid["pp"]]
    return grid


@dataclass
class ParallelState:
    """Sizes, ranks and process groups of one rank. Build with ``ParallelState.build``."""

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    virtual_pp_size: int | None = None
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    dp_ranks: list[int] = field(default_factory=lambda: [0])
    mp_ranks: list[int] = field(default_factory=lambda: [0])
    embedding_ranks: list[int] = field(default_factory=lambda: [0])
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    world_group: object = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    comm: Communicator = field(default_factory=Communicator)  # stats, ring choices

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, tp_size: int = 1, pp_size: int = 1, *, virtual_pp_size: int | None = None,
              device: torch.device | str | None = None,
              ring_policy: str = "auto", comm_backend: str | None = None,
              timeout: datetime.timedelta | None = None) -> ParallelState:
        """Create the groups for this process. Every rank must call this with the same sizes.

        Without an initialised torch.distributed, only a world of one process is allowed.
        The groups are bound to this state's ``Communicator`` (``ring_policy``: "auto",
        "ring" or "native" reduce-scatter/all-gather on gloo; ``comm_backend``: the backend
        its device checks assume instead of the groups' own, for the dry run's fake groups).
        The device defaults to ``cuda:<current>`` when the backend carries CUDA tensors.
        Every group gets ``timeout`` (``--distributed-timeout-minutes``): a collective a peer
        never joins (a dead or frozen rank) fails after it instead of hanging.
        """
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world, rank = 1, 0
        grid = rank_grid(world, tp_size, pp_size)
        dp_size = world // (tp_size * pp_size)
        tp_rank, dp_rank, pp_rank = coords_of(rank, tp_size, dp_size)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() and "nccl" in (_backend() or "") \
                else torch.device("cpu")
        state = cls(world_size=world, rank=rank, tp_size=tp_size, pp_size=pp_size,
                    dp_size=dp_size, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
                    virtual_pp_size=virtual_pp_size, device=torch.device(device),
                    comm=Communicator(ring_policy, backend=comm_backend))
        distributed = world > 1
        state.embedding_ranks = []  # middle pipeline stages belong to no embedding group
        for kind in ("tp", "dp", "pp", "mp", "embedding"):
            for ranks in grid[kind]:
                # new_group is collective over the whole world: every rank creates every group,
                # in the same order, and keeps the one it belongs to.
                group = dist.new_group(ranks, timeout=timeout) if distributed else None
                if rank in ranks:
                    setattr(state, f"{kind}_ranks", list(ranks))
                    setattr(state, f"{kind}_group", group)
        state.world_group = dist.group.WORLD if distributed else None
        bind(state.comm, {"tp": state.tp_group, "dp": state.dp_group, "pp": state.pp_group,
                          "mp": state.mp_group, "embedding": state.embedding_group,
                          "world": state.world_group})
        return state

    @classmethod
    def from_config(cls, parallel_config, device=None, comm_backend=None) -> ParallelState:
        return cls.build(parallel_config.tensor_model_parallel_size,
                         parallel_config.pipeline_model_parallel_size,
                         virtual_pp_size=parallel_config.virtual_pipeline_model_parallel_size,
                         device=device, ring_policy=parallel_config.ring_collectives,
                         comm_backend=comm_backend,
                         timeout=datetime.timedelta(
                             minutes=parallel_config.distributed_timeout_minutes))

    # ---- pipeline facts -----------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks

    @property
    def tp_src_rank(self) -> int:
        return self.tp_ranks[0]

    @property
    def mp_size(self) -> int:
        return self.tp_size * self.pp_size

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
                f"dp {self.dp_rank}/{self.dp_size}, pp {self.pp_rank}/{self.pp_size}")


def _backend() -> str | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend()
    return None
