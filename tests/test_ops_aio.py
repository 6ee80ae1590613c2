"""The NVMe offload I/O engine (megazero.ops.aio): the C++ engine (megazero.ops._aio) and the
Python fallback, each writing and reading back random bytes exactly, and both writing the
same files.

Sizes 0, 1, 4095, 4096, 1 MiB + 3 and 3 MiB + 5 bytes at offsets 0, ALIGN multiples and an
unaligned offset (the buffered path), from aligned and unaligned addresses, with many
requests in flight on small blocks; errors (read past end of file, missing directory) name
the file; close() leaves no "megazero-aio" thread behind; a filesystem refusing O_DIRECT
(simulated with an LD_PRELOAD shim, at open and at transfer) falls back to buffered I/O.
"""

import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megazero.ops import aio, registry

BUILT = aio.extension() is not None
BACKENDS = [pytest.param("cpp", marks=pytest.mark.skipif(
    not BUILT, reason="megazero.ops._aio is not built")), "python"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
SIZES = [0, 1, 4095, 4096, MIB + 3, 3 * MIB + 5]
OFFSETS = [0, 3 * aio.ALIGN, 12345]


def random_bytes(gen, nbytes: int, aligned: bool = True) -> torch.Tensor:
    """uint8 [nbytes] of random bytes, at an ALIGN-aligned address or one byte past one."""
    if aligned:
        t = aio.aligned_empty(nbytes, torch.uint8)
    else:
        t = aio.aligned_empty(nbytes + 1, torch.uint8)[1:]
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return t


def file_bytes(path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def aio_threads() -> int:
    """Threads of this process named like the engines' workers."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                count += f.read().strip() == aio.THREAD_NAME
        except OSError:
            pass  # the thread ended meanwhile
    return count


def aio_threads_settle(expected: int, timeout: float = 5.0) -> int:
    """aio_threads() once it equals ``expected`` (or at the timeout): a joined thread's
    /proc entry can outlive join() by a moment (Python's join returns before the OS thread
    is reaped)."""
    deadline = time.monotonic() + timeout
    while (count := aio_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 1025, 100_003])
def test_aligned_empty(numel, dtype):
    t = aio.aligned_empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % aio.ALIGN == 0
    nbytes = numel * t.element_size()
    room = t.untyped_storage().nbytes() - (t.data_ptr() - t.untyped_storage().data_ptr())
    assert room >= -(-nbytes // aio.ALIGN) * aio.ALIGN


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_many_in_flight(backend, gen, tmp_path):
    cases = [(size, offset, aligned) for size in SIZES for offset in OFFSETS
             for aligned in (True, False)]
    data = [random_bytes(gen, size, aligned) for size, _, aligned in cases]
    paths = [tmp_path / f"{i}.bin" for i in range(len(cases))]
    with aio.AsyncIO(num_threads=3, block_size=64 * 1024, backend=backend) as io:
        handles = [io.submit_write(t, p, off) for t, p, (_, off, _) in zip(data, paths, cases)]
        assert io.pending == len(cases)
        io.wait_all()
        back = [torch.full((size,), 7, dtype=torch.uint8) if not aligned else
                aio.aligned_empty(size, torch.uint8).fill_(7) for size, _, aligned in cases]
        handles = [io.submit_read(t, p, off) for t, p, (_, off, _) in zip(back, paths, cases)]
        for h in reversed(handles):
            io.wait(h)
        total = sum(size for size, _, _ in cases)
        assert io.bytes_written == total and io.bytes_read == total
        counters = io.counters()
        assert counters["direct_bytes"] + counters["buffered_bytes"] == 2 * total
        if aio.probe_direct_io(str(tmp_path))[0]:
            assert counters["direct_bytes"] > 0 and not io.direct_refused
    for (size, offset, _), t, b, p in zip(cases, data, back, paths):
        assert os.path.getsize(p) == (offset + size if size else 0), (size, offset)
        assert file_bytes(p, offset, size) == t.numpy().tobytes(), (size, offset)
        if size:
            assert file_bytes(p, 0, offset) == bytes(offset)  # the hole before reads as zeros
        assert torch.equal(b, t), (size, offset)


@pytest.mark.parametrize("backend", BACKENDS)
def test_typed_tensors_and_regions_of_one_file(backend, gen, tmp_path):
    """fp32/bf16 tensors side by side in one file (the optimizer-state layout), read back in
    another order and in pieces."""
    path = tmp_path / "states.bin"
    tensors = [torch.randn(n, generator=gen).to(dt) for n, dt in
               [(300_001, torch.float32), (77, torch.bfloat16), (2 * 1024, torch.float32)]]
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // aio.ALIGN) * aio.ALIGN
    with aio.AsyncIO(num_threads=2, block_size=aio.ALIGN * 8, backend=backend) as io:
        for t, off in zip(tensors, offsets):
            io.submit_write(t, str(path), off)
        io.wait_all()
        for t, off in reversed(list(zip(tensors, offsets))):
            out = torch.empty_like(t)
            io.wait(io.submit_read(out, path, off))
            assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
        half = torch.empty(1000)  # a slice in the middle of the first tensor
        io.wait(io.submit_read(half, path, offsets[0] + 4 * 5000))
        assert torch.equal(half, tensors[0][5000:6000])


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_never_truncate(backend, gen, tmp_path):
    path = tmp_path / "f.bin"
    big, small = random_bytes(gen, 3 * aio.ALIGN + 11), random_bytes(gen, 100)
    with aio.AsyncIO(backend=backend) as io:
        io.wait(io.submit_write(big, path))
        io.wait(io.submit_write(small, path, 5))
    expected = bytearray(big.numpy().tobytes())
    expected[5:105] = small.numpy().tobytes()
    assert path.read_bytes() == bytes(expected)


@pytest.mark.skipif(not BUILT, reason="megazero.ops._aio is not built")
@pytest.mark.parametrize("direct", [True, False])
def test_engines_write_identical_files(gen, tmp_path, direct):
    """Disjoint regions of one file, all in flight at once, at aligned and unaligned offsets
    and addresses: the two engines leave the same bytes, and each reads the other's file."""
    cases, at = [], 0
    for size in (1, 4095, MIB + 3, 2 * MIB):
        for off in (0, 8192, 999):
            cases.append((size, at + off))
            at += -(-(off + size) // aio.ALIGN) * aio.ALIGN
    data = [random_bytes(gen, size, aligned=i % 2 == 0) for i, (size, _) in enumerate(cases)]
    for backend in ("cpp", "python"):
        with aio.AsyncIO(num_threads=4, block_size=aio.ALIGN * 16, direct=direct,
                         backend=backend) as io:
            for t, (_, off) in zip(data, cases):
                io.submit_write(t, tmp_path / f"{backend}.bin", off)
    assert (tmp_path / "cpp.bin").read_bytes() == (tmp_path / "python.bin").read_bytes()
    for reader, writer in (("cpp", "python"), ("python", "cpp")):
        with aio.AsyncIO(backend=reader, direct=direct) as io:
            back = [aio.aligned_empty(size, torch.uint8) for size, _ in cases]
            for t, (_, off) in zip(back, cases):
                io.submit_read(t, tmp_path / f"{writer}.bin", off)
            io.wait_all()
        assert all(torch.equal(b, t) for b, t in zip(back, data)), (reader, writer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_end_of_file_names_the_file(backend, gen, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(5000))
    with aio.AsyncIO(backend=backend) as io:
        for nbytes, offset in ((8192, 0), (100, 4950), (10, 6000), (4096, 4096)):
            handle = io.submit_read(aio.aligned_empty(nbytes, torch.uint8), path, offset)
            with pytest.raises(OSError, match="end of file") as info:
                io.wait(handle)
            assert info.value.errno == errno.EIO and info.value.filename == str(path)
            assert str(path) in str(info.value) and "read" in str(info.value)
            assert f"at offset {offset}" in str(info.value)
        io.wait(io.submit_read(torch.empty(0), path, 10_000))  # nothing to read: no error


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_directory_names_the_path(backend, tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "state.bin"
    with aio.AsyncIO(backend=backend) as io:
        for submit in (io.submit_write, io.submit_read):
            handle = submit(aio.aligned_empty(2 * aio.ALIGN), missing, aio.ALIGN)
            with pytest.raises(OSError) as info:
                io.wait(handle)
            assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
            assert str(missing) in str(info.value)
        # wait_all raises the first failure and counts the others; all handles are consumed
        for _ in range(3):
            io.submit_write(torch.ones(3), missing)
        io.submit_write(torch.ones(3), tmp_path / "fine.bin")
        with pytest.raises(OSError, match="2 more request"):
            io.wait_all()
        assert io.pending == 0
    assert (tmp_path / "fine.bin").stat().st_size == 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_joins_the_threads(backend, gen, tmp_path):
    before = aio_threads()
    io = aio.AsyncIO(num_threads=3, block_size=aio.ALIGN, backend=backend)
    data = random_bytes(gen, 64 * aio.ALIGN)
    for i in range(8):
        io.submit_write(data, tmp_path / f"{i}.bin")
    io.wait_all()  # the Python pool starts (and names) its threads as work arrives
    assert aio_threads() > before
    io.close()
    assert aio_threads_settle(before) == before
    io.close()  # idempotent
    with pytest.raises(RuntimeError, match="close"):
        io.submit_write(data, tmp_path / "late.bin")
    with aio.AsyncIO(num_threads=2, backend=backend) as io:
        io.wait(io.submit_write(data, tmp_path / "x.bin"))
    assert aio_threads_settle(before) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend, tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        aio.AsyncIO(block_size=1000, backend=backend)
    with pytest.raises(ValueError, match="num_threads"):
        aio.AsyncIO(num_threads=0, backend=backend)
    with aio.AsyncIO(backend=backend) as io:
        with pytest.raises(ValueError, match="contiguous"):
            io.submit_write(torch.ones(10, 10).t(), tmp_path / "f")
        with pytest.raises(ValueError, match="negative"):
            io.submit_write(torch.ones(1), tmp_path / "f", -1)
        handle = io.submit_write(torch.ones(1), tmp_path / "f")
        io.wait(handle)
        with pytest.raises(ValueError, match="already waited"):
            io.wait(handle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffered_when_direct_is_off(backend, gen, tmp_path):
    data = random_bytes(gen, 2 * MIB)
    with aio.AsyncIO(direct=False, backend=backend) as io:
        io.wait(io.submit_write(data, tmp_path / "f.bin"))
        assert io.counters()["direct_bytes"] == 0
    assert (tmp_path / "f.bin").read_bytes() == data.numpy().tobytes()


def test_fallback_when_disabled(ops_disabled, tmp_path):
    with ops_disabled("aio"):
        assert aio.extension() is None
        with aio.AsyncIO() as io:
            assert io.engine.startswith(aio.PY_ENGINE) and "MEGAZERO_DISABLE_OPS" in io.engine
            io.wait(io.submit_write(torch.arange(10.0), tmp_path / "f.bin"))
        status = aio.engine_status(str(tmp_path))
        assert not status["built"] and "MEGAZERO_DISABLE_OPS" in status["reason"]
        with pytest.raises(RuntimeError, match="not available"):
            aio.AsyncIO(backend="cpp")
    if BUILT:
        assert aio.AsyncIO(direct=True).engine == aio.CPP_ENGINE


def test_engine_status_and_report(tmp_path):
    status = aio.engine_status(str(tmp_path))
    assert status["built"] == BUILT and status["probe_dir"] == str(tmp_path)
    assert isinstance(status["direct_io"], bool) and status["direct_io_reason"]
    assert not [p for p in os.listdir(tmp_path) if "probe" in p]  # the probe cleans up
    registry.import_op_modules()
    spec = {s.name: s for s in registry.registered_ops()}["aio"]
    op = registry.op_status(spec)
    assert op["extension"] == "_aio" and op["built"] == BUILT and (op["built"] or op["reason"])
    if op["built"]:
        assert op["simd"] in ("O_DIRECT ok", "no O_DIRECT")


# A filesystem refusing O_DIRECT, simulated: open(O_DIRECT) -> EINVAL (mode "open") or
# reads/writes on an O_DIRECT descriptor -> EINVAL (mode "io"). Both the libc names the C++
# engine calls and the 64-bit ones CPython's os module calls.
SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
static int mode(const char* m) { const char* v = getenv("MZ_SHIM"); return v && !strcmp(v, m); }
static int refuse(int fd) { return mode("io") && (fcntl(fd, F_GETFL) & O_DIRECT); }
#define OPEN(name)                                                                 \
  int name(const char* path, int flags, ...) {                                     \
    va_list ap; va_start(ap, flags); int m = va_arg(ap, int); va_end(ap);           \
    if ((flags & O_DIRECT) && mode("open")) { errno = EINVAL; return -1; }          \
    return ((int (*)(const char*, int, ...))dlsym(RTLD_NEXT, #name))(path, flags, m); \
  }
#define IO(name, buf_t)                                                             \
  ssize_t name(int fd, buf_t b, size_t n, off_t o) {                                \
    if (refuse(fd)) { errno = EINVAL; return -1; }                                  \
    return ((ssize_t (*)(int, buf_t, size_t, off_t))dlsym(RTLD_NEXT, #name))(fd, b, n, o); \
  }
OPEN(open) OPEN(open64)
IO(pread, void*) IO(pread64, void*) IO(pwrite, const void*) IO(pwrite64, const void*)
ssize_t preadv64v2(int fd, const struct iovec* v, int c, off_t o, int f) {
  if (refuse(fd)) { errno = EINVAL; return -1; }
  return ((ssize_t (*)(int, const struct iovec*, int, off_t, int))dlsym(
      RTLD_NEXT, "preadv64v2"))(fd, v, c, o, f);
}
ssize_t preadv2(int fd, const struct iovec* v, int c, off_t o, int f) {
  return preadv64v2(fd, v, c, o, f);
}
"""

CHILD = """
import sys, torch
from megazero.ops import aio
for backend in sys.argv[2:]:
    with aio.AsyncIO(num_threads=2, block_size=2 * aio.ALIGN, backend=backend) as io:
        data = torch.randint(0, 256, (5 * aio.ALIGN + 17,), dtype=torch.uint8)
        src = aio.aligned_empty(data.numel(), torch.uint8).copy_(data)
        io.wait(io.submit_write(src, sys.argv[1] + backend, aio.ALIGN))
        out = aio.aligned_empty(data.numel(), torch.uint8)
        io.wait(io.submit_read(out, sys.argv[1] + backend, aio.ALIGN))
        c = io.counters()
        assert torch.equal(out, data), backend
        assert c["direct_bytes"] == 0 and c["buffered_bytes"] == 2 * data.numel(), (backend, c)
        assert str(sys.argv[1] + backend) in io.direct_refused, backend
        print(backend, "ok", sorted(set(io.direct_refused.values())))
"""


@pytest.mark.parametrize("mode", ["open", "io"])
def test_o_direct_refused_falls_back_to_buffered(mode, tmp_path):
    cc = next((c for c in ("cc", "gcc", "clang") if any(
        os.access(os.path.join(d, c), os.X_OK) for d in os.environ.get("PATH", "").split(":"))),
        None)
    if cc is None:
        pytest.skip("no C compiler for the LD_PRELOAD shim")
    (tmp_path / "shim.c").write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "shim.so"),
                    str(tmp_path / "shim.c"), "-ldl"], check=True, capture_output=True)
    backends = ["cpp", "python"] if BUILT else ["python"]
    env = {**os.environ, "LD_PRELOAD": str(tmp_path / "shim.so"), "MZ_SHIM": mode,
           "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "f-"),
                          *backends], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(" ok ") == len(backends), out.stdout
