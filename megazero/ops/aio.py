"""Asynchronous file I/O for NVMe offload of optimizer states (ZeRO-Infinity, issue 18).

``AsyncIO`` moves the bytes of contiguous CPU tensors to and from byte ranges of files,
asynchronously: ``submit_write`` / ``submit_read`` return a handle at once, ``wait(handle)``
blocks until that request is complete and raises ``OSError`` (errno, the path, the operation,
the offsets) when it failed; ``wait_all`` waits for every request; ``close`` waits and joins
the threads (also on leaving a ``with`` block).

How a request runs (both engines alike, byte for byte): it is cut into ``block_size`` pieces
that a pool of ``num_threads`` threads named ``megazero-aio`` moves with pread/pwrite loops
(partial transfers continue, EINTR retries). With ``direct=True`` the request's body (its
size rounded down to ``ALIGN``) goes through a descriptor opened with ``O_DIRECT`` (no page
cache) when the tensor's address and the file offset are ``ALIGN``-aligned (``aligned_empty``
allocates such tensors); the unaligned tail, and requests at unaligned addresses or offsets,
go through a buffered descriptor. A filesystem refusing O_DIRECT (EINVAL: tmpfs, some FUSE)
gets buffered I/O for that file, recorded in ``direct_refused``. Writes create the file
(mode 0644; an empty write too) and never truncate it; a read reaching end of file early is
an error (EIO, "unexpected end of file"). A fake tensor (the dry run: a shape without
memory) moves nothing: its request completes at once and counts in ``fake_bytes_*``. Errors
surface at ``wait``/``wait_all``, never at submit (an open failure completes the request at
once, failed). A request's tensor is kept alive until it is waited for; the caller must not
resize it or (for reads) use its bytes before then.

Engines: the C++ one (``csrc/aio``, built as ``megazero.ops._aio``: std::thread pool,
pread/pwrite, no libtorch) or, when it is not built or disabled (``MEGAZERO_DISABLE_OPS=aio``),
the Python one: a ``concurrent.futures`` pool over ``os.pwrite`` / ``os.preadv`` on
memoryviews of the tensor's memory (the syscalls release the GIL). ``AsyncIO.engine`` says
which runs and why; ``engine_status()`` feeds ``python -m megazero.ops`` (built or not, and
whether O_DIRECT works on a probe directory).
"""

from __future__ import annotations

import operator
import os
import tempfile
import threading

import torch

from megazero.ops import _loader
from megazero.ops._cpu_ext import holds_data
from megazero.ops.aio_python import ALIGN, THREAD_NAME, _PythonEngine  # noqa: F401 (re-exported)
from megazero.ops.registry import register_op

EXTENSION = "aio"
CPP_ENGINE = "megazero C++ (threads, pread/pwrite, O_DIRECT)"
CPP_ENGINE_BUFFERED = "megazero C++ (threads, pread/pwrite, buffered: direct=False)"
PY_ENGINE = "Python threads (os.pread/os.pwrite)"
BACKENDS = ("auto", "cpp", "python")


def extension():
    """The compiled module ``megazero.ops._aio``, or None."""
    return _loader.load_extension(EXTENSION)


def _missing_reason() -> str:
    return _loader.status().get(EXTENSION, {}).get("reason", "not built")


