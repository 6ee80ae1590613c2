"""Ring reduce-scatter and all-gather over point-to-point messages, for backends that lack fast
ones (gloo), over any process group.

For n ranks and a buffer of B bytes cut into n chunks, each of the n-1 steps sends one chunk to
the next rank and receives one from the previous: every rank sends and receives exactly
(n-1)/n B, the bandwidth-optimal volume. Reduce-scatter leaves the sum of chunk r on rank r;
all-gather fills every chunk on every rank.

On torch 2.13's gloo, ``reduce_scatter_tensor`` of 64 MiB over two ranks is slower than a full
``all_reduce`` of it, while one-way send/recv moves ~1.3 GB/s, so these rings win for large
buffers; ``comm`` picks between them and the backend's collectives per group, by its
policy or by measuring once (``choose``). Operations may run asynchronously on one
background thread per group, in issue order; each uses its own message tags, high above the
small tags of other users. When every rank of the group runs on one host, the chunks move
through shared memory instead of TCP loopback (``distributed.shm``: same results bit for bit,
about a third of the CPU time; ``transport="tcp"`` or ``MEGAZERO_SHM=0`` keeps the sockets).
An operation may carry an ``order.OrderCheck``: the ranks compare what they are about to do
before any data moves, on the ring's thread. This module imports nothing of megazero but
``distributed.shm`` and ``distributed.order``.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import torch
import torch.distributed as dist

from megazero.distributed import order
from megazero.distributed.order import OrderCheck
from megazero.distributed.shm import SharedSegments

_TAG_BASE = 1 << 30
_TAG_SPAN = 1 << 29


class _Future:
    """A work handle (``wait()``) for a ring operation run on the group's thread."""

    def __init__(self, future):
        self._future = future

    def wait(self):
        self._future.result()
        return True


