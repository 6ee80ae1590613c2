"""Where a checkpoint's files are, and how each is written, checked and read (no process group).

Megatron's layout::

    <save>/latest_checkpointed_iteration.txt              the bare iteration (or "release")
    <save>/.megazero.lock                                  the running writer (``save.py``)
    <save>/iter_0000100/layout.json                        the layout and model shape
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt      tp rank 0 (pp = 1)
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt.crc  its checksum and coordinates
    <save>/iter_0000100/mp_rank_01_002/model_optim_rng.pt  tp rank 1, pp rank 2 (pp > 1)
    <save>/iter_0000100/mp_rank_01_002/zero_dp_rank_003_optim_states.pt   ZeRO >= 1 shards

Every file is written to a temporary name (``<file>.tmp.<pid>``), synced and renamed
(``atomic_save``, ``atomic_write_text``) and read with ``torch.load(weights_only=True)``
(``load_file``, memory-mapped on request), with errors that name the file.

Integrity (format 2): every checkpoint file records its coordinates (``file_coords``: kind,
iteration, tp/pp rank and size, and dp rank and size for a ZeRO shard) under ``"coords"``, and
a JSON sidecar ``<file>.crc`` records the CRC-32 and size of the file's bytes (computed while
they are written) and the same coordinates. ``verify_file`` checks a file against its sidecar
before anything is unpickled; ``check_coords`` checks a file's recorded coordinates against
the place it was read from. The tracker and ``layout.json`` are parsed defensively
(``read_tracker``, ``read_layout_file``), and temporary files of writers that died are removed
(``remove_stale_temps``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import zipfile
import zlib

import torch

from megazero.distributed.device import fake_to_meta

TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT_FILE = "layout.json"
MODEL_FILE = "model_optim_rng.pt"
LOCK_FILE = ".megazero.lock"
CHECKSUM_SUFFIX = ".crc"
CHECKPOINT_VERSION = 3.0  # Megatron's checkpoint_version (its meaning of the tensors)
FORMAT = 2  # megazero's: 2 = coordinates in every file and a crc32 sidecar beside it
_READ_CHUNK = 16 << 20
_TRACKER_MAX_BYTES = 64
_TMP = re.compile(r"^(?P<base>.+)\.tmp\.(?P<pid>\d+)$")
_ITERATION_DIR = re.compile(r"^(iter_\d+|release)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names file and values."""


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER)


def iteration_dir(root: str, iteration: int | str) -> str:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def mp_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron's folder of one (tp, pp) cell: ``mp_rank_TT`` or ``mp_rank_TT_PPP``."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def cell_dir(root: str, iteration: int | str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(iteration_dir(root, iteration), mp_dir_name(tp_rank, pp_rank, pp_size))


def saved_pp_size(base: str) -> int:
    """1 when ``base`` (an iteration folder) holds ``mp_rank_00``, else more than one."""
    return 1 if os.path.isdir(os.path.join(base, mp_dir_name(0, 0, 1))) else 2


def zero_shard_name(dp_rank: int) -> str:
    return f"zero_dp_rank_{dp_rank:03d}_optim_states.pt"


def checksum_path(path: str) -> str:
    return path + CHECKSUM_SUFFIX


# ---- coordinates ---------------------------------------------------------------------------
COORD_KEYS = ("kind", "iteration", "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank",
              "dp_size")


def file_coords(kind: str, iteration: int | str | None, tp_rank: int, tp_size: int | None,
                pp_rank: int, pp_size: int | None, dp_rank: int | None = None,
                dp_size: int | None = None) -> dict:
    """Where a file belongs: ``kind`` ("model" or "zero_shard"), the iteration and the grid
    coordinates (dp only for a ZeRO shard). ``None`` values are left out (not checked)."""
    values = (kind, iteration, tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size)
    return {k: v for k, v in zip(COORD_KEYS, values) if v is not None}


