"""Ready ``--save`` once before training, on global rank 0 (a problem is the same error on
every rank): writable (a probe file, before any training work), locked against a second
writer (``.megazero.lock``: host, pid, process start time, command; a live holder is refused
naming its host and pid, a dead holder on this host taken over with a warning), swept of dead
writers' temporary files, and checked against a ``--load`` that holds no checkpoint while
``--save`` holds a later one (a typo that would move the tracker back). ``prepare_save_dir``
returns a ``SaveDirGuard`` whose ``release()`` (idempotent, also at exit) drops the lock.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import time

from megazero.checkpoint.paths import (
    LOCK_FILE,
    CheckpointError,
    atomic_write_text,
    pid_alive,
    read_tracker,
    remove_stale_temps,
    tracker_path,
)
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot; Linux), to tell a live
    writer from another process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> str | None:
    """This process's pid namespace (containers on one host name have their own pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _lock_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _proc_start(
        os.getpid()), "pid_namespace": _pid_namespace(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500],
        "token": os.urandom(8).hex()}


def _read_lock(path: str) -> dict | None:
    """The record in a lock file (None when unreadable, or gone)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 16).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None


def _holder_state(holder: dict) -> str:
    """"self", "alive", "dead" or "unknown" (another host or container) for a lock record."""
    if holder.get("host") != socket.gethostname() or \
            holder.get("pid_namespace", _pid_namespace()) != _pid_namespace():
        return "unknown"
    pid = holder["pid"]
    if pid == os.getpid():
        return "self"
    if not pid_alive(pid):
        return "dead"
    start = holder.get("pid_start")
    return "dead" if start is not None and _proc_start(pid) not in (None, start) else "alive"


class SaveDirLock:
    """``<save>/.megazero.lock``: held by the one process (global rank 0) that writes a save
    folder; its record names the host, pid, start time and command. ``release`` removes it
    if it is still ours (idempotent; registered with ``atexit``)."""

    def __init__(self, root: str, record: dict):
        self.root, self.path, self.record = root, os.path.join(root, LOCK_FILE), record
        self.held = True
        atexit.register(self.release)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        atexit.unregister(self.release)
        current = _read_lock(self.path)
        if current is not None and all(current.get(k) == self.record[k]
                                       for k in ("host", "pid", "token")):
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def _create_exclusive(src: str, path: str) -> bool:
    """Create ``path`` with the contents of ``src`` unless it exists (False then): a hard link,
    atomic and never half-written; exclusive creation where links are not supported."""
    try:
        os.link(src, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this file system
        pass
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f, open(src, "rb") as g:
        f.write(g.read())
        f.flush()
        os.fsync(f.fileno())
    return True


def acquire_save_lock(root: str) -> SaveDirLock:
    """Take the lock of save folder ``root`` (which must exist). A lock held by a live
    process, or by one on another host (whose liveness cannot be checked here), is a
    ``CheckpointError`` naming its host and pid and whether it is alive; the lock of a dead
    process on this host is taken over with a warning; our own process's lock is taken
    again."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_FILE)
    record = _lock_record()
    tmp = f"{path}.tmp.{os.getpid()}"
    atomic_write_text(tmp, json.dumps(record, indent=1) + "\n")
    try:
        for _ in range(5):
            if _create_exclusive(tmp, path):
                return SaveDirLock(root, record)
            holder = _read_lock(path)
            if holder is None:
                if not os.path.exists(path):
                    continue  # released meanwhile
                raise CheckpointError(
                    f"--save {root} has a lock file {path} that holds no readable record; "
                    "if no run writes to this folder, remove it")
            state = _holder_state(holder)
            who = (f"pid {holder['pid']} on host {holder.get('host')!r} (started "
                   f"{holder.get('started')}, command {holder.get('command', '?')!r})")
            if state == "self":
                os.replace(tmp, path)
                return SaveDirLock(root, record)
            if state != "dead":
                alive = "alive" if state == "alive" else \
                    "on another host (or container), so whether it is alive is unknown here"
                raise CheckpointError(
                    f"--save {root} is in use: {path} is held by {who}, which is {alive}. "
                    "Two runs writing one --save folder would interleave their checkpoints; "
                    "stop that run or choose another --save (remove the lock file only if "
                    "that process is gone)")
            stale = f"{path}.stale.{os.getpid()}"
            try:
                os.replace(path, stale)
            except FileNotFoundError:
                continue
            taken = _read_lock(stale)
            os.remove(stale)
            if taken != holder:  # another run took it meanwhile: give it back, look again
                if taken is not None:
                    atomic_write_text(path, json.dumps(taken, indent=1) + "\n")
                continue
            logger.warning("took over the lock %s of %s, which is no longer running", path, who)
        raise CheckpointError(f"could not take the lock {path}: other runs keep taking it")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_writable(root: str) -> None:
    """Create save folder ``root`` and write, sync and remove a probe file in it; a
    ``CheckpointError`` naming the path and the reason otherwise."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--save {root} is a file, not a folder")
    probe = os.path.join(root, f".megazero-write-probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"megazero\n")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"--save {root} is not writable ({type(exc).__name__}: "
                              f"{exc.strerror or exc}); checkpoints could not be saved") \
            from None


def check_load_against_save(load: str | None, save: str) -> None:
    """A ``--load`` holding no checkpoint (missing, or without a tracker) next to a ``--save``
    whose tracker holds a later iteration is an error: training would start from scratch and
    its first save would move that tracker back. ``--load`` equal to ``--save`` (Megatron's
    idiom, also on a first run) is fine; an older ``--load`` checkpoint is a warning."""
    if not load:
        return
    if os.path.realpath(load) == os.path.realpath(save):
        return
    load_it = read_tracker(load)
    save_it = read_tracker(save, check_folder=False)
    if not isinstance(save_it, int) or save_it <= 0:
        return
    if load_it is None:
        what = "does not exist" if not os.path.exists(load) else \
            f"holds no checkpoint (no {os.path.basename(tracker_path(load))})"
        raise CheckpointError(
            f"--load {load} {what}, but --save {save} holds a checkpoint at iteration "
            f"{save_it} ({tracker_path(save)}): training would start from scratch and its "
            f"first save would move that tracker back. To resume, pass --load {save}; to "
            "start afresh, choose a new --save folder")
    if isinstance(load_it, int) and load_it < save_it:
        logger.warning("--load %s is at iteration %d but --save %s holds iteration %d: saves "
                       "of this run will move its tracker back", load, load_it, save, save_it)


class SaveDirGuard:
    """What ``prepare_save_dir`` holds for the run: the lock (on global rank 0). ``release``
    is idempotent and also runs at exit."""

    def __init__(self, root: str | None, lock: SaveDirLock | None = None):
        self.root, self.lock = root, lock

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> SaveDirGuard:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def prepare_save_dir(config, ps: ParallelState) -> SaveDirGuard:
    """Make ``--save`` ready before any training, on global rank 0: create it and check it is
    writable, take its lock (one writer per folder), remove the temporary files of dead
    writers, and refuse a ``--load`` that holds no checkpoint next to a ``--save`` holding a
    later one (``check_load_against_save``). A problem is a ``CheckpointError`` on every rank.
    Call once before training, and ``release()`` the returned guard at the end."""
    root = config.train.save
    if not root:
        return SaveDirGuard(None)
    error, lock = None, None
    if ps.rank == 0:
        try:
            check_writable(root)
            lock = acquire_save_lock(root)
            for path in remove_stale_temps(root):
                logger.warning("removed %s, left by a writer that is no longer running", path)
            check_load_against_save(config.train.load, root)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not hang
            error = str(exc) if isinstance(exc, CheckpointError) else \
                f"--save {root}: {type(exc).__name__}: {exc}"
            if lock is not None:
                lock.release()
    errors = comm.all_gather_object(error, ps.world_group)
    if errors[0] is not None:
        raise CheckpointError(errors[0] if ps.rank == 0 else f"(on rank 0) {errors[0]}")
    return SaveDirGuard(root, lock)
