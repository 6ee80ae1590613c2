"""Shared-memory transport for the ring collectives of ranks on one host (gloo groups).

gloo moves every byte between processes of one machine through TCP loopback: the sender's
kernel copies it into a socket buffer and the receiver's copies it out, so a reduce-scatter of
a 105 MB buffer over two ranks takes ~50 ms of CPU on this machine where a ``memcpy`` of the
half that moves takes ~8 ms. When every rank of a group runs on one host (same hostname and
boot id), each rank maps a segment of shared memory (a file in ``/dev/shm``, unlinked once
every peer mapped it, so nothing is left behind) and the peers' segments: a rank writes the
pieces the others need into its own segment and reads the pieces it needs straight from
theirs. Synchronisation is a dissemination barrier of tiny point-to-point messages (tags of the
ring's operation; the first piece's carries the operation's order check, ``order``), so it is
safe on the ring's background thread while the main thread issues other collectives on the
same group.

The segment holds two slots (pieces alternate between them: a rank writes slot s again only
after every peer passed the next piece's barrier, i.e. finished reading slot s); buffers
larger than a slot move in pieces. Sums are taken in the ring's order (chunk c is
x[c+1] + x[c+2] + ... + x[c], the order ``Ring._reduce_scatter`` adds in), so results are bit
for bit those of the TCP ring. This module imports nothing of megazero.
"""

from __future__ import annotations

import atexit
import os
import socket
import uuid

import torch
import torch.distributed as dist

from megazero.distributed import order
from megazero.distributed.order import OrderCheck

SHM_DIR = "/dev/shm"
# Bytes per slot. A piece costs one barrier (~0.1 ms); two slots of 4 MiB per rank, mapped by
# every peer, keep the resident cost at 8 MiB x ranks while a 50 MB transfer takes 13 pieces.
SLOT_BYTES = 4 << 20


