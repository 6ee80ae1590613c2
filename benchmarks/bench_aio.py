"""NVMe offload I/O engine (``megazero.ops.aio.AsyncIO``, issue 18) against the raw disk.

What is measured, in one run, on one file in ``--dir`` (default: a temp dir under
``benchmarks/out/``, on the repository's disk), overwritten in place after a first write
that allocates it (the steady state of an optimizer swapping its states out and in):

* raw sequential bandwidth, three ways, all O_DIRECT with 4 MiB blocks over the whole file:
  ``dd`` (``oflag=direct`` writes, ``iflag=direct`` reads into /dev/null) as one stream
  (queue depth 1) and as ``--raw-streams`` dd processes at once on disjoint ranges, and a
  plain loop of ``os.pwrite`` / ``os.preadv`` on an O_DIRECT descriptor from this process's
  aligned buffer (one thread, no engine). "raw" is the best of the three per direction, so the
  ratios are the strictest. The page cache is not dropped (that needs root and would disturb
  other work on the machine); O_DIRECT bypasses it instead. dd writes random bytes copied
  from a file in /dev/shm when it has room (a virtual disk may treat zeros specially), else
  /dev/zero (said in the output).
* AsyncIO write and read throughput of one buffer (``aligned_empty``, random bytes) per
  request, ``direct=True``: the grid of engines (C++, Python fallback) x threads x block
  sizes at ``--grid-size``, then the buffer sizes of ``--sizes`` at 4 threads, 1 MiB blocks.
  One buffered row (``direct=False``) shows what the page cache does to such numbers.

Each figure is the median of ``--reps`` timed runs (the raw runs split before and after the
AsyncIO runs, to see drift). Writes are timed to completion of the pwrite calls (no fsync,
as dd without ``conv=fsync``). The ratios are to raw of the same direction (issue 18's
target: >= 70% of raw). Files are
removed at the end. On a machine shared with other work the numbers move: the load average
is printed.

    python benchmarks/bench_aio.py [--dir DIR] [--sizes 64,1024] [--grid-size 256]
        [--threads 1,2,4] [--blocks 256,1024,4096] [--engines cpp,python] [--reps 5]
        [--raw-streams 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.ops import aio  # noqa: E402

MIB = 1 << 20
RAW_BS = 4 * MIB
VIRTIO_VENDORS = {"0x1af4": "virtio-blk virtual disk (Red Hat/QEMU)"}


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def mount_of(path: str) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) holding ``path``."""
    path, best = os.path.realpath(path), ("?", "/", "?")
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    return best


def describe_disk(path: str) -> str:
    dev, mnt, fstype = mount_of(path)
    if fstype in ("tmpfs", "ramfs"):
        return (f"{fstype} at {mnt}: memory, NOT a disk -- these numbers say nothing about "
                "NVMe; pass --dir on a disk")
    name = os.path.basename(dev)
    block = f"/sys/class/block/{name}"
    parent = os.path.basename(os.path.dirname(os.path.realpath(block))) \
        if os.path.exists(os.path.join(block, "partition")) else name

    def read(rel: str) -> str:
        try:
            with open(f"/sys/block/{parent}/{rel}", encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    kind = "NVMe" if parent.startswith("nvme") else \
        VIRTIO_VENDORS.get(read("device/vendor"), read("device/model") or "unknown model")
    rotational = {"0": "non-rotational", "1": "reported rotational"}.get(
        read("queue/rotational"), "")
    return (f"{dev} ({kind}, {rotational}, scheduler {read('queue/scheduler') or '?'}), "
            f"{fstype} at {mnt}")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def dd(args: list[str]) -> None:
    subprocess.run(["dd", "status=none", *args], check=True)


def raw_run(path: str, nbytes: int, streams: int, write: bool, source: str) -> float:
    """Seconds for ``streams`` dd processes moving [k*part, (k+1)*part) each, O_DIRECT."""
    blocks = nbytes // RAW_BS
    per = blocks // streams
    procs = []
    start = time.perf_counter()
    for k in range(streams):
        if write:
            args = [f"if={source}", f"of={path}", f"bs={RAW_BS}", f"count={per}",
                    f"seek={k * per}", f"skip={k * per if source != '/dev/zero' else 0}",
                    "oflag=direct", "conv=notrunc"]
        else:
            args = [f"if={path}", "of=/dev/null", f"bs={RAW_BS}", f"count={per}",
                    f"skip={k * per}", "iflag=direct"]
        procs.append(subprocess.Popen(["dd", "status=none", *args]))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"dd failed ({p.args})")
    return time.perf_counter() - start


