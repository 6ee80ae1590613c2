"""Keys and values of past positions for incremental decoding (local: this rank's heads)."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the positions already processed, for incremental decoding.

    One pair of buffers per attention module, ``[b, heads / tp, max_len, head_dim]`` (this
    rank's heads), filled from ``offset``; the model advances ``offset`` after each forward.
    """

    def __init__(self, max_len: int):
        self.max_len, self.offset = max_len, 0
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, owner, k, v):
        """Store ``k, v`` ``[b, np, s, hn]`` at the next positions; return all keys and values
        so far, ``[b, np, offset + s, hn]``."""
        b, heads, s, hn = k.shape
        end = self.reserve(s)
        if id(owner) not in self._buffers:
            shape = (b, heads, self.max_len, hn)
            self._buffers[id(owner)] = (k.new_empty(shape), v.new_empty(shape))
        kb, vb = self._buffers[id(owner)]
        kb[:, :, self.offset:end] = k
        vb[:, :, self.offset:end] = v
        return kb[:, :, :end], vb[:, :, :end]

    def reserve(self, s: int) -> int:
        """Check that ``s`` more positions fit; return the end position."""
        end = self.offset + s
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot hold {end} "
                             f"({self.offset} cached + {s} new)")
        return end

    def advance(self, s: int):
        self.offset += s
