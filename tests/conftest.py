import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    from tests.dist_helper import shutdown_pools

    shutdown_pools()
