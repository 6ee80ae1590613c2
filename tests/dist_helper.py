"""Run a function on N real gloo ranks (spawned processes) and collect each rank's result.

``run_distributed(fn, world_size, *args)`` calls ``fn(*args)`` on every rank of a world of
``world_size`` processes joined in one gloo process group (a TCPStore on a free port held by the
test process), and returns the list of per-rank return values. An exception on any rank is
re-raised here with the rank and its traceback; a rank that does not answer within ``timeout``
seconds fails the test instead of hanging it.

Worker processes are kept between calls (one pool per world size), since starting eight Python
processes with torch costs seconds on two cores. A failure or timeout kills the pool, so the
next test starts from fresh processes. ``fresh=True`` runs on a one-off pool.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback

_CTX = mp.get_context("spawn")
_POOLS: dict[int, _Pool] = {}


def _worker(rank, world_size, port, conn, timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _share_process_groups()
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            _reset_process_state()
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001
            try:
                conn.send(("err", traceback.format_exc()))
            except Exception:  # noqa: BLE001
                pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _share_process_groups():
    """Every ``ParallelState.build`` creates its groups; over hundreds of tests a worker would
    accumulate thousands of gloo threads (destroying a group does not stop them in torch
    2.13), which busy the machine. Workers therefore reuse the group of a given rank list:
    ``new_group`` is collective and every rank runs the same tasks, so all ranks hit and
    miss this cache alike."""
    import torch.distributed as dist

    original = dist.new_group
    cache = {}

    def new_group(ranks=None, *args, **kwargs):
        key = (None if ranks is None else tuple(ranks), args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = original(ranks, *args, **kwargs)
        return cache[key]

    dist.new_group = new_group


def _reset_process_state():
    import torch

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)


class _Pool:
    def __init__(self, world_size: int, timeout_s: float):
        import torch.distributed as dist

        self.world_size = world_size
        # The test process hosts the store; port 0 lets the OS pick a free one (no race).
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(target=_worker, args=(rank, world_size, self.store.port, child,
                                                   timeout_s), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(timeout_s + 60, expect="ready")

    def _collect(self, timeout_s, expect="ok"):
        deadline = time.monotonic() + timeout_s
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        errors = []
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(pending)} of {self.world_size} did not finish within "
                    f"{timeout_s:.0f}s" + ("; errors on other ranks:\n" + "\n".join(errors)
                                           if errors else ""))
            for rank in list(pending):
                conn = self.conns[rank]
                if conn.poll(0.01):
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        status, value = "err", "process exited (exit code "
                        f"{self.procs[rank].exitcode})"
                    pending.discard(rank)
                    if status == "err":
                        errors.append(f"--- rank {rank} ---\n{value}")
                        # Other ranks may now wait forever in a collective: give them a
                        # moment to fail too, then report.
                        deadline = min(deadline, time.monotonic() + 5)
                    else:
                        results[rank] = value
                elif not self.procs[rank].is_alive() and not conn.poll(0):
                    pending.discard(rank)
                    errors.append(f"--- rank {rank} --- died with exit code "
                                  f"{self.procs[rank].exitcode}")
        if errors:
            raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
        return results

    def run(self, fn, args, kwargs, timeout_s):
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout_s)

    def close(self, kill=False):
        for conn, p in zip(self.conns, self.procs):
            if not kill:
                try:
                    conn.send(None)
                except Exception:  # noqa: BLE001
                    pass
            if kill and p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, fresh: bool = False,
                    **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return per-rank results."""
    pool = None if fresh else _POOLS.get(world_size)
    if pool is not None and not all(p.is_alive() for p in pool.procs):
        pool.close(kill=True)
        pool = None
    if pool is None:
        pool = _Pool(world_size, timeout_s=timeout)
        if not fresh:
            _POOLS[world_size] = pool
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        pool.close(kill=True)
        _POOLS.pop(world_size, None)
        raise
    finally:
        if fresh:
            pool.close()


def shutdown_pools():
    for pool in list(_POOLS.values()):
        pool.close(kill=True)
    _POOLS.clear()
