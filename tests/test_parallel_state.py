"""The rank grid and its process groups, for every factorization of 8 ranks."""

import itertools

import pytest
import torch

from megazero.config import ConfigError
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState, coords_of, rank_grid, rank_of
from tests.dist_helper import run_distributed

FACTORIZATIONS_OF_8 = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if tp * pp <= 8]


@pytest.mark.parametrize("tp,pp", FACTORIZATIONS_OF_8)
def test_grid_partitions_ranks(tp, pp):
    world = 8
    dp = world // (tp * pp)
    grid = rank_grid(world, tp, pp)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("mp", tp * pp)):
        groups = grid[kind]
        assert all(len(g) == size for g in groups), kind
        assert sorted(itertools.chain(*groups)) == list(range(world)), kind
    for rank in range(world):
        t, d, p = coords_of(rank, tp, dp)
        assert rank_of(t, d, p, tp, dp) == rank
        # tp fastest, then dp, then pp
        assert rank == t + tp * d + tp * dp * p
    for g in grid["tp"]:
        assert g == list(range(g[0], g[0] + tp)), "tp groups are neighbouring ranks"
    for g, e in zip(grid["pp"], grid["embedding"]):
        assert e == ([g[0], g[-1]] if pp > 1 else [g[0]])


def test_megatron_example_8_ranks():
    grid = rank_grid(8, 2, 2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert grid["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_bad_sizes_give_clear_errors():
    with pytest.raises(ConfigError, match=r"world size \(8\) is not divisible by "
                       r"--tensor-model-parallel-size \(3\)"):
        rank_grid(8, 3, 1)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        rank_grid(6, 2, 2)


def test_single_process_without_distributed():
    ps = ParallelState.build()
    assert (ps.tp_size, ps.pp_size, ps.dp_size) == (1, 1, 1)
    assert ps.is_first_stage and ps.is_last_stage and ps.tp_group is None
    with pytest.raises(ConfigError):
        ParallelState.build(tp_size=2)


def state_case(tp, pp):
    ps = ParallelState.build(tp_size=tp, pp_size=pp)
    rank = torch.distributed.get_rank()
    grid = rank_grid(8, tp, pp)
    out = {}
    for kind in ("tp", "dp", "pp", "mp", "embedding"):
        ranks = getattr(ps, f"{kind}_ranks")
        if kind == "embedding" and 0 < ps.pp_rank < pp - 1:
            assert ranks == [] and ps.embedding_group is None and not ps.is_in_embedding_group
            continue
        assert rank in ranks and ranks in grid[kind]
        # the group really connects exactly those ranks: sum of global ranks
        group = getattr(ps, f"{kind}_group")
        x = torch.tensor([float(rank)])
        comm.all_reduce(x, group)
        assert x.item() == sum(ranks), (kind, x.item(), ranks)
        out[kind] = ranks
    assert ps.is_first_stage == (ps.pp_rank == 0)
    assert ps.is_last_stage == (ps.pp_rank == pp - 1)
    assert ps.next_rank == ps.pp_ranks[(ps.pp_rank + 1) % pp]
    assert ps.prev_rank == ps.pp_ranks[(ps.pp_rank - 1) % pp]
    assert (ps.tp_rank, ps.dp_rank, ps.pp_rank) == coords_of(rank, tp, 8 // (tp * pp))
    return out


def test_groups_in_real_world_of_8():
    for tp, pp in FACTORIZATIONS_OF_8:
        results = run_distributed(state_case, 8, tp, pp)
        assert len(results) == 8