def aligned_empty(numel: int, dtype=torch.float32) -> torch.Tensor:
    """A 1-D CPU tensor whose data pointer is ALIGN-aligned (pinned is not needed on CPU;
    with CUDA available, pinned too), numel rounded up so its byte size is a multiple of ALIGN
    (the returned tensor has exactly `numel` elements: a view of the larger aligned block)."""
    numel = operator.index(numel)
    if numel < 0:
        raise ValueError(f"aligned_empty: negative numel {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-numel * itemsize // ALIGN) * ALIGN
    pin = torch.cuda.is_available()
    raw = None
    if pin:
        # CUDA's caching host allocator rounds pinned sizes up to a power of two, so ALIGN
        # bytes of slack could double the block; its blocks are page-aligned: try without.
        raw = torch.empty(max(nbytes, ALIGN), dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN:
            raw = None
    if raw is None:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = -raw.data_ptr() % ALIGN
    return raw[shift:shift + nbytes].view(dtype)[:numel]


def probe_direct_io(directory: str | None = None) -> tuple[bool, str]:
    """Whether O_DIRECT opens, writes and reads an aligned block in ``directory`` (default:
    the temp dir), and why not. Leaves no file behind."""
    directory = directory or tempfile.gettempdir()
    if not hasattr(os, "O_DIRECT"):
        return False, "os.O_DIRECT is not defined on this platform"
    try:
        fd, name = tempfile.mkstemp(prefix=".megazero-aio-probe-", dir=directory)
    except OSError as exc:
        return False, f"cannot create a file in {directory}: {exc.strerror}"
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        try:
            view = memoryview(aligned_empty(ALIGN, torch.uint8).numpy())
            os.pwrite(fd, view, 0)
            os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return False, f"O_DIRECT refused on {directory}: {exc.strerror}"
    finally:
        os.unlink(name)
    return True, f"O_DIRECT works on {directory}"


def engine_status(probe_dir: str | None = None) -> dict:
    """For the ops report: whether the C++ engine is built (else why not, and the fallback
    engine), and whether O_DIRECT works on ``probe_dir`` (default: the temp dir)."""
    built = extension() is not None
    direct_ok, direct_reason = probe_direct_io(probe_dir)
    reason = "" if built else _missing_reason()
    return {"built": built, "engine": CPP_ENGINE if built else f"{PY_ENGINE}: {reason}",
            "reason": reason, "probe_dir": probe_dir or tempfile.gettempdir(),
            "direct_io": direct_ok, "direct_io_reason": direct_reason}


def _report_column() -> str:
    return "O_DIRECT ok" if probe_direct_io()[0] else "no O_DIRECT"


# --------------------------------------------------------------------------------------------
# The public face.


def _os_error(record: tuple, failure: tuple, others: int = 0) -> OSError:
    _, op, path, offset, nbytes = record
    err, at, what = failure
    reason = what if what.startswith("unexpected end of file") else \
        f"{os.strerror(err)} ({what})"
    more = f"; {others} more request(s) failed" if others else ""
    return OSError(err, f"AsyncIO {op} of {nbytes} bytes at offset {offset} failed at offset "
                        f"{at}: {reason}{more}", path)


class AsyncIO:
    """Asynchronous reads and writes of CPU tensors from/to byte ranges of files (module
    docstring). ``backend`` (an addition): "auto" (the C++ engine when built), "cpp" (raise
    when it is not) or "python"."""

    def __init__(self, num_threads: int = 4, block_size: int = 1 << 20, direct: bool = True,
                 *, backend: str = "auto"):
        if num_threads < 1:
            raise ValueError(f"AsyncIO: num_threads must be >= 1, got {num_threads}")
        if block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"AsyncIO: block_size must be a positive multiple of {ALIGN}, "
                             f"got {block_size}")
        if backend not in BACKENDS:
            raise ValueError(f"AsyncIO: backend must be one of {BACKENDS}, got {backend!r}")
        self.num_threads, self.block_size, self.direct = num_threads, block_size, bool(direct)
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple] = {}
        self._closed = False
        self._fake_seq, self._fake_bytes = 0, {"read": 0, "written": 0}
        ext = extension() if backend != "python" else None
        if ext is not None:
            self._impl = ext.Engine(num_threads, block_size, self.direct)
            self._engine = CPP_ENGINE if self.direct else CPP_ENGINE_BUFFERED
        elif backend == "cpp":
            raise RuntimeError(f"AsyncIO: the C++ engine is not available ({_missing_reason()})")
        else:
            self._impl = _PythonEngine(num_threads, block_size, self.direct)
            why = "backend='python'" if backend == "python" else _missing_reason()
            self._engine = f"{PY_ENGINE}: {why}"

    @property
    def engine(self) -> str:
        """Which engine runs: the C++ one, or the Python one and why."""
        return self._engine

    @property
    def bytes_read(self) -> int:
        return self._impl.counters()["bytes_read"]

    @property
    def bytes_written(self) -> int:
        return self._impl.counters()["bytes_written"]

    def counters(self) -> dict:
        """bytes_read, bytes_written, direct_bytes (moved with O_DIRECT), buffered_bytes,
        requests; fake_bytes_read/written: what requests of fake tensors (the dry run)
        would have moved."""
        return {**self._impl.counters(), "fake_bytes_read": self._fake_bytes["read"],
                "fake_bytes_written": self._fake_bytes["written"]}

    @property
    def direct_refused(self) -> dict[str, str]:
        """{path: reason} of files where O_DIRECT was refused and buffered I/O used."""
        return self._impl.direct_refused()

    @property
    def pending(self) -> int:
        """Requests submitted and not yet waited for."""
        with self._lock:
            return len(self._inflight)

    def _submit(self, write: bool, tensor: torch.Tensor, path, offset: int) -> int:
        if self._closed:
            raise RuntimeError("AsyncIO: submit after close()")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" \
                or not tensor.is_contiguous():
            raise ValueError("AsyncIO: the tensor must be a contiguous CPU tensor holding data")
        offset = operator.index(offset)
        if offset < 0:
            raise ValueError(f"AsyncIO: negative file offset {offset}")
        path = os.fspath(path)
        nbytes = tensor.numel() * tensor.element_size()
        if not holds_data(tensor):  # the dry run's fake tensor: no bytes to move, none moved
            with self._lock:
                self._fake_seq -= 1  # negative handles: complete at once, never in the engine
                self._fake_bytes["written" if write else "read"] += nbytes
                self._inflight[self._fake_seq] = (tensor, "fake", path, offset, nbytes)
                return self._fake_seq
        handle = self._impl.submit(write, tensor.data_ptr(), nbytes, path, offset)
        with self._lock:
            self._inflight[handle] = (tensor, "write" if write else "read", path, offset, nbytes)
        return handle

    def submit_write(self, tensor: torch.Tensor, path: str, offset: int = 0) -> int:
        """Queue writing the tensor's bytes to [offset, offset + nbytes) of ``path`` (created
        if needed, never truncated); returns the handle for ``wait``."""
        return self._submit(True, tensor, path, offset)

    def submit_read(self, tensor: torch.Tensor, path: str, offset: int = 0) -> int:
        """Queue reading [offset, offset + nbytes) of ``path`` into the tensor; returns the
        handle for ``wait`` (a file ending before offset + nbytes fails the request)."""
        return self._submit(False, tensor, path, offset)

    def wait(self, handle: int) -> None:
        """Block until the request is complete; OSError (errno, path, op, offsets) if it
        failed. Each handle is waited for once (ValueError after)."""
        with self._lock:
            record = self._inflight.get(handle)
        if record is None:
            raise ValueError(f"AsyncIO.wait: unknown or already waited handle {handle}")
        failure = self._impl.wait(handle) if handle >= 0 else None
        with self._lock:
            self._inflight.pop(handle, None)
        if failure is not None:
            raise _os_error(record, failure)

    def wait_all(self) -> None:
        """Block until every request is complete; OSError for the first (lowest handle) that
        failed, counting the others."""
        failed = [f for f in self._impl.wait_all() if f[0] >= 0]
        with self._lock:
            records, self._inflight = self._inflight, {}
        if failed:
            handle, failure = failed[0]
            raise _os_error(records[handle], failure, len(failed) - 1)

    def close(self) -> None:
        """Wait for every request (raising as wait_all does), then join the threads."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._impl.close()
            self._closed = True

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except OSError:
                pass  # the exception in flight wins

    def __del__(self):
        impl = getattr(self, "_impl", None)
        if impl is not None and not getattr(self, "_closed", True):
            try:
                impl.close()
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass


register_op("aio", EXTENSION, "NVMe offload I/O (AsyncIO): C++ thread pool, pread/pwrite, "
            "O_DIRECT (column: O_DIRECT probed on the temp dir)", simd_level_fn=_report_column)
