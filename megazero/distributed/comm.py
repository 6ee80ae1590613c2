"""Collective wrappers over any process group, with byte accounting and ring selection.

Every collective megazero issues goes through a ``Communicator``: (a) a group of size one (or
``None``) never touches torch.distributed; (b) its ``stats`` count the calls and the bytes
each rank sends and receives per kind of collective; (c) on gloo, large reduce-scatters and
all-gathers may run on megazero's ring (``ring``), chosen per group by ``ring_policy``
("auto": measured once per group; "ring"; "native"). Bytes are those of the
bandwidth-optimal ring algorithm (what NCCL and megazero's own ring collectives move): for n
ranks and a buffer of B bytes, all-reduce sends and receives 2(n-1)/n B, all-gather and
reduce-scatter (n-1)/n of the full buffer, all-to-all (n-1)/n B (what leaves the rank),
broadcast (n-1)/n B on average; point-to-point counts exactly what moved.

Each ``ParallelState`` owns one communicator and binds the groups it creates to it
(``bind``), so code that has only a group (the tensor-parallel layers, usable in any model)
calls the module functions (``all_reduce(t, group)``, ...), which use the communicator bound
to that group (``communicator_of``): statistics and ring choices live on the communicator,
not in this module. A group bound to nothing (a user's own) gets plain collectives, uncounted.

``OfflineGroup(size, rank)`` stands in for a process group where there is none (tools that
build one rank's model on the meta device to learn its shapes and shards, e.g. the checkpoint
converter): ``group_size`` / ``group_rank`` return its numbers and every collective raises
``OfflineGroupError``.

Every collective checks its tensors' device against the group's backend
(``device.expected_device_type``: NCCL and the NCCL half of ``cpu:gloo,cuda:nccl`` take CUDA
tensors, gloo CPU tensors) and raises ``CollectiveDeviceError`` naming the collective, the
group, the tensor's device and the expected one; host-side traffic (``all_gather_object``)
takes the backend's CPU route. A communicator may stand in for another backend
(``backend=``): the dry run's fake process group is checked as the ``cpu:gloo,cuda:nccl`` of
the job it rehearses. With ``recording`` on, every collective and point-to-point message is
appended to ``records`` (group, op, shape, dtype, bytes, peer) for the dry run's report and
its cross-rank comparison.

All-gathers and reduce-scatters may carry an ``OrderCheck`` (``order=``): the ranks compare
what they are about to issue before any data moves (on the ring's thread, inside its first
barrier, where the ring carries the collective; else a blocking all-gather of the codes) and
raise the check's error on a disagreement.

This module imports nothing of megazero but ``distributed.ring``, ``distributed.order`` and
``distributed.device``, so ``tensor_parallel`` stays usable on its own.
"""

from __future__ import annotations

import contextlib
import io
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megazero.distributed import ring as _ring
from megazero.distributed.device import (
    expected_device_type,
    fake_to_meta,
    host_all,
    host_device_type,
    host_side,
    parse_backend,
)
from megazero.distributed.order import CollectiveOrderError, OrderCheck

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

RING_POLICIES = ("auto", "ring", "native")
# Megazero's ring collectives replace gloo's for buffers of at least this size, when the
# policy (or, with "auto", a one-time measurement on the group) says so. Measured here (two
# and four ranks): from 4 MiB the ring takes 0.3-0.8x gloo's time; at 1 MiB results are mixed.
RING_MIN_BYTES = 4 << 20


class OfflineGroupError(RuntimeError):
    """A collective was called on an ``OfflineGroup`` (no processes to talk to)."""


