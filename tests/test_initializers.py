"""Layout-invariant initialisation drawn by several threads: the same values as one thread,
and a shard's values are the full tensor's at the shard's global indices."""

import numpy as np
import torch

from megazero.tensor_parallel.initializers import (
    _CHUNK,
    ShardInfo,
    fill_shard,
    init_key,
    init_normal,
    normal_at,
)


def _fill(shape, shard, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fill_shard(torch.empty(shape), init_normal(0.02), shard, init_key(1234, "w"))
    finally:
        torch.set_num_threads(before)


def test_threads_draw_the_same_values_as_one_thread():
    rows, cols = 3 * _CHUNK // 1000 + 7, 1000  # several chunks and a partial one
    full = ShardInfo(full_shape=(rows, cols))
    one, three = _fill((rows, cols), full, 1), _fill((rows, cols), full, 3)
    assert torch.equal(one.view(torch.int32), three.view(torch.int32))
    # the values are the counter-based normals at the global indices
    idx = np.array([0, _CHUNK - 1, _CHUNK, rows * cols - 1])
    want = torch.from_numpy(normal_at(init_key(1234, "w"), idx) * 0.02).float()
    assert torch.equal(one.view(-1)[torch.from_numpy(idx)], want)
    # a column shard (tp) drawn with threads is the full tensor's slice
    shard = ShardInfo(full_shape=(rows, cols), dim=1, start=500, length=500)
    part = _fill((rows, 500), shard, 2)
    assert torch.equal(part, one[:, 500:])
