"""Shared test setup: one OpenMP thread unless a test asks for more, worker pools closed at the
end of the session, and the fixtures of the kernel tests (tests/test_ops_*.py).

Kernel tests draw their inputs from ``gen``, a generator with a fixed seed per test: the base
seed (``MEGAZERO_TEST_SEED``, default 0) mixed with the test's id. The seed is printed, and
pytest shows the prints of a failing test, so every failure can be rerun with the same inputs;
set ``MEGAZERO_TEST_SEED`` to try other inputs.
"""

import contextlib
import os
import zlib

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

BASE_SEED = int(os.environ.get("MEGAZERO_TEST_SEED", "0"))


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    from tests.dist_helper import shutdown_pools

    shutdown_pools()


@pytest.fixture
def gen(request):
    """torch.Generator seeded with this test's fixed seed (printed)."""
    import torch

    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**32
    print(f"random seed: {seed} (MEGAZERO_TEST_SEED={BASE_SEED}, test {request.node.nodeid})")
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def torch_threads():
    """``with torch_threads(n):`` runs the block on n torch threads (the kernels use as many)."""
    return _torch_threads


@contextlib.contextmanager
def _ops_disabled(names: str):
    from megazero.ops import _loader

    old = os.environ.get("MEGAZERO_DISABLE_OPS")
    os.environ["MEGAZERO_DISABLE_OPS"] = names
    _loader.reset_cache()
    try:
        yield
    finally:
        if old is None:
            del os.environ["MEGAZERO_DISABLE_OPS"]
        else:
            os.environ["MEGAZERO_DISABLE_OPS"] = old
        _loader.reset_cache()


@pytest.fixture
def ops_disabled():
    """``with ops_disabled("adam,lamb"):`` runs the block as if those extensions were missing
    (``MEGAZERO_DISABLE_OPS``; "all" for every one), so the PyTorch reference paths run."""
    return _ops_disabled


@pytest.fixture
def fused_kernels_at_any_size():
    """The fused model ops run their CPU kernels even on tiny shapes (below their MIN_NUMEL)."""
    from megazero.ops import fused_common

    with fused_common.force_kernels():
        yield