class CollectiveError(RuntimeError):
    """A collective or point-to-point message failed (a peer died, froze past the group's
    timeout, or issued a different collective); the message names the group, the operation
    and, for point-to-point, the peer."""


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor on a device its group's backend cannot carry (a CPU tensor
    on NCCL, a CUDA tensor on gloo)."""


@dataclass(frozen=True)
class OfflineGroup:
    """A process group's size and this rank's place in it, without any processes.

    Layers built with it shard their parameters as rank ``rank`` of ``size`` would; any
    collective on it raises ``OfflineGroupError``.
    """

    size: int
    rank: int = 0
    name: str = "offline"

    def __post_init__(self):
        if not (self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"OfflineGroup needs 0 <= rank < size, got rank {self.rank} of "
                             f"size {self.size}")


def _require_online(group, what: str) -> None:
    if isinstance(group, OfflineGroup):
        raise OfflineGroupError(
            f"{what} called on offline group {group.name!r} (rank {group.rank} of "
            f"{group.size}): it has no processes; offline groups only describe shapes")


def _ask(group, alone: int, ask) -> int:
    """``ask(group)``, or ``alone`` without a process group (a world of one)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return alone
    return ask(group)


def group_size(group) -> int:
    return group.size if isinstance(group, OfflineGroup) else _ask(group, 1, dist.get_world_size)


def group_rank(group) -> int:
    return group.rank if isinstance(group, OfflineGroup) else _ask(group, 0, dist.get_rank)


def backend_of(group=None) -> str | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_backend(group)


@dataclass
class CommStats:
    """Per-kind counters of one process: calls, bytes sent, bytes received."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True

    def add(self, kind: str, sent: float, received: float) -> None:
        if self.enabled:
            self.calls[kind] += 1
            self.sent[kind] += int(sent)
            self.received[kind] += int(received)

    def reset(self) -> None:
        self.calls.clear()
        self.sent.clear()
        self.received.clear()

    def total_sent(self) -> int:
        return sum(self.sent.values())

    def total_received(self) -> int:
        return sum(self.received.values())

    def snapshot(self) -> dict:
        return {k: {"calls": self.calls[k], "sent": self.sent[k], "received": self.received[k]}
                for k in sorted(self.calls)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective or point-to-point message as this rank issued it."""

    group: str  # the group's name ("tp", "dp", ...) or its ranks
    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv
    shape: tuple
    dtype: str
    bytes: int  # bytes this rank sends (ring-algorithm accounting; p2p: the message)
    peer: int | None = None  # p2p: the other global rank
    device: str = ""
    host: bool = False  # host-side traffic (object gathers) on the backend's CPU route


def _native_rs(out, inp, group):
    _reduce_scatter_single(out, inp, group=group)


def _native_ag(out, inp, group):
    _all_gather_single(out, inp, group=group)