class Ring:
    """Ring collectives over one process group (all ranks of it must create it alike)."""

    def __init__(self, group, transport: str = "auto"):
        if transport not in ("auto", "tcp"):
            raise ValueError(f"ring transport must be 'auto' or 'tcp', got {transport!r}")
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.n = len(self.ranks)
        self.rank = dist.get_rank(group)
        self.next = self.ranks[(self.rank + 1) % self.n]
        self.prev = self.ranks[(self.rank - 1) % self.n]
        self._next_tag = 0
        self._executor = None
        self._scratch = None  # receive buffer, reused across calls (fresh pages are slow)
        # shared memory with the peers when all ranks share this host (collective)
        self.shm = SharedSegments.create(group) if transport == "auto" and self.n > 1 \
            else None

    def _recv_buffer(self, like: torch.Tensor) -> torch.Tensor:
        s = self._scratch
        if s is None or s.dtype != like.dtype or s.device != like.device \
                or s.numel() < like.numel():
            s = self._scratch = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return s[:like.numel()].view_as(like)

    @property
    def nbytes(self) -> int:
        """Bytes of the receive buffer this ring keeps (sized to the largest chunk seen)."""
        s = self._scratch
        return 0 if s is None else s.numel() * s.element_size()

    @property
    def shared_nbytes(self) -> int:
        """Bytes of shared memory this rank maps (its segment and its peers')."""
        return 0 if self.shm is None else self.shm.nbytes

    def _tags(self, chunk_numel: int, dtype, reduce: bool) -> tuple[int, int]:
        """(first tag, tags per step) of the next operation; taken when it is issued, so that
        tags follow issue order on every rank."""
        if self.shm is not None:
            per = self.shm.rounds
            count = per * self.shm.pieces_of(chunk_numel, dtype, reduce)
        else:  # the order check's barrier, then one tag per step
            per, count = 1, order.rounds(self.n) + self.n
        tag = _TAG_BASE + self._next_tag % _TAG_SPAN
        self._next_tag += count
        if self._next_tag % _TAG_SPAN < count:  # do not wrap inside an operation
            tag = _TAG_BASE
            self._next_tag = count
        return tag, per

    def _exchange(self, send, recv, tag):
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def _submit(self, fn, *args):
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="megazero-ring")
        return _Future(self._executor.submit(fn, *args))

    def reduce_scatter(self, output: torch.Tensor, input_: torch.Tensor, *,
                       overwrite_input: bool = False, async_op: bool = False,
                       check: OrderCheck | None = None):
        """output (1-D, B/n) = sum over ranks of chunk ``rank`` of input_ (1-D, B)."""
        tag = self._tags(input_.numel() // self.n, input_.dtype, True)
        args = (output, input_, overwrite_input, tag, check)
        if async_op or self._executor is not None:  # keep issue order with queued ops
            work = self._submit(self._reduce_scatter, *args)
            return work if async_op else work.wait() and None
        self._reduce_scatter(*args)
        return None

    def _reduce_scatter(self, output, input_, overwrite_input, tags, check):
        tag, per = tags
        if self.shm is not None:  # reads the peers' pieces: input_ is never written
            self.shm.reduce_scatter(output, input_, tag, per, check)
            return
        if check is not None:
            order.exchange(self.group, self.ranks, self.rank, tag, check)
        tag += order.rounds(self.n)
        n, r = self.n, self.rank
        work = input_ if overwrite_input else input_.clone()
        chunks = work.view(n, -1)
        recv = self._recv_buffer(chunks[0])
        for k in range(n - 1):
            send_c, recv_c = (r - k - 1) % n, (r - k - 2) % n
            self._exchange(chunks[send_c], recv, tag + k)
            chunks[recv_c].add_(recv)
        output.copy_(chunks[r])

    def all_gather(self, output: torch.Tensor, input_: torch.Tensor, *, async_op: bool = False,
                   check: OrderCheck | None = None):
        """output (1-D, B) = concatenation over ranks of input_ (1-D, B/n)."""
        tag = self._tags(input_.numel(), input_.dtype, False)
        if async_op or self._executor is not None:
            work = self._submit(self._all_gather, output, input_, tag, check)
            return work if async_op else work.wait() and None
        self._all_gather(output, input_, tag, check)
        return None

    def _all_gather(self, output, input_, tags, check):
        tag, per = tags
        if self.shm is not None:
            self.shm.all_gather(output, input_, tag, per, check)
            return
        if check is not None:
            order.exchange(self.group, self.ranks, self.rank, tag, check)
        tag += order.rounds(self.n)
        n, r = self.n, self.rank
        chunks = output.view(n, -1)
        if chunks[r].data_ptr() != input_.data_ptr():
            chunks[r].copy_(input_)
        for k in range(n - 1):
            send_c, recv_c = (r - k) % n, (r - k - 1) % n
            self._exchange(chunks[send_c], chunks[recv_c], tag + k)


def _median_time(fn, group, reps=5):
    """Median over ``reps`` of the slowest rank's time (barrier before each call)."""
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(float(elapsed))
    return statistics.median(times)


def choose(group, native_rs, native_ag, numel: int = 1 << 20, policy: str = "auto") -> dict:
    """``{"reduce_scatter": bool, "all_gather": bool}``, True meaning use the ring on
    ``group``. ``policy`` "ring" or "native" decides without measuring; "auto" measures
    native vs ring reduce-scatter and all-gather (a 4 MiB fp32 buffer, the smallest the ring
    carries: gloo keeps scratch of the size it ran, ~2x the buffer; median of 5 of the
    slowest rank's times, after a warm-up), decides on rank 0 and broadcasts."""
    if policy in ("ring", "native"):
        use = policy == "ring"
        return {"reduce_scatter": use, "all_gather": use}
    ring = Ring(group)
    n = ring.n
    numel -= numel % n
    big = torch.ones(numel)
    part = torch.ones(numel // n)
    contenders = {
        "native_rs": lambda: native_rs(part, big, group),
        "ring_rs": lambda: ring.reduce_scatter(part, big, overwrite_input=True),
        "native_ag": lambda: native_ag(big, part, group),
        "ring_ag": lambda: ring.all_gather(big, part),
    }
    for fn in contenders.values():  # warm-up: connections, pages of the buffers
        fn()
    t = {name: _median_time(fn, group) for name, fn in contenders.items()}
    decision = torch.tensor([float(t["ring_rs"] < t["native_rs"]),
                             float(t["ring_ag"] < t["native_ag"])])
    dist.broadcast(decision, ring.ranks[0], group=group)
    return {"reduce_scatter": bool(decision[0]), "all_gather": bool(decision[1]),
            "timings": t}
