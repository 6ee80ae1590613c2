"""The Python engine of ``megazero.ops.aio``: the C++ engine's methods and semantics (requests
split into blocks on a thread pool, O_DIRECT where aligned, buffered fallback, errors kept per
request until waited for) over ``os.pwrite`` / ``os.preadv``. Used when the ``aio`` extension
is not built or is disabled; ``aio.AsyncIO`` picks it."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096  # bytes: buffer address, file offset and length alignment for O_DIRECT
THREAD_NAME = "megazero-aio"


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