class Communicator:
    """Collectives with byte accounting (``stats``) and per-group ring choice (``ring_policy``:
    "auto", "ring" or "native"); one per ``ParallelState``."""

    def __init__(self, ring_policy: str = "auto", stats: CommStats | None = None, *,
                 backend: str | None = None):
        if ring_policy not in RING_POLICIES:
            raise ValueError(f"ring policy must be one of {RING_POLICIES}, got {ring_policy!r}")
        self.ring_policy = ring_policy
        self.stats = stats if stats is not None else CommStats()
        self.backend = backend  # stands in for the groups' own backend (the dry run)
        # group -> name ("tp", "dp", ...) and backend; weak, so that destroying the process
        # groups frees them (a group alive at interpreter exit can abort it, see init)
        self.names = weakref.WeakKeyDictionary()
        self.strict = True  # False: any device the backend can carry (unbound groups)
        self.recording = False
        self.records: list[CollectiveRecord] = []
        self._rings: dict = {}  # group -> (Ring, {"reduce_scatter": bool, "all_gather": bool})
        self._backends = weakref.WeakKeyDictionary()

    # ---- device checks and records -------------------------------------------------------
    def group_backend(self, group) -> str | None:
        if self.backend is not None:
            return self.backend
        if group is None:
            return backend_of(None)
        if group not in self._backends:
            self._backends[group] = backend_of(group)
        return self._backends[group]

    def group_name(self, group) -> str:
        name = self.names.get(group) if group is not None else None
        if name is not None:
            return name
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return "world"
        return str(dist.get_process_group_ranks(group))

    def check_device(self, op: str, tensor: torch.Tensor, group, host: bool = False) -> None:
        """Raise ``CollectiveDeviceError`` unless ``tensor`` is on the device the group's
        backend takes (``host``: the backend's host-side route)."""
        backend = self.group_backend(group)
        if not self.strict:
            routes = parse_backend(backend)
            if not routes or tensor.device.type in routes:
                return
            want = "/".join(routes)
        else:
            want = host_device_type(backend) if host else expected_device_type(backend)
        if want is not None and tensor.device.type != want:
            raise CollectiveDeviceError(
                f"{op} on the {self.group_name(group)} group (backend {backend}) got a tensor "
                f"on {tensor.device} (shape {tuple(tensor.shape)}, {tensor.dtype}); this "
                f"backend needs {want} tensors: allocate it on ParallelState.device")

    def _run(self, op: str, group, call, peer: int | None = None):
        """``call()`` (a torch.distributed operation), its failure re-raised as a
        ``CollectiveError`` naming ``op``, the group and the peer; async works are wrapped so
        that ``wait()`` does the same."""
        try:
            work = call()
        except CollectiveOrderError:
            raise
        except RuntimeError as exc:
            raise self.failure(op, group, exc, peer) from exc
        return _NamedWork(work, self, op, group, peer) if work is not None else None

    def named_work(self, work, op: str, group, peer: int | None = None):
        """``work`` (posted elsewhere) whose ``wait()`` failure names op, group and peer."""
        return _NamedWork(work, self, op, group, peer) if work is not None else None

    def failure(self, op: str, group, exc: BaseException, peer: int | None = None):
        ranks = ""
        if group is not None and dist.is_available() and dist.is_initialized():
            try:
                ranks = f" (ranks {dist.get_process_group_ranks(group)})"
            except (RuntimeError, ValueError):
                ranks = ""
        who = f" with rank {peer}" if peer is not None else ""
        return CollectiveError(
            f"{op}{who} on the {self.group_name(group)} group{ranks} failed: a rank of the "
            f"group is dead, frozen past --distributed-timeout-minutes, or issued a different "
            f"collective. {type(exc).__name__}: {exc}")

    def _record(self, op: str, tensor: torch.Tensor, group, nbytes: float,
                peer: int | None = None, host: bool = False) -> None:
        if self.recording:
            self.records.append(CollectiveRecord(
                self.group_name(group), op, tuple(tensor.shape), str(tensor.dtype).replace(
                    "torch.", ""), int(nbytes), peer, str(tensor.device), host))

    @contextlib.contextmanager
    def counting(self):
        """Reset the counters on entry; read them inside or after the block."""
        self.stats.reset()
        yield self.stats

    def _ring_for(self, group, kind: str, nbytes: int):
        """The group's Ring when it should carry this collective, else None."""
        if nbytes < RING_MIN_BYTES or backend_of(group) != "gloo" \
                or self.ring_policy == "native":
            return None
        entry = self._rings.get(group)
        if entry is None:
            enabled, self.stats.enabled = self.stats.enabled, False
            try:
                entry = (_ring.Ring(group), _ring.choose(group, _native_rs, _native_ag,
                                                         policy=self.ring_policy))
            finally:
                self.stats.enabled = enabled
            self._rings[group] = entry
        return entry[0] if entry[1][kind] else None

    def buffer_bytes(self, group) -> int:
        """Bytes of the buffers kept for ``group``'s collectives (its ring's receive buffer)."""
        entry = self._rings.get(group)
        return entry[0].nbytes if entry is not None else 0

    def shared_buffer_bytes(self, group) -> int:
        """Bytes of shared memory ``group``'s ring maps (its segment and its peers', same
        host): resident as shared, not anonymous, memory."""
        entry = self._rings.get(group)
        return entry[0].shared_nbytes if entry is not None else 0

    def ring_decisions(self) -> dict:
        """What the measurement (or the policy) chose per group (reports, benchmarks)."""
        return {str(dist.get_process_group_ranks(g)): d for g, (_, d) in self._rings.items()}

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor, group=None, op=dist.ReduceOp.SUM, async_op=False,
                   host=False):
        """``host``: a host-side flag on the backend's CPU route (no wait for the device)."""
        _require_online(group, "all_reduce")
        n = group_size(group)
        if n == 1:
            return None
        self.check_device("all_reduce", tensor, group, host)
        b = _nbytes(tensor)
        self.stats.add("all_reduce", 2 * (n - 1) / n * b, 2 * (n - 1) / n * b)
        self._record("all_reduce", tensor, group, 2 * (n - 1) / n * b, host=host)
        return self._run("all_reduce", group, lambda: dist.all_reduce(
            tensor, op=op, group=group, async_op=async_op))

    def _begin(self, kind, output, input_, group, shard_nbytes, full_nbytes, ring_ok=True,
               host=False):
        """What all-gather and reduce-scatter share: (False, None) when the group has one
        rank (the copy is done), else check devices, count the bytes and (True, the Ring to
        use or None)."""
        _require_online(group, f"{kind}_into")
        n = group_size(group)
        if n == 1:
            output.copy_(input_.reshape(output.shape))
            return False, None
        self.check_device(kind, input_, group, host)
        self.check_device(kind, output, group, host)
        self.stats.add(kind, (n - 1) * shard_nbytes, (n - 1) * shard_nbytes)
        self._record(kind, input_, group, (n - 1) * shard_nbytes, host=host)
        return True, self._ring_for(group, kind, full_nbytes) if ring_ok else None

    def check_order(self, group, check: OrderCheck, like: torch.Tensor) -> None:
        """Blocking all-gather of ``check.code`` over ``group`` (on ``like``'s device); raise
        ``check.error`` when the ranks' codes differ."""
        n = group_size(group)
        # made from ``like`` (new_empty): in module backward hooks a fake tensor (the dry
        # run) carries its mode where a factory call might not
        mine = like.new_empty(3, dtype=torch.int64)
        mine.copy_(torch.tensor(check.code, dtype=torch.int64))
        everyone = like.new_empty(3 * n, dtype=torch.int64)
        self.all_gather_into(everyone, mine, group)
        rows = everyone.view(n, 3)
        if not host_all(rows == rows[0]):
            raise check.error({q: tuple(int(v) for v in row) for q, row in
                               enumerate(rows.cpu())})

    def all_gather_into(self, output, input_, group=None, async_op=False, host=False,
                        order: OrderCheck | None = None):
        """output = concat over ranks of input_ (along dim 0 of the flat layout); ``host``:
        host-side traffic on the backend's CPU route; ``order``: checked first."""
        active, ring = self._begin("all_gather", output, input_, group, _nbytes(input_),
                                   _nbytes(output), host=host)
        if not active:
            return None
        if ring is not None:
            return self._run("all_gather", group, lambda: ring.all_gather(
                output.view(-1), input_.reshape(-1), async_op=async_op, check=order))
        if order is not None:
            self.check_order(group, order, output)
        # 1-D views: gloo splits the output along dim 0 into n equal chunks of the input's shape.
        return self._run("all_gather", group, lambda: _all_gather_single(
            output.view(-1), input_.reshape(-1), group=group, async_op=async_op))

    def reduce_scatter_into(self, output, input_, group=None, op=dist.ReduceOp.SUM,
                            async_op=False, overwrite_input=False,
                            order: OrderCheck | None = None):
        """output = this rank's chunk (dim 0) of the sum over ranks of input_.

        ``overwrite_input`` lets the ring implementation use ``input_`` as scratch space;
        ``output`` may then be ``input_``'s own chunk of this rank (no extra buffer).
        """
        active, ring = self._begin("reduce_scatter", output, input_, group, _nbytes(output),
                                   _nbytes(input_), ring_ok=op == dist.ReduceOp.SUM)
        if not active:
            return None
        if ring is not None:
            return self._run("reduce_scatter", group, lambda: ring.reduce_scatter(
                output.view(-1), input_.reshape(-1), overwrite_input=overwrite_input,
                async_op=async_op, check=order))
        if order is not None:
            self.check_order(group, order, output)
        if _same_storage(output, input_):  # in place (chunk r of input_): the ring's way
            tmp = torch.empty_like(output)
            work = self._run("reduce_scatter", group, lambda: _reduce_scatter_single(
                tmp.view(-1), input_.reshape(-1), op=op, group=group, async_op=async_op))
            if work is None:
                output.copy_(tmp)
                return None
            return _CopyOnWait(work, tmp, output)
        return self._run("reduce_scatter", group, lambda: _reduce_scatter_single(
            output.view(-1), input_.reshape(-1), op=op, group=group, async_op=async_op))

    def broadcast(self, tensor, src: int, group=None, async_op=False):
        """Broadcast from global rank ``src`` of ``group``."""
        _require_online(group, "broadcast")
        n = group_size(group)
        if n == 1:
            return None
        self.check_device("broadcast", tensor, group)
        b = _nbytes(tensor)
        self.stats.add("broadcast", (n - 1) / n * b, (n - 1) / n * b)
        self._record("broadcast", tensor, group, (n - 1) / n * b)
        return self._run("broadcast", group, lambda: dist.broadcast(
            tensor, src=src, group=group, async_op=async_op))

    def all_to_all_single(self, output, input_, group=None, async_op=False):
        """Chunk j (dim 0, n equal chunks) of ``input_`` goes to rank j of the group; chunk i
        of ``output`` comes from rank i. Each rank sends and receives (n-1)/n of its buffer."""
        _require_online(group, "all_to_all")
        n = group_size(group)
        if n == 1:
            output.copy_(input_.reshape(output.shape))
            return None
        self.check_device("all_to_all", input_, group)
        self.check_device("all_to_all", output, group)
        b = (n - 1) / n * _nbytes(input_)
        self.stats.add("all_to_all", b, b)
        self._record("all_to_all", input_, group, b)
        return self._run("all_to_all", group, lambda: dist.all_to_all_single(
            output, input_, group=group, async_op=async_op))

    def all_gather_object(self, obj, group=None) -> list:
        """Gather a picklable object of tensors and plain values from every rank of
        ``group``. Serialised with ``torch.save`` and read back with ``weights_only=True``
        (torch 2.13's ``dist.all_gather_object`` fails on objects holding tensors). Travels
        on the backend's host route (gloo's half of ``cpu:gloo,cuda:nccl``)."""
        _require_online(group, "all_gather_object")
        n = group_size(group)
        if n == 1:
            return [obj]
        with host_side():  # bytes on the host, also inside the dry run's fake-tensor mode
            return self._all_gather_object(obj, group, n)

    def _all_gather_object(self, obj, group, n: int) -> list:
        host = host_device_type(self.group_backend(group)) or "cpu"
        buf = io.BytesIO()
        torch.save(fake_to_meta(obj), buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=host)
        sizes = torch.full((n,), data.numel(), dtype=torch.int64, device=host)
        self.all_gather_into(sizes, size, group, host=True)
        sizes = sizes.cpu()
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[:data.numel()] = data
        out = torch.empty(n * padded.numel(), dtype=torch.uint8, device=host)
        self.all_gather_into(out, padded.to(host), group, host=True)
        if backend_of(group) == "fake":  # the dry run's groups move no data: ours, n times
            return [obj for _ in range(n)]
        chunks = out.cpu().view(n, -1)
        blobs = [io.BytesIO(chunks[i, :int(sizes[i])].numpy().tobytes()) for i in range(n)]
        return [torch.load(blob, weights_only=True) for blob in blobs]

    def barrier(self, group=None) -> None:
        _require_online(group, "barrier")
        if group_size(group) > 1:
            self._run("barrier", group, lambda: dist.barrier(group=group))

    def count_p2p(self, sent: int, received: int) -> None:
        """Account a point-to-point message posted elsewhere (batched p2p ops)."""
        self.stats.add("p2p", sent, received)

    def p2p_posted(self, op: str, tensor: torch.Tensor, peer: int, group=None) -> None:
        """Check, count and record a point-to-point ``op`` ("send" or "recv") with global
        rank ``peer``, posted elsewhere (batched p2p ops)."""
        self.check_device(op, tensor, group)
        b = _nbytes(tensor)
        self.count_p2p(b, 0) if op == "send" else self.count_p2p(0, b)
        self._record(op, tensor, group, b, peer)

    def send(self, tensor, dst: int, group=None):
        _require_online(group, "send")
        self.p2p_posted("send", tensor, dst, group)
        self._run("send", group, lambda: dist.send(tensor, dst, group=group), dst)

    def recv(self, tensor, src: int, group=None):
        _require_online(group, "recv")
        self.p2p_posted("recv", tensor, src, group)
        self._run("recv", group, lambda: dist.recv(tensor, src, group=group), src)

    def isend(self, tensor, dst: int, group=None):
        _require_online(group, "isend")
        self.p2p_posted("send", tensor, dst, group)
        return self._run("send", group, lambda: dist.isend(tensor, dst, group=group), dst)

    def irecv(self, tensor, src: int, group=None):
        _require_online(group, "irecv")
        self.p2p_posted("recv", tensor, src, group)
        return self._run("recv", group, lambda: dist.irecv(tensor, src, group=group), src)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() \
        and a.device == b.device and a.untyped_storage().nbytes() > 0


