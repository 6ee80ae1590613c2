"""The ring's shared-memory transport (ranks on one host) against its TCP transport: the same
results bit for bit (fp32 and bf16, any world size, one piece or many, in place, async while
the main thread runs other collectives), no file left in /dev/shm, MEGAZERO_SHM=0 and
transport="tcp" keep the sockets, and ZeRO-2 trains to the same losses either way."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.test_zero import ITERS, TINY


def _shm_files() -> set:
    from megazero.distributed.shm import SHM_DIR

    try:
        return {f for f in os.listdir(SHM_DIR) if f.startswith("megazero-")}
    except OSError:
        return set()


def _compare_transports(slot_bytes):
    from megazero.distributed import shm
    from megazero.distributed.ring import Ring

    old = shm.SLOT_BYTES
    shm.SLOT_BYTES = slot_bytes  # small slots: every buffer moves in many pieces
    try:
        g = dist.new_group(list(range(dist.get_world_size())))
        fast, tcp = Ring(g), Ring(g, transport="tcp")
    finally:
        shm.SLOT_BYTES = old
    assert fast.shm is not None and tcp.shm is None
    assert fast.shared_nbytes == fast.n * 2 * slot_bytes
    n, r = fast.n, fast.rank
    gen = torch.Generator().manual_seed(1234 + r)
    checked = 0
    for numel in (n, 7 * n, 3000 * n + 0, 40_000 * n):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(numel, generator=gen).to(dtype)
            a, b = torch.empty(numel // n, dtype=dtype), torch.empty(numel // n, dtype=dtype)
            fast.reduce_scatter(a, x.clone())
            tcp.reduce_scatter(b, x.clone())
            assert torch.equal(a, b), (numel, dtype)  # the ring's order of additions
            # in place (output is the input's own chunk), asynchronous, while the main
            # thread runs a collective of its own on the same group
            y = x.clone()
            work = fast.reduce_scatter(y.view(n, -1)[r], y, overwrite_input=True,
                                       async_op=True)
            flag = torch.ones(1)
            dist.all_reduce(flag, group=g)
            work.wait()
            assert torch.equal(y.view(n, -1)[r], b) and float(flag) == n
            fa, fb = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            fast.all_gather(fa, a, async_op=True).wait()
            tcp.all_gather(fb, b)
            assert torch.equal(fa, fb)
            # in place all-gather: the input is this rank's chunk of the output
            fc = torch.zeros(numel, dtype=dtype)
            fc.view(n, -1)[r].copy_(a)
            fast.all_gather(fc, fc.view(n, -1)[r])
            assert torch.equal(fc, fb)
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_ring_equals_tcp_ring(world):
    from tests.dist_helper import run_distributed

    before = _shm_files()
    # 4 KiB slots: the larger buffers take tens of pieces
    assert all(c == 8 for c in run_distributed(_compare_transports, world, 4096))
    assert _shm_files() <= before, "shared-memory files left in /dev/shm"


def _transport_switch():
    from megazero.distributed.ring import Ring

    g = dist.new_group(list(range(dist.get_world_size())))
    os.environ["MEGAZERO_SHM"] = "0"
    try:
        off = Ring(g)
    finally:
        del os.environ["MEGAZERO_SHM"]
    on = Ring(g)
    return off.shm is None, off.shared_nbytes, on.shm is not None


def test_shared_memory_can_be_turned_off():
    from tests.dist_helper import run_distributed

    for off_none, off_bytes, on in run_distributed(_transport_switch, 2):
        assert off_none and off_bytes == 0 and on


def test_ring_transport_is_validated():
    from megazero.distributed.ring import Ring

    with pytest.raises(ValueError, match="transport"):
        Ring(None, transport="nvlink")


def _zero2_run(argv, shm_on):
    from megazero.distributed import comm
    from tests.train_helper import _train_worker

    old = comm.RING_MIN_BYTES
    comm.RING_MIN_BYTES = 0
    if not shm_on:
        os.environ["MEGAZERO_SHM"] = "0"
    try:
        return _train_worker([*argv, "--ring-collectives", "ring"])
    finally:
        comm.RING_MIN_BYTES = old
        os.environ.pop("MEGAZERO_SHM", None)


def test_zero2_trains_identically_over_shared_memory():
    from tests.dist_helper import run_distributed

    argv = (TINY + ITERS + " --zero-stage 2 --zero-reduce-bucket-size 6000").split()
    runs = {on: run_distributed(_zero2_run, 2, argv, on) for on in (True, False)}
    for on, results in runs.items():
        shared = results[0]["memory"].get("shared_comm_buffers", 0)
        assert (shared > 0) == on, (on, results[0]["memory"])
    assert runs[True][-1]["history"]["lm loss"] == runs[False][-1]["history"]["lm loss"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_zero3_divergence_on_the_ring_fails_clearly(transport):
    """The order check rides in the ring's first barrier: both ranks still name what each
    rank was doing."""
    from tests.dist_helper import run_distributed
    from tests.test_zero import _divergent_zero3

    for msg, on_shm in run_distributed(_divergent_zero3, 2, transport, fresh=True):
        assert "ZeRO-3 ranks diverged" in msg and "dp rank 0" in msg and "dp rank 1" in msg, msg
        assert on_shm == (transport == "shm")
