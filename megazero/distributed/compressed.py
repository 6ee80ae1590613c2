"""1-bit compressed all-reduce with error feedback on both sides (1-bit Adam, Tang et al. 2021;
DeepSpeed's ``compressed_allreduce``), over any process group: the communication of 1-bit /
0/1 Adam's momentum averaging over the data-parallel group.

Parallelised over ``group`` (n ranks): every rank holds a flat fp32 buffer x [N]; each rank
is the "server" of one chunk of it. Per call (``CompressedAllReduce.all_reduce_mean_``),
with x padded by zeros to P = ceil(N / 8n) * 8n elements, cut into n chunks of c = P / n:

1. worker (every rank): x += worker_error; per chunk j a scale s_j = ||x_j||_2 / sqrt(m_j),
   m_j the chunk's real (unpadded) elements -- DeepSpeed's RMS scale, taken per chunk rather
   than over the whole buffer, so that chunks of different magnitude (layers) each keep their
   own, and the compressed chunk has the norm of the original; the compressed value is
   s_j * sign(x) (sign(0) = +1); worker_error = x - compressed (0 on the padding).
2. all-to-all (``comm.all_to_all_single``): rank r receives chunk r, packed 8 signs a byte,
   with its scale, from every rank: one message of c/8 + 4 bytes per (sender, receiver).
3. server (rank r, chunk r): y = mean over ranks of the n decompressed chunks;
   y += server_error; compressed again with its own RMS scale; server_error = y - compressed.
4. all-gather (``comm.all_gather_into``) of every server's packed chunk and scale; every rank
   unpacks the same bytes, so all ranks end with bitwise identical buffers.

Bytes each rank sends per call (comm's statistics count exactly these)::

    all-to-all (n-1)(c/8 + 4) + all-gather (n-1)(c/8 + 4)
        = 2 (n-1)/n * P/8 + 8 (n-1)                          ~ N/4 bytes
    fp32 ring all-reduce of the same buffer: 2 (n-1)/n * 4N  ~ 8N bytes, 32x more.

A world of one rank returns the buffer unchanged (its exact mean; nothing compressed).

The sign codec is passed in (``codec``: ``megazero.ops.sign_pack``, whose compiled kernel or
PyTorch reference gives the same bits): ``distributed`` imports nothing of ``ops``. The two
error buffers are the caller's state to checkpoint (``state_dict``): worker_error [P] and
server_error [c] differ on every rank.

Imports nothing of megazero but ``distributed.comm``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from megazero.distributed import comm


class SignCodec(Protocol):
    """What ``megazero.ops.sign_pack`` provides: bit i%8 of byte i//8 set when x[i] >= 0."""

    def pack_signs(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def unpack_signs(self, packed: torch.Tensor, n: int, scale,
                     out: torch.Tensor | None = None) -> torch.Tensor: ...


_SCALE_BYTES = 4  # one fp32 scale travels behind each packed chunk


class CompressedAllReduce:
    """The 1-bit all-reduce-mean of a flat fp32 buffer of ``numel`` elements over ``group``,
    with the worker and server error-feedback buffers it keeps between calls.

    ``codec``: the sign codec (``megazero.ops.sign_pack``). ``error_feedback=False`` keeps
    both errors at zero (plain 1-bit compression; for comparisons). ``device``: where the
    buffers live (the group's backend's device; CPU for gloo).
    """

    def __init__(self, group, numel: int, codec: SignCodec, *, error_feedback: bool = True,
                 device: torch.device | str | None = None):
        if numel < 1:
            raise ValueError(f"CompressedAllReduce needs numel >= 1, got {numel}")
        self.group, self.codec, self.error_feedback = group, codec, error_feedback
        self.world_size = comm.group_size(group)
        self.rank = comm.group_rank(group)
        self.numel = numel
        n = self.world_size
        self.padded_numel = -(-numel // (8 * n)) * 8 * n  # P
        self.chunk_numel = self.padded_numel // n  # c, a multiple of 8
        self.chunk_bytes = self.chunk_numel // 8
        # real (unpadded) elements of each chunk: the scales' m_j
        self.chunk_counts = [min(max(numel - j * self.chunk_numel, 0), self.chunk_numel)
                             for j in range(n)]
        device = torch.device(device or "cpu")
        # 1 / sqrt(m_j) ([n]; 0 for a chunk of padding only, whose scale is then 0)
        self._inv_sqrt = torch.tensor([1.0 / math.sqrt(m) if m else 0.0
                                       for m in self.chunk_counts], device=device)
        self.worker_error = torch.zeros(self.padded_numel, device=device)  # [P]
        self.server_error = torch.zeros(self.chunk_numel, device=device)  # [c]
        self._x = torch.empty(self.padded_numel, device=device)  # [P] scratch: x, then y's n parts
        self._mean = torch.empty(self.chunk_numel, device=device)  # [c] the server's chunk
        row = self.chunk_bytes + _SCALE_BYTES
        # messages: [n, c/8 signs | 4 scale bytes]; row j of send goes to rank j
        self._send = torch.empty(n, row, dtype=torch.uint8, device=device)
        self._recv = torch.empty(n, row, dtype=torch.uint8, device=device)
        self._own = torch.empty(row, dtype=torch.uint8, device=device)  # this server's chunk
        self._gathered = torch.empty(n, row, dtype=torch.uint8, device=device)

    # ---- accounting ----------------------------------------------------------------------
    def bytes_per_call(self) -> int:
        """Bytes this rank sends per call: 2 (n-1) (c/8 + 4)."""
        return 2 * (self.world_size - 1) * (self.chunk_bytes + _SCALE_BYTES)

    def fp32_all_reduce_bytes(self) -> int:
        """Bytes an fp32 ring all-reduce of the same buffer sends: 2 (n-1)/n * 4N."""
        n = self.world_size
        return int(2 * (n - 1) / n * 4 * self.numel)

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies of the error buffers, with the sizes they belong to (per rank)."""
        return {"worker_error": self.worker_error.clone(),
                "server_error": self.server_error.clone(),
                "numel": self.numel, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state["numel"] != self.numel or state["world_size"] != self.world_size:
            raise ValueError(
                f"compressed all-reduce state of {state['numel']} elements over "
                f"{state['world_size']} ranks cannot be loaded into one of {self.numel} over "
                f"{self.world_size} (the server error is per chunk; reset_errors() instead)")
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])

    def reset_errors(self) -> None:
        """Zero both error buffers (e.g. when compression starts after the warm-up)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    # ---- the collective ------------------------------------------------------------------
    def all_reduce_mean_(self, buffer: torch.Tensor) -> torch.Tensor:
        """Replace ``buffer`` (fp32, contiguous, ``numel`` elements) by the compressed mean
        over the group (the same bits on every rank); returns it."""
        if buffer.dtype != torch.float32 or buffer.numel() != self.numel \
                or not buffer.is_contiguous():
            raise ValueError(f"all_reduce_mean_ takes a contiguous fp32 buffer of {self.numel} "
                             f"elements, got {buffer.dtype} {tuple(buffer.shape)}")
        if self.world_size == 1:
            return buffer
        flat = buffer.view(-1)
        self._compress_worker(flat)
        comm.all_to_all_single(self._recv, self._send, self.group)
        self._compress_server(self._own)
        comm.all_gather_into(self._gathered, self._own, self.group)
        self._unpack_result(flat)
        return buffer

    def _scales_to(self, rows: torch.Tensor, scales: torch.Tensor) -> None:
        """Write fp32 ``scales`` [k] behind the signs of ``rows`` [k, c/8 + 4]."""
        rows[:, self.chunk_bytes:].copy_(scales.view(torch.uint8).view(-1, _SCALE_BYTES))

    def _scales_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The fp32 scales [k] behind the signs of ``rows`` [k, c/8 + 4]."""
        return rows[:, self.chunk_bytes:].contiguous().view(torch.float32).view(-1)

    def _compress(self, x: torch.Tensor, rows: torch.Tensor, error: torch.Tensor,
                  scales: torch.Tensor) -> None:
        """Pack x [k*c] (k chunks with ``scales`` [k]) into ``rows`` [k, c/8 + 4]; with error
        feedback, ``error`` [k*c] = x - its decompressed value."""
        c, k = self.chunk_numel, rows.shape[0]
        for j in range(k):
            self.codec.pack_signs(x[j * c:(j + 1) * c], out=rows[j, :self.chunk_bytes])
        self._scales_to(rows, scales)
        if self.error_feedback:
            for j in range(k):
                self.codec.unpack_signs(rows[j, :self.chunk_bytes], c, scales[j:j + 1],
                                        out=error[j * c:(j + 1) * c])
            torch.sub(x, error, out=error)

    def _compress_worker(self, flat: torch.Tensor) -> None:
        n, c = self.world_size, self.chunk_numel
        x = self._x  # [P]
        x[:self.numel].copy_(flat)
        x[self.numel:].zero_()
        if self.error_feedback:
            x.add_(self.worker_error)  # its padding is 0
        scales = torch.linalg.vector_norm(x.view(n, c), dim=1) * self._inv_sqrt  # [n]
        self._compress(x, self._send, self.worker_error, scales)
        if self.error_feedback:
            self.worker_error[self.numel:].zero_()

    def _compress_server(self, out_row: torch.Tensor) -> None:
        n, c, r = self.world_size, self.chunk_numel, self.rank
        parts = self._x.view(n, c)  # the worker's x is packed and sent: reuse it
        scales = self._scales_of(self._recv)  # [n]: rank i's scale of chunk r
        for i in range(n):
            self.codec.unpack_signs(self._recv[i, :self.chunk_bytes], c, scales[i:i + 1],
                                    out=parts[i])
        y = torch.mean(parts, dim=0, out=self._mean)  # [c]
        if self.error_feedback:
            y.add_(self.server_error)
        y[self.chunk_counts[r]:].zero_()  # padding stays out of the scale and the errors
        scale = (torch.linalg.vector_norm(y) * self._inv_sqrt[r]).reshape(1)
        self._compress(y, out_row.view(1, -1), self.server_error, scale)
        if self.error_feedback:
            self.server_error[self.chunk_counts[r]:].zero_()

    def _unpack_result(self, flat: torch.Tensor) -> None:
        c = self.chunk_numel
        scales = self._scales_of(self._gathered)  # [n]
        for j, m in enumerate(self.chunk_counts):
            if m:
                self.codec.unpack_signs(self._gathered[j, :self.chunk_bytes], m,
                                        scales[j:j + 1], out=flat[j * c:j * c + m])