def check_coords(path: str, found, expected: dict, where: str | None = None) -> bool:
    """Raise ``CheckpointError`` when the coordinates ``found`` in a file (or its sidecar,
    ``where``) differ from those of the place it was read from; False when the file records
    none (written before format 2)."""
    if found is None:
        return False
    if not isinstance(found, dict):
        raise CheckpointError(f"checkpoint file {path}: malformed coordinates {found!r} "
                              f"in {where or path}")
    diffs = [f"{k} {found.get(k)!r} (expected {v!r})" for k, v in expected.items()
             if found.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"checkpoint file {path} belongs elsewhere: {where or 'it'} records "
            + ", ".join(diffs) + "; files were moved, swapped or copied between checkpoints")
    return True


# ---- writing -------------------------------------------------------------------------------
class _CrcWriter:
    """A write-only file object that passes bytes on and keeps their CRC-32 and count."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def atomic_save(obj, path: str, coords: dict | None = None) -> dict | None:
    """torch.save to ``path`` via a temporary file in the same folder and a rename (the dry
    run's fake tensors are written as meta tensors: the structure without data).

    With ``coords`` (``file_coords``), ``obj`` (a dict) records them under ``"coords"`` and a
    sidecar ``<path>.crc`` records the CRC-32 and size of the bytes written and the same
    coordinates; returns that record (None without ``coords``)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if coords is not None:
        obj = {**obj, "coords": dict(coords), "megazero_format": FORMAT}
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            writer = _CrcWriter(f)
            torch.save(fake_to_meta(obj), writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if coords is None:
        return None
    record = {"file": os.path.basename(path), "algorithm": "crc32",
              "crc32": f"{writer.crc:08x}", "size": writer.size, "coords": dict(coords),
              "megazero_format": FORMAT}
    atomic_write_text(checksum_path(path), json.dumps(record, indent=1) + "\n")
    return record


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- checking and reading ------------------------------------------------------------------
def file_crc32(path: str) -> tuple[int, int]:
    """(CRC-32, size) of a file's bytes, read once in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_READ_CHUNK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return crc, size


def _read_small_text(path: str, what: str, limit: int) -> str:
    """The text of a small metadata file, or a ``CheckpointError`` naming it and saying what
    is wrong (a folder, not readable, too large, binary)."""
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file (a broken link?)"
        raise CheckpointError(f"{what} {path} is {kind}")
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(f"{what} {path} cannot be read ({exc})") from exc
    if len(raw) > limit:
        raise CheckpointError(f"{what} {path} is larger than {limit} bytes: not a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{what} {path} holds binary data, not text (byte "
                              f"{raw[exc.start:exc.start + 1]!r} at offset {exc.start})") \
            from None


def _read_small_json(path: str, what: str, limit: int):
    """JSON content of a small metadata file; malformed content names the file."""
    text = _read_small_text(path, what, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON ({exc.msg} at line "
                              f"{exc.lineno} column {exc.colno})") from None


def read_checksum_file(path: str) -> dict | None:
    """The sidecar record of checkpoint file ``path`` (None when there is none)."""
    side = checksum_path(path)
    if not os.path.lexists(side):
        return None
    record = _read_small_json(side, "checksum file", 1 << 16)
    ok = isinstance(record, dict) and record.get("algorithm") == "crc32" \
        and isinstance(record.get("size"), int) and isinstance(record.get("crc32"), str) \
        and re.fullmatch(r"[0-9a-f]{8}", record["crc32"]) is not None
    if not ok:
        raise CheckpointError(f"checksum file {side} is malformed: expected a JSON object with "
                              f"algorithm 'crc32', crc32 (8 hex digits) and size, got "
                              f"{str(record)[:200]!r}")
    return record


def verify_file(path: str, expected: dict | None = None, checksum: bool = True) -> dict | None:
    """Check checkpoint file ``path`` against its sidecar before it is unpickled: the recorded
    coordinates against ``expected`` and, with ``checksum``, the size and CRC-32 of its bytes.
    Returns the sidecar record, None when the file has none (written before format 2)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    record = read_checksum_file(path)
    if record is None:
        return None
    if expected is not None:
        check_coords(path, record.get("coords"), expected, checksum_path(path))
    if checksum:
        crc, size = file_crc32(path)
        if size != record["size"] or f"{crc:08x}" != record["crc32"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt or truncated: {size} bytes with crc32 "
                f"{crc:08x}, expected {record['size']} bytes with crc32 {record['crc32']} "
                f"(recorded in {checksum_path(path)} when it was saved)")
    return record


def load_file(path: str, mmap: bool = False) -> dict:
    """``torch.load(weights_only=True)`` on CPU (memory-mapped with ``mmap``), with errors
    that name the file (no checksum: ``verify_file`` first). A file that pickles classes
    (a Megatron-LM file's args, anything foreign) is no megazero file, and says so."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated or unsafe content
        classes = unsafe_globals(path)
        if "argparse.Namespace" in classes:
            raise CheckpointError(f"checkpoint file {path} is a Megatron-LM file (it pickles "
                                  "an argparse.Namespace of args), not a megazero one: "
                                  "--load reads Megatron checkpoints directly, or convert "
                                  "them with python -m megazero.tools.checkpoint "
                                  "from-megatron") from None
        if classes:
            raise CheckpointError(foreign_file_error(path)) from None
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated "
                              f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(foreign_file_error(path, state))
    return state


# ---- files that are not megazero's ---------------------------------------------------------
def unsafe_globals(path: str) -> list[str]:
    """The classes and functions a torch file pickles that ``weights_only`` loading refuses,
    read from its pickle opcodes without unpickling anything ([] when it cannot tell)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - not a torch zip file, unreadable
        return []


class _Inert:
    """What ``_PeekUnpickler`` builds for every class a pickle names: it records nothing and
    runs no code, so a foreign file can be looked at safely."""

    def __init__(self, *args, **kwargs):
        self.keys = []

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):  # an OrderedDict's items: only the keys are kept
        self.keys.append(key)

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _PeekUnpickler(pickle.Unpickler):
    """Reads a pickle's structure: every global is an ``_Inert`` subclass (nothing is
    imported), every tensor storage None."""

    def find_class(self, module, name):
        return type(name, (_Inert,), {})

    def persistent_load(self, pid):
        return None


def top_level_keys(path: str) -> list[str] | None:
    """The keys of the dict a torch file holds, read without importing or running anything it
    names; None when it is no torch zip file holding a dict."""
    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            obj = _PeekUnpickler(io.BytesIO(z.read(name))).load()
    except Exception:  # noqa: BLE001 - not a zip, no pickle, malformed
        return None
    if isinstance(obj, _Inert) and obj.keys:
        obj = dict.fromkeys(obj.keys)
    return [str(k) for k in obj] if isinstance(obj, dict) else None


def foreign_file_error(path: str, state=None) -> str:
    """The message for a file that is neither megazero's nor Megatron's: its top-level keys
    (and the classes it pickles, which megazero does not load)."""
    keys = list(state) if isinstance(state, dict) else top_level_keys(path)
    what = f"top-level keys {[str(k) for k in keys][:12]}" if keys is not None else \
        (f"a pickled {type(state).__name__}" if state is not None else
         "no dict of a torch file")
    classes = unsafe_globals(path)
    more = f"; it pickles classes megazero does not load: {', '.join(classes[:8])}" \
        if classes else ""
    return f"{path}: this file is not a megazero/Megatron checkpoint: {what}{more}"


def read_tracker(root: str, check_folder: bool = True) -> int | str | None:
    """Iteration in the tracker file, ``"release"``, or None when there is no tracker (or no
    folder ``root``). A tracker that is not a small text file holding a non-negative integer
    or ``release``, or (``check_folder``) that names an iteration without a folder, is a
    ``CheckpointError`` naming it: a bad tracker never means "start from random"."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint folder {root} is a file, not a folder")
    path = tracker_path(root)
    if not os.path.lexists(path):
        return None
    text = _read_small_text(path, "tracker file", _TRACKER_MAX_BYTES).strip()
    if text == "release":
        value = "release"
    elif re.fullmatch(r"[0-9]+", text):
        value = int(text)
    elif re.fullmatch(r"-[0-9]+", text):
        raise CheckpointError(f"tracker file {path} holds a negative iteration ({text})")
    else:
        raise CheckpointError(f"tracker file {path} must hold an iteration number or "
                              f"'release', got {text!r}")
    if check_folder and not os.path.isdir(iteration_dir(root, value)):
        raise CheckpointError(f"tracker file {path} names iteration {value}, but its folder "
                              f"{iteration_dir(root, value)} does not exist")
    return value


def _layout_problem(data) -> str | None:
    if not isinstance(data, dict):
        return f"a JSON object, got {type(data).__name__}"
    layout, model = data.get("layout"), data.get("model")
    if not isinstance(layout, dict):
        return "a 'layout' object"
    for key in ("tp", "pp", "dp"):
        v = layout.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return f"layout.{key} a positive integer, got {v!r}"
    stage = layout.get("zero_stage")
    if stage not in (0, 1, 2, 3):
        return f"layout.zero_stage in 0-3, got {stage!r}"
    virtual = layout.get("virtual")
    if virtual is not None and not (isinstance(virtual, int) and virtual >= 1):
        return f"layout.virtual null or a positive integer, got {virtual!r}"
    # shape entries: non-negative integers (None: unknown, the engine's models have no vocab);
    # architecture entries (position_embedding_type, swiglu, rotary_percent, ...): scalars
    if not isinstance(model, dict) or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
            if k in _SHAPE_ENTRIES else v is None or isinstance(v, (str, bool, int, float))
            for k, v in model.items()):
        return f"a 'model' object of non-negative integer shapes and scalar architecture " \
               f"settings, got {model!r}"
    return None


_SHAPE_ENTRIES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "max_position_embeddings", "vocab_size")


def read_layout_file(root: str, iteration: int | str) -> dict | None:
    """``layout.json`` of a saved iteration (``{"layout": ..., "model": ..., "checksums":
    ...}``), or None for checkpoints written before it existed; malformed content is a
    ``CheckpointError`` naming the file."""
    path = os.path.join(iteration_dir(root, iteration), LAYOUT_FILE)
    if not os.path.lexists(path):
        return None
    data = _read_small_json(path, "layout file", 1 << 20)
    problem = _layout_problem(data)
    if problem:
        raise CheckpointError(f"layout file {path} is malformed: expected {problem}")
    return data


# ---- temporary files of dead writers -------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (zombies count as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _is_checkpoint_temp(name: str) -> int | None:
    """The writer's pid when ``name`` is one of our temporary files, else None."""
    m = _TMP.match(name)
    if m is None:
        return None
    base = m.group("base")
    ours = base in (TRACKER, LAYOUT_FILE, LOCK_FILE) or base.endswith(
        (".pt", ".pt" + CHECKSUM_SUFFIX))
    return int(m.group("pid")) if ours else None


def remove_stale_temps(root: str, since: int | None = None) -> list[str]:
    """Remove the temporary files (``<file>.tmp.<pid>``) of writers that are no longer alive
    on this host from ``root``, its iteration folders (with ``since``: only those of
    iterations >= ``since``, where an interrupted save can have left them) and their cells;
    returns their paths. Files of live processes, and other files, are kept."""
    if not os.path.isdir(root):
        return []
    removed = []

    def wanted(name: str) -> bool:
        if not _ITERATION_DIR.match(name):
            return False
        return since is None or name == "release" or int(name[5:]) >= since

    def sweep(folder: str, depth: int) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if depth == 0 and wanted(entry.name) or \
                        depth == 1 and entry.name.startswith("mp_rank_"):
                    sweep(entry.path, depth + 1)
                continue
            pid = _is_checkpoint_temp(entry.name)
            if pid is not None and not pid_alive(pid):
                try:
                    os.remove(entry.path)
                    removed.append(entry.path)
                except FileNotFoundError:
                    pass

    sweep(root, 0)
    return removed