def host_identity() -> str:
    """This machine: hostname and kernel boot id (containers on one host may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shm_disabled() -> bool:
    """``MEGAZERO_SHM=0`` turns the shared-memory transport off (like ``NCCL_SHM_DISABLE``)."""
    return os.environ.get("MEGAZERO_SHM", "1").strip().lower() in ("0", "false", "off", "no")


def _map(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class SharedSegments:
    """This rank's shared segment and its peers' (all ranks of ``group`` build it alike, in
    the same order of collectives; ``create`` returns None where it cannot be used)."""

    def __init__(self, group, ranks, rank, segments, slot_bytes):
        self.group, self.ranks, self.rank, self.n = group, ranks, rank, len(ranks)
        self.segments = segments  # group rank -> uint8 tensor (2 slots)
        self.slot_bytes = slot_bytes
        self.pieces = 0  # pieces moved so far: the slot of the next one is pieces % 2

    @property
    def rounds(self) -> int:
        return order.rounds(self.n)

    @property
    def nbytes(self) -> int:
        """Resident bytes this rank maps at most: every rank's segment."""
        return self.n * 2 * self.slot_bytes

    @classmethod
    def create(cls, group, slot_bytes: int | None = None):
        """Collective over ``group`` (main thread, before any ring operation): None unless
        every rank shares this host and ``/dev/shm`` works on every rank."""
        slot_bytes = slot_bytes or SLOT_BYTES
        ranks = dist.get_process_group_ranks(group)
        rank = dist.get_rank(group)
        n = len(ranks)
        key = uuid.uuid4().hex[:16]
        ident = None if shm_disabled() else host_identity()
        path, seg, ok = None, None, False
        if ident is not None:
            path = os.path.join(SHM_DIR, f"megazero-{key}-{rank}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    # reserve the pages now: a full /dev/shm (64 MiB in a default container)
                    # fails here with ENOSPC instead of a SIGBUS at the first write
                    os.posix_fallocate(fd, 0, 2 * slot_bytes)
                finally:
                    os.close(fd)
                atexit.register(_unlink, path)
                seg, ok = _map(path, 2 * slot_bytes), True
            except (OSError, RuntimeError):
                _unlink(path)
                path = None
        infos = [None] * n
        dist.all_gather_object(infos, (ident, path, ok), group=group)
        usable = all(i[2] and i[0] == ident for i in infos)
        segments = {}
        if usable:
            try:
                segments = {q: seg if q == rank else _map(infos[q][1], 2 * slot_bytes)
                            for q in range(n)}
            except (OSError, RuntimeError):
                usable = False
        # every rank mapped every segment (or gave up): agree, then remove the files
        everyone = [None] * n
        dist.all_gather_object(everyone, usable, group=group)
        if path is not None:
            _unlink(path)
        if not all(everyone):
            return None
        return cls(group, ranks, rank, segments, slot_bytes)

    # ---- synchronisation -----------------------------------------------------------------
    def barrier(self, tag: int, check: OrderCheck | None = None) -> None:
        """Dissemination barrier (tags ``tag + k``), carrying ``check`` (``order``)."""
        order.exchange(self.group, self.ranks, self.rank, tag, check)

    def _slot(self, q: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank q's slot for the current piece, as ``dtype`` elements."""
        s = self.pieces % 2
        raw = self.segments[q][s * self.slot_bytes:(s + 1) * self.slot_bytes]
        return raw.view(dtype)

    def _piece_elems(self, dtype: torch.dtype, parts: int) -> int:
        """Elements per chunk in one piece when ``parts`` chunk-pieces share a slot."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return max(1, self.slot_bytes // (itemsize * max(1, parts)))

    # ---- collectives ---------------------------------------------------------------------
    def reduce_scatter(self, output: torch.Tensor, input_: torch.Tensor, tag: int,
                       tags_per_piece: int, check: OrderCheck | None = None) -> None:
        """output (1-D, B/n) = sum over ranks of chunk ``rank`` of input_ (1-D, B), in the
        ring's order; ``output`` may be ``input_``'s own chunk. The first piece's barrier
        carries ``check``."""
        n, r = self.n, self.rank
        chunks = input_.view(n, -1)
        c = chunks.shape[1]
        others = [q for q in range(n) if q != r]  # slot region i holds chunk others[i]
        p = self._piece_elems(input_.dtype, n - 1)
        scratch = None
        for i, lo in enumerate(range(0, c, p)):
            hi = min(c, lo + p)
            m = hi - lo
            mine = self._slot(r, input_.dtype)
            for j, q in enumerate(others):
                mine[j * m:(j + 1) * m].copy_(chunks[q, lo:hi])
            self.barrier(tag + i * tags_per_piece, check if i == 0 else None)

            def peer(q, m=m):  # rank q's piece of chunk r
                j = r if r < q else r - 1  # r's place among q's "others"
                return self._slot(q, input_.dtype)[j * m:(j + 1) * m]

            out = output[lo:hi]
            if n == 2:
                torch.add(peer(others[0]), chunks[r, lo:hi], out=out)
            else:
                if scratch is None:
                    scratch = torch.empty(p, dtype=input_.dtype)
                acc = scratch[:m]
                order = [(r + k) % n for k in range(1, n)]  # r+1, r+2, ..., r-1
                torch.add(peer(order[1]), peer(order[0]), out=acc)
                for q in order[2:]:
                    torch.add(peer(q), acc, out=acc)
                torch.add(chunks[r, lo:hi], acc, out=out)
            self.pieces += 1

    def all_gather(self, output: torch.Tensor, input_: torch.Tensor, tag: int,
                   tags_per_piece: int, check: OrderCheck | None = None) -> None:
        """output (1-D, B) = concatenation over ranks of input_ (1-D, B/n)."""
        n, r = self.n, self.rank
        chunks = output.view(n, -1)
        c = chunks.shape[1]
        if chunks[r].data_ptr() != input_.data_ptr():
            chunks[r].copy_(input_)
        p = self._piece_elems(output.dtype, 1)
        for i, lo in enumerate(range(0, c, p)):
            hi = min(c, lo + p)
            self._slot(r, output.dtype)[:hi - lo].copy_(input_[lo:hi])
            self.barrier(tag + i * tags_per_piece, check if i == 0 else None)
            for q in range(n):
                if q != r:
                    chunks[q, lo:hi].copy_(self._slot(q, output.dtype)[:hi - lo])
            self.pieces += 1

    def pieces_of(self, numel_per_chunk: int, dtype: torch.dtype, reduce: bool) -> int:
        """How many pieces (barriers) a collective of this chunk size takes."""
        p = self._piece_elems(dtype, self.n - 1 if reduce else 1)
        return max(1, -(-numel_per_chunk // p))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
