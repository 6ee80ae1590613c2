"""Cross-rank order checks carried by collectives, and the point-to-point barrier that
carries them.

A collective issued by ranks that disagree on what it is (ZeRO-3 ranks running different
modules) hangs or mixes up buffers. An ``OrderCheck`` names what this rank is about to do as
three integers (kind, index, sequence number); the ranks exchange them before any data moves,
and a disagreement raises the check's own error, built from the codes seen, instead.

Two carriers: a collective on megazero's ring exchanges the codes in its first barrier
(``exchange``: a dissemination barrier of point-to-point messages over the group, on the
ring's thread, so that the check costs the main thread nothing); any other collective is
preceded by a blocking all-gather of the codes (``comm``). ``exchange`` compares each rank's
code with those of the ranks it hears from (rank r - 2^k in round k): any disagreement is
seen by at least one rank, and at two ranks by both. This module imports nothing of megazero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

NO_CODE = (-1, -1, -1)  # sent by a rank that checks nothing


class CollectiveOrderError(RuntimeError):
    """Ranks of a group issued different collectives (an ``OrderCheck`` disagreed)."""


@dataclass(frozen=True)
class OrderCheck:
    """What this rank is about to issue, and the error to raise when the ranks disagree:
    ``error({group rank: code})`` with every code this rank saw, its own included."""

    code: tuple[int, int, int]
    error: Callable[[dict], CollectiveOrderError]


def rounds(n: int) -> int:
    """Messages each rank sends (and receives) in one barrier of ``n`` ranks."""
    return max(1, (n - 1).bit_length())


def exchange(group, ranks, rank: int, tag: int, check: OrderCheck | None = None) -> None:
    """Barrier over ``group`` (group ranks ``ranks``, this one ``rank``) by point-to-point
    messages with tags ``tag .. tag + rounds(n) - 1``; with ``check``, raise its error when a
    peer's code differs (after the last round, so that no peer waits on this rank)."""
    n = len(ranks)
    mine = torch.tensor(check.code if check is not None else NO_CODE, dtype=torch.int64)
    seen = {rank: tuple(mine.tolist())}
    bad = False
    for k in range(rounds(n)):
        dst, src = (rank + (1 << k)) % n, (rank - (1 << k)) % n
        theirs = torch.empty(3, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, mine, ranks[dst], group, tag + k),
               dist.P2POp(dist.irecv, theirs, ranks[src], group, tag + k)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        seen[src] = tuple(theirs.tolist())
        bad |= check is not None and seen[src] not in (seen[rank], NO_CODE)
    if bad:
        raise check.error(seen)