def loop_run(path: str, buf: torch.Tensor, write: bool) -> float:
    """Seconds for one thread moving ``buf`` with O_DIRECT pwrite/preadv calls of RAW_BS."""
    fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
    view = memoryview(buf.numpy())
    try:
        start = time.perf_counter()
        for at in range(0, len(view), RAW_BS):
            piece = view[at:at + RAW_BS]
            moved = os.pwrite(fd, piece, at) if write else os.preadv(fd, [piece], at)
            if moved != len(piece):
                raise OSError(f"short {'write' if write else 'read'} at {at}")
        return time.perf_counter() - start
    finally:
        os.close(fd)


def asyncio_run(io: aio.AsyncIO, buf: torch.Tensor, path: str, write: bool) -> float:
    submit = io.submit_write if write else io.submit_read
    return timed(lambda: io.wait(submit(buf, path)))


def median_rate(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--sizes", type=ints, default=[64, 1024], help="buffer MiB")
    parser.add_argument("--grid-size", type=int, default=256, help="buffer MiB of the grid")
    parser.add_argument("--threads", type=ints, default=[1, 2, 4])
    parser.add_argument("--blocks", type=ints, default=[256, 1024, 4096], help="KiB")
    parser.add_argument("--engines", default="cpp,python")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--raw-streams", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    engines = [e for e in args.engines.split(",") if e]
    if "cpp" in engines and aio.extension() is None:
        print("megazero.ops._aio is not built: the C++ rows are skipped")
        engines.remove("cpp")
    base = args.dir or os.path.join(ROOT, "benchmarks", "out")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_aio_", dir=base)
    file_bytes = max([*args.sizes, args.grid_size]) * MIB
    file_bytes -= file_bytes % (RAW_BS * args.raw_streams)
    path = os.path.join(work, "swap.bin")
    shm_source = None
    started = time.perf_counter()
    print(f"megazero bench_aio  {datetime.datetime.now():%Y-%m-%d %H:%M}  "
          f"{platform.node()}  {os.cpu_count()} cpus  load {os.getloadavg()[0]:.1f}")
    print(f"dir: {work}\ndisk: {describe_disk(work)}")
    status = aio.engine_status(work)
    print(f"O_DIRECT on the dir: {status['direct_io_reason']}")
    try:
        buf = aio.aligned_empty(file_bytes, torch.uint8)
        chunk = torch.randint(0, 256, (16 * MIB,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(0))
        for at in range(0, file_bytes, chunk.numel()):
            buf[at:at + chunk.numel()].copy_(chunk[:file_bytes - at])
        source = "/dev/zero"
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * file_bytes:
            fd, shm_source = tempfile.mkstemp(prefix="bench_aio_src_", dir="/dev/shm")
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(buf.numpy()))
            source = shm_source
        print(f"dd source: {'random bytes from /dev/shm' if shm_source else '/dev/zero'}; "
              f"file {file_bytes // MIB} MiB; reps {args.reps}\n")
        dd([f"if={source}", f"of={path}", f"bs={RAW_BS}", f"count={file_bytes // RAW_BS}",
            "oflag=direct"])  # allocate the file once

        raw: dict[tuple[str, bool], list[float]] = {}
        methods = {"dd, 1 stream": lambda w: raw_run(path, file_bytes, 1, w, source),
                   f"dd, {args.raw_streams} streams":
                       lambda w: raw_run(path, file_bytes, args.raw_streams, w, source),
                   "O_DIRECT loop, 1 thread": lambda w: loop_run(path, buf, w)}

        def raw_pass(reps: int) -> None:
            for name, run in methods.items():
                for write in (True, False):
                    raw.setdefault((name, write), []).extend(run(write) for _ in range(reps))

        raw_pass(max(1, args.reps // 2))
        rows = []

        def measure(engine, threads, block_kib, size_mib, direct=True, note=""):
            nbytes = size_mib * MIB
            view = buf[:nbytes]
            with aio.AsyncIO(num_threads=threads, block_size=block_kib * 1024, direct=direct,
                             backend=engine) as io:
                w = [asyncio_run(io, view, path, True) for _ in range(args.reps)]
                r = [asyncio_run(io, view, path, False) for _ in range(args.reps)]
                direct_bytes = io.counters()["direct_bytes"]
            rows.append({"engine": engine, "threads": threads, "block_kib": block_kib,
                         "size_mib": size_mib, "direct": direct, "note": note,
                         "write_gbs": median_rate(nbytes, w), "read_gbs": median_rate(nbytes, r),
                         "direct_share": direct_bytes / (2 * args.reps * nbytes)})

        for engine in engines:
            for threads in args.threads:
                for block in args.blocks:
                    measure(engine, threads, block, args.grid_size)
            for size in args.sizes:
                if size != args.grid_size:
                    measure(engine, 4, 1024, size)
        if "cpp" in engines:
            measure("cpp", 4, 1024, args.grid_size, direct=False, note="page cache, not disk")
        raw_pass(max(1, args.reps - args.reps // 2))

        # the bytes read back are the bytes written
        check = aio.aligned_empty(min(64 * MIB, file_bytes), torch.uint8)
        with aio.AsyncIO(backend=engines[0] if engines else "python") as io:
            io.wait(io.submit_write(buf[:check.numel()], path))
            io.wait(io.submit_read(check, path))
        assert torch.equal(check, buf[:check.numel()]), "read back differs from what was written"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if shm_source and os.path.exists(shm_source):
            os.unlink(shm_source)

    raw_gbs = {k: median_rate(file_bytes, v) for k, v in raw.items()}
    best = {w: max(v for (_, ww), v in raw_gbs.items() if ww == w) for w in (True, False)}
    reps = len(next(iter(raw.values())))
    print(f"raw, O_DIRECT, 4 MiB blocks, {file_bytes // MIB} MiB (GB/s; median of {reps} runs, "
          "half before and half after the AsyncIO runs):")
    for name in methods:
        for write in (True, False):
            runs = ", ".join(f"{file_bytes / t / 1e9:.2f}" for t in raw[(name, write)])
            print(f"  {name:<26} {'write' if write else 'read '} "
                  f"{raw_gbs[(name, write)]:.2f}   (runs: {runs})")
    print(f"  raw = best: write {best[True]:.2f}, read {best[False]:.2f}\n")
    print("| engine | threads | block | buffer | write GB/s | read GB/s | write / raw "
          "| read / raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        w, r = row["write_gbs"], row["read_gbs"]
        name = {"cpp": "C++", "python": "Python"}[row["engine"]] + \
            ("" if row["direct"] else " buffered")
        block = f"{row['block_kib'] // 1024} MiB" if row["block_kib"] >= 1024 else \
            f"{row['block_kib']} KiB"
        size = f"{row['size_mib'] // 1024} GiB" if row["size_mib"] >= 1024 else \
            f"{row['size_mib']} MiB"
        print(f"| {name} | {row['threads']} | {block} | {size} | {w:.2f} | {r:.2f} | "
              f"{w / best[True]:.0%} | {r / best[False]:.0%} |"
              + (f" {row['note']}" if row["note"] else ""))
        if row["direct"] and row["direct_share"] < 1:
            print(f"  (only {row['direct_share']:.0%} of that row's bytes went through O_DIRECT)")
    print(f"\nwall time {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"raw": {f"{m}: {'write' if w else 'read'}": v for (m, w), v in
                               raw_gbs.items()}, "rows": rows, "disk": describe_disk(base)},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