class _CopyOnWait:
    """An async reduce-scatter into a temporary whose ``wait()`` copies it into place."""

    def __init__(self, work, tmp: torch.Tensor, output: torch.Tensor):
        self.work, self._tmp, self._output = work, tmp, output

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        if self._tmp is not None:
            self._output.copy_(self._tmp)
            self._tmp = None
        return result


class _NamedWork:
    """An async work whose failure in ``wait()`` names the collective, group and peer."""

    def __init__(self, work, comm: Communicator, op: str, group, peer):
        self.work, self._comm, self._op, self._group, self._peer = work, comm, op, group, peer

    def wait(self, *args, **kwargs):
        try:
            return self.work.wait(*args, **kwargs)
        except CollectiveOrderError:
            raise
        except RuntimeError as exc:
            raise self._comm.failure(self._op, self._group, exc, self._peer) from exc

    def __getattr__(self, name):
        return getattr(self.work, name)


# Plain collectives for groups bound to no communicator: uncounted, never on the ring. It
# holds no state (its counters are disabled and "native" never measures).
_PLAIN = Communicator("native", CommStats(enabled=False))
_PLAIN.strict = False  # a user's own group: any device its backend has a route for
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> Communicator


def bind(communicator: Communicator, groups) -> None:
    """Make ``communicator`` carry the collectives of ``groups`` (process groups, or a dict
    name -> group naming them in messages and records; ``None`` and offline groups are
    skipped). A group belongs to the last communicator bound to it."""
    named = groups.items() if isinstance(groups, dict) else ((None, g) for g in groups)
    for name, group in named:
        if group is not None and not isinstance(group, OfflineGroup):
            _BOUND[group] = communicator
            if name is not None:
                communicator.names.setdefault(group, name)


