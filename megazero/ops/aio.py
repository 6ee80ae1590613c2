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
an error (EIO, "unexpected end of file"). Errors surface at ``wait``/``wait_all``, never at
submit (an open failure completes the request at once, failed). A request's tensor is kept
alive until it is waited for; the caller must not resize it or (for reads) use its bytes
before then.

Engines: the C++ one (``csrc/aio``, built as ``megazero.ops._aio``: std::thread pool,
pread/pwrite, no libtorch) or, when it is not built or disabled (``MEGAZERO_DISABLE_OPS=aio``),
the Python one: a ``concurrent.futures`` pool over ``os.pwrite`` / ``os.preadv`` on
memoryviews of the tensor's memory (the syscalls release the GIL). ``AsyncIO.engine`` says
which runs and why; ``engine_status()`` feeds ``python -m megazero.ops`` (built or not, and
whether O_DIRECT works on a probe directory).
"""

from __future__ import annotations

import ctypes
import errno
import operator
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from megazero.ops import _loader
from megazero.ops._cpu_ext import holds_data
from megazero.ops.registry import register_op

ALIGN = 4096  # bytes: buffer address, file offset and length alignment for O_DIRECT
THREAD_NAME = "megazero-aio"
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
# The Python engine: the C++ Engine's methods and semantics over os.pwrite / os.preadv.

_LIBC = None


def _name_os_thread() -> None:
    """Name the calling worker thread as the C++ pool's are (``/proc/self/task/*/comm``)."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.prctl(15, THREAD_NAME.encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _call(write: bool, direct: bool) -> str:
    return ("pwrite" if write else "pread") + (" (O_DIRECT)" if direct else "")


def _transfer(write, fd, view, offset, direct):
    """(bytes moved, failure or None, O_DIRECT refused): aio_engine.cpp's transfer() loop."""
    done, n = 0, len(view)
    while done < n:
        if direct and done % ALIGN:
            return done, None, False  # a partial transfer left the ALIGN grid
        try:
            if write:
                moved = os.pwrite(fd, view[done:], offset + done)
            else:
                moved = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:  # EINTR is retried by Python itself (PEP 475)
            if direct and exc.errno == errno.EINVAL:
                return done, None, True
            return done, (exc.errno, offset + done,
                          f"{_call(write, direct)} of {n - done} bytes"), False
        if moved == 0:
            what = f"{_call(write, direct)} moved 0 of {n - done} bytes"
            if not write:
                what = (f"unexpected end of file (the file holds {os.fstat(fd).st_size} bytes; "
                        f"{n - done} more were asked for)")
            return done, (errno.EIO, offset + done, what), False
        done += moved
    return done, None, False


class _Request:
    __slots__ = ("write", "path", "fds", "futures", "failure")

    def __init__(self, write, path):
        self.write, self.path, self.fds, self.futures, self.failure = write, path, [], [], None