def communicator_of(group) -> Communicator:
    """The communicator bound to ``group``, or plain uncounted collectives."""
    if group is None or isinstance(group, OfflineGroup):
        return _PLAIN
    return _BOUND.get(group, _PLAIN)


def all_reduce(tensor, group=None, op=dist.ReduceOp.SUM, async_op=False, host=False):
    return communicator_of(group).all_reduce(tensor, group, op=op, async_op=async_op,
                                             host=host)


def all_gather_into(output, input_, group=None, async_op=False, host=False, order=None):
    return communicator_of(group).all_gather_into(output, input_, group, async_op=async_op,
                                                  host=host, order=order)


def reduce_scatter_into(output, input_, group=None, op=dist.ReduceOp.SUM, async_op=False,
                        overwrite_input=False, order=None):
    return communicator_of(group).reduce_scatter_into(output, input_, group, op=op,
                                                      async_op=async_op,
                                                      overwrite_input=overwrite_input,
                                                      order=order)


def all_to_all_single(output, input_, group=None, async_op=False):
    return communicator_of(group).all_to_all_single(output, input_, group, async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op=False):
    return communicator_of(group).broadcast(tensor, src, group, async_op=async_op)


def all_gather_object(obj, group=None) -> list:
    return communicator_of(group).all_gather_object(obj, group)


def barrier(group=None) -> None:
    communicator_of(group).barrier(group)