class _PythonEngine:
    """``megazero.ops._aio.Engine``'s interface on a ``ThreadPoolExecutor``."""

    def __init__(self, num_threads: int, block_size: int, direct: bool):
        self._threads, self._block, self._direct = num_threads, block_size, direct
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=THREAD_NAME,
                                        initializer=_name_os_thread)
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self._next = 1
        self._closed = False
        self._counters = dict.fromkeys(("bytes_read", "bytes_written", "direct_bytes",
                                        "buffered_bytes", "requests"), 0)
        self._refused: dict[str, str] = {}

    def _refuse(self, path: str, reason: str) -> None:
        with self._lock:
            if len(self._refused) < 256 or path in self._refused:
                self._refused[path] = reason

    def _open(self, req: _Request, flags: int, what: str, at: int) -> int | None:
        try:
            fd = os.open(req.path, flags, 0o644)
        except OSError as exc:
            if flags & getattr(os, "O_DIRECT", 0) and exc.errno == errno.EINVAL:
                self._refuse(req.path, "open with O_DIRECT: EINVAL (not supported by the "
                             "filesystem)")
            else:
                req.failure = (exc.errno, at, what)
            return None
        req.fds.append(fd)
        return fd

    def submit(self, write: bool, address: int, nbytes: int, path: str, offset: int) -> int:
        if nbytes < 0 or offset < 0:
            raise ValueError("aio: negative size or offset")
        if self._closed:
            raise RuntimeError("aio: submit after close()")
        req = _Request(write, path)
        flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_CLOEXEC
        body, fd_direct, fd_buffered = 0, None, None
        if self._direct and hasattr(os, "O_DIRECT") and nbytes >= ALIGN \
                and offset % ALIGN == 0 and address % ALIGN == 0:
            fd_direct = self._open(req, flags | os.O_DIRECT,
                                   "open (O_DIRECT, create)" if write else "open (O_DIRECT)",
                                   offset)
            body = nbytes - nbytes % ALIGN if fd_direct is not None else 0
        if req.failure is None and (body < nbytes or not nbytes):  # empty: create / check
            fd_buffered = self._open(req, flags, "open (create)" if write else "open",
                                     offset + body)
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B") \
            if nbytes else memoryview(b"")
        with self._lock:
            if self._closed:
                raise RuntimeError("aio: submit after close()")
            handle, self._next = self._next, self._next + 1
            self._counters["requests"] += 1
            self._requests[handle] = req
        at = 0
        while req.failure is None and at < nbytes:
            direct = at < body
            end = min(at + self._block, body if direct else nbytes)
            req.futures.append(self._pool.submit(
                self._run, req, fd_direct if direct else fd_buffered, view[at:end],
                offset + at, direct))
            at = end
        return handle

    def _count(self, write: bool, direct: bool, moved: int) -> None:
        with self._lock:
            self._counters["bytes_written" if write else "bytes_read"] += moved
            self._counters["direct_bytes" if direct else "buffered_bytes"] += moved

    def _run(self, req: _Request, fd: int, view: memoryview, offset: int, direct: bool):
        moved, failure, refused = _transfer(req.write, fd, view, offset, direct)
        self._count(req.write, direct, moved)
        if direct and failure is None and moved < len(view):
            if refused:
                self._refuse(req.path, f"{_call(req.write, True)}: EINVAL")
            flags = (os.O_WRONLY | os.O_CREAT if req.write else os.O_RDONLY) | os.O_CLOEXEC
            try:
                bfd = os.open(req.path, flags, 0o644)
            except OSError as exc:
                return (exc.errno, offset + moved, "open (buffered, after O_DIRECT stopped)")
            try:
                more, failure, _ = _transfer(req.write, bfd, view[moved:], offset + moved, False)
            finally:
                os.close(bfd)
            self._count(req.write, False, more)
        return failure

    def _finish(self, req: _Request):
        failure = req.failure
        for future in req.futures:
            result = future.result()
            if result is not None and (failure is None or result[1] < failure[1]):
                failure = result
        for fd in req.fds:
            try:
                os.close(fd)
            except OSError as exc:
                if req.write and failure is None:
                    failure = (exc.errno, 0, "close after writing")
        req.fds = []
        return failure

    def wait(self, handle: int):
        with self._lock:
            req = self._requests.pop(handle, None)
        if req is None:
            raise IndexError(f"aio: unknown or already waited handle {handle}")
        return self._finish(req)

    def wait_all(self) -> list:
        with self._lock:
            requests, self._requests = self._requests, {}
        failed = [(h, self._finish(req)) for h, req in sorted(requests.items())]
        return [(h, f) for h, f in failed if f is not None]

    def close(self) -> None:
        self.wait_all()
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def closed(self) -> bool:
        return self._closed

    def num_threads(self) -> int:
        return 0 if self._closed else self._threads

    def counters(self) -> dict:
        with self._lock:
            return dict(self._counters)

    def direct_refused(self) -> dict:
        with self._lock:
            return dict(self._refused)


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
        requests."""
        return self._impl.counters()

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
                or not tensor.is_contiguous() or not holds_data(tensor):
            raise ValueError("AsyncIO: the tensor must be a contiguous CPU tensor holding data")
        offset = operator.index(offset)
        if offset < 0:
            raise ValueError(f"AsyncIO: negative file offset {offset}")
        path = os.fspath(path)
        nbytes = tensor.numel() * tensor.element_size()
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
        failure = self._impl.wait(handle)
        with self._lock:
            self._inflight.pop(handle, None)
        if failure is not None:
            raise _os_error(record, failure)

    def wait_all(self) -> None:
        """Block until every request is complete; OSError for the first (lowest handle) that
        failed, counting the others."""
        failed = self._impl.wait_all()
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
