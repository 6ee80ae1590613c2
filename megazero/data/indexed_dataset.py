"""Megatron's memory-mapped indexed dataset (``MMIDIDX``): a ``.bin`` of tokens plus an ``.idx``.

Byte-compatible with Megatron-LM's ``MMapIndexedDataset``, so files move both ways.
The ``.bin`` is every sequence's tokens back to back in one dtype. The ``.idx`` is, little-endian:

    offset 0   9 bytes  magic b"MMIDIDX\\x00\\x00"
           9   uint64   version (1)
          17   uint8    dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                        7 float32, 8 uint16
          18   uint64   N, number of sequences
          26   uint64   D, number of document-index entries
          34   int32[N] sequence lengths (in tokens)
               int64[N] byte offset of each sequence in the .bin
               int64[D] document index: sequence number where each document starts, then N

``MMapIndexedDatasetBuilder`` writes both files to temporary names in the output folder and
renames them into place only in ``finalize`` (``.bin`` first, ``.idx`` last). Until then a
dataset already at the prefix is untouched, and a failed or aborted write removes only its own
temporaries. At the commit the old ``.idx`` is unlinked just before the new ``.bin`` replaces
the old one, so no instant pairs a new ``.bin`` with an old ``.idx``.
``MMapIndexedDataset`` validates the header, the pointers, the document index and the ``.bin``
size on open, with errors that name the file.

``validate_dataset`` checks what training needs beyond a readable file: integer token ids,
none negative and all below the tokenizer's vocabulary size. The ids are scanned once, with
numpy over the memory-mapped ``.bin`` in chunks of ``SCAN_CHUNK_TOKENS``; the result (the
smallest and largest id, counts) is cached in ``{prefix}.idx.validated.json``, keyed by the
size, mtime and inode of both files, so later runs skip the scan, and any rewrite of the
files invalidates it. An id out of range is a ``DatasetError`` naming the file, the document,
the position in it, the id and the vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
SCAN_CHUNK_TOKENS = 1 << 24  # tokens per numpy pass of the id scan (32 MB of uint16)
VALIDATION_FORMAT = 1  # bump when what validate_dataset records changes


class IndexedDatasetError(ValueError):
    """An ``.idx``/``.bin`` pair that is missing, truncated or inconsistent."""


class DatasetError(IndexedDatasetError):
    """A readable dataset that cannot be trained on: non-integer tokens, ids outside the
    vocabulary, too few documents or tokens (the message names the file and what is wrong)."""


def data_file_path(prefix: str) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str) -> str:
    return f"{prefix}.idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def best_fitting_dtype(vocab_size: int | None = None) -> type:
    """uint16 when every id fits (vocab < 65500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    try:
        return CODES[np.dtype(dtype)]
    except KeyError:
        raise IndexedDatasetError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of "
                                  f"{sorted(str(np.dtype(d)) for d in DTYPES.values())}") from None


class MMapIndexedDatasetBuilder:
    """Stream sequences into ``{prefix}.bin``; ``finalize`` writes ``{prefix}.idx``.

    ``add_item(tokens)`` appends one sequence, ``end_document()`` closes the current document
    (GPT data: one sequence per document). Use as a context manager: leaving the block with an
    exception removes the temporary files; a dataset already at ``prefix`` stays as it was.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        # Temporaries in the output folder (renames stay on one file system); an existing
        # dataset at the prefix is left alone until finalize succeeds.
        self._tmp_bin = f"{data_file_path(prefix)}.tmp{os.getpid()}"
        self._tmp_idx = f"{index_file_path(prefix)}.tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        self.num_tokens = 0

    def add_item(self, tokens) -> None:
        """Append one sequence (any 1-d array-like of token ids)."""
        arr = np.asarray(tokens, dtype=self.dtype).reshape(-1)
        self._file.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)
        self.num_tokens += arr.size

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens) -> None:
        """Append one sequence and close the document around it."""
        self.add_item(tokens)
        self.end_document()

    def merge_file_(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at ``prefix``."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot merge {index_file_path(prefix)} (dtype "
                                      f"{other.dtype}) into a {self.dtype} dataset")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in other.sizes)
        self._doc_idx.extend(int(d) + offset for d in other.doc_idx[1:])
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._file.write(chunk)
        self.num_tokens += int(other.sizes.sum(dtype=np.int64))

    def finalize(self, index_file: str | None = None) -> None:
        """Write the index, then rename ``.bin`` and ``.idx`` into place (``.idx`` last).

        On any error the temporaries are removed and a dataset already at the prefix is kept.
        """
        try:
            self._write_index()
            self._commit(index_file or index_file_path(self.prefix))
        except BaseException:
            self.abort()
            raise

    def _write_index(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._sizes and int(np.max(np.asarray(self._sizes, dtype=np.int64))) > 2**31 - 1:
            raise IndexedDatasetError(f"{self.prefix}: a sequence exceeds 2^31-1 tokens")
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", sizes.size))
            f.write(struct.pack("<Q", doc_idx.size))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        self._num_sequences, self._num_documents = int(sizes.size), int(doc_idx.size - 1)

    def _commit(self, index_file: str) -> None:
        # The old .idx goes first: a crash between the renames leaves a .bin without an index
        # (refused on open), never a new .bin described by the old index.
        if os.path.exists(index_file):
            os.remove(index_file)
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(self._tmp_idx, index_file)
        stale = f"{index_file}.validated.json"
        if os.path.exists(stale):  # keyed by the files' stats anyway; removed for tidiness
            os.remove(stale)
        logger.info("wrote %s (%d sequences, %d documents, %d tokens, %s)", index_file,
                    self._num_sequences, self._num_documents, self.num_tokens, self.dtype)

    def abort(self) -> None:
        """Close and delete the temporary files (nothing is renamed into place)."""
        if not self._file.closed:
            self._file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False


def read_index(path: str):
    """Parse and validate an ``.idx`` file: ``(dtype, sizes, pointers, doc_idx, mmap)``."""
    if not os.path.isfile(path):
        raise IndexedDatasetError(f"index file not found: {path}")
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if header[:9] != MAGIC:
        hint = (" (this is Megatron's older 'lazy'/'cached' TNTIDX format; re-run "
                "preprocessing with --dataset-impl mmap)" if header[:6] == b"TNTIDX" else "")
        raise IndexedDatasetError(f"{path}: bad magic {header[:9]!r}, expected {MAGIC!r}; not an "
                                  f"MMIDIDX index file{hint}")
    if len(header) < HEADER_SIZE:
        raise IndexedDatasetError(f"{path}: truncated header ({len(header)} of {HEADER_SIZE} "
                                  "bytes)")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: unknown MMIDIDX version {version} (only "
                                  f"{VERSION} is supported)")
    code = header[17]
    if code not in DTYPES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: "
                                  f"{', '.join(f'{k} {np.dtype(v)}' for k, v in DTYPES.items())})")
    n, d = struct.unpack("<QQ", header[18:34])
    expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
    if file_size < expected:
        raise IndexedDatasetError(f"{path}: index truncated: {file_size} bytes, but its header "
                                  f"announces {n} sequences and {d} document entries "
                                  f"({expected} bytes)")
    buf = np.memmap(path, mode="r", dtype=np.uint8, shape=(expected,))
    sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
    doc_idx = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
    return np.dtype(DTYPES[code]), sizes, pointers, doc_idx, buf


def validate_index(path: str, dtype: np.dtype, sizes, pointers, doc_idx) -> None:
    """Check pointers against sizes and the document index against the sequence count."""
    n = sizes.size
    if n and int(sizes.min()) < 0:
        raise IndexedDatasetError(f"{path}: negative sequence length at sequence "
                                  f"{int(np.argmax(sizes < 0))}")
    if n:
        expect = np.zeros(n, dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=expect[1:])
        bad = np.flatnonzero(pointers != expect)
        if bad.size:
            i = int(bad[0])
            raise IndexedDatasetError(
                f"{path}: inconsistent pointers: sequence {i} starts at byte {int(pointers[i])}, "
                f"but the lengths before it put it at byte {int(expect[i])}")
    if doc_idx.size == 0 or int(doc_idx[0]) != 0 or int(doc_idx[-1]) != n:
        first = int(doc_idx[0]) if doc_idx.size else None
        last = int(doc_idx[-1]) if doc_idx.size else None
        raise IndexedDatasetError(f"{path}: inconsistent document index: it must start at 0 "
                                  f"and end at the sequence count {n}, got first={first} "
                                  f"last={last}")
    if doc_idx.size > 1 and bool(np.any(np.diff(doc_idx) < 0)):
        raise IndexedDatasetError(f"{path}: inconsistent document index: not non-decreasing")


class MMapIndexedDataset:
    """Read-only, memory-mapped view of ``{prefix}.bin/.idx`` (Megatron's ``MMapIndexedDataset``).

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapped ``.bin``), ``ds[a:b]``
    a list of them, ``ds.get(i, offset, length)`` a slice of one sequence. ``sizes`` are the
    sequence lengths and ``doc_idx`` the document boundaries. Pickles by path.
    """

    def __init__(self, prefix: str, validate: bool = True):
        self._do_init(prefix, validate)

    def _do_init(self, prefix: str, validate: bool) -> None:
        self.prefix = prefix
        self._validate = validate
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        self.dtype, self.sizes, self.pointers, self.doc_idx, self._index_buf = read_index(
            idx_path)
        if validate:
            validate_index(idx_path, self.dtype, self.sizes, self.pointers, self.doc_idx)
        if not os.path.isfile(bin_path):
            raise IndexedDatasetError(f"data file not found: {bin_path} (index {idx_path} exists)")
        n = self.sizes.size
        need = (int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize) if n else 0
        have = os.path.getsize(bin_path)
        if have < need:
            raise IndexedDatasetError(f"{bin_path} is shorter than its index says: {have} bytes, "
                                      f"index {idx_path} needs {need} (truncated or partial "
                                      "write?)")
        if have > need:
            logger.warning("%s has %d bytes beyond what %s describes", bin_path, have - need,
                           idx_path)
        if have:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8, shape=(have,))
        else:
            self._bin = np.zeros(0, dtype=np.uint8)

    def __getstate__(self):
        return {"prefix": self.prefix, "validate": False}

    def __setstate__(self, state):
        self._do_init(state["prefix"], state["validate"])

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an indexed dataset must be contiguous")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (to its end without length)."""
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {self.prefix} "
                             f"({len(self)} sequences)")
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence "
                             f"{idx} of {self.prefix} (length {size})")
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """Every token of every sequence, in order, as one flat memory-mapped array."""
        return np.frombuffer(self._bin, dtype=self.dtype, count=self.num_tokens)

    def locate(self, token: int) -> tuple[int, int, int]:
        """``(document, sequence, position in the sequence)`` of flat token index ``token``."""
        starts = self.pointers // self.dtype.itemsize
        seq = int(np.searchsorted(starts, token, side="right")) - 1
        doc = int(np.searchsorted(self.doc_idx, seq, side="right")) - 1
        return doc, seq, int(token - starts[seq])

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(prefix: str) -> bool:
        return dataset_exists(prefix)


def validation_cache_path(prefix: str, cache_path: str | None = None) -> str:
    """Where ``validate_dataset`` records its result: beside the index, or under
    ``cache_path`` (``--data-cache-path``) for a dataset in a read-only folder."""
    if cache_path is None:
        return f"{index_file_path(prefix)}.validated.json"
    where = hashlib.md5(os.path.abspath(prefix).encode()).hexdigest()[:8]
    return os.path.join(cache_path, f"{os.path.basename(prefix)}_{where}.idx.validated.json")


def _file_stats(prefix: str) -> dict:
    out = {}
    for kind, path in (("idx", index_file_path(prefix)), ("bin", data_file_path(prefix))):
        st = os.stat(path)
        out[kind] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    return out


def scan_token_ids(ds: MMapIndexedDataset, vocab_size: int | None = None
                   ) -> tuple[int | None, int | None]:
    """``(min id, max id)`` over every token of ``ds`` (None for no tokens), read from the
    memory-mapped ``.bin`` in chunks of ``SCAN_CHUNK_TOKENS``. Raises ``DatasetError`` at the
    first negative id, or the first id ``>= vocab_size`` when it is given."""
    flat = ds.tokens()
    lo = hi = None
    for start in range(0, flat.size, SCAN_CHUNK_TOKENS):
        chunk = flat[start:start + SCAN_CHUNK_TOKENS]
        cmin, cmax = int(chunk.min()), int(chunk.max())
        if cmin < 0 or (vocab_size is not None and cmax >= vocab_size):
            limit = vocab_size if vocab_size is not None else np.inf
            bad = int(np.flatnonzero((chunk < 0) | (chunk >= limit))[0])
            raise _bad_token(ds, start + bad, int(chunk[bad]), vocab_size)
        lo = cmin if lo is None else min(lo, cmin)
        hi = cmax if hi is None else max(hi, cmax)
    return lo, hi


def _bad_token(ds: MMapIndexedDataset, token: int, value: int, vocab_size: int | None
               ) -> DatasetError:
    doc, seq, pos = ds.locate(token)
    where = (f"{data_file_path(ds.prefix)}: token id {value} at document {doc}, position {pos} "
             f"(sequence {seq}, token {token} of the file)")
    if value < 0:
        return DatasetError(f"{where} is negative; token ids must be >= 0")
    return DatasetError(f"{where} is out of range for the tokenizer's vocabulary size "
                        f"{vocab_size} (valid ids: 0 to {vocab_size - 1}); was the data "
                        "tokenized with another tokenizer, or is the file corrupt?")


def _read_record(path: str, stats: dict) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):  # missing, unreadable or not JSON: validate again
        return None
    if (not isinstance(record, dict) or record.get("format") != VALIDATION_FORMAT
            or record.get("files") != stats):
        return None
    return record


def _write_record(path: str, record: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        logger.info("could not cache the validation of %s in %s (%s); it will run again",
                    record["prefix"], path, exc)
        if os.path.exists(tmp):
            os.remove(tmp)


def validate_dataset(ds: MMapIndexedDataset, vocab_size: int | None = None, *,
                     cache_path: str | None = None) -> dict:
    """Check that ``ds`` can be trained on with a vocabulary of ``vocab_size`` ids.

    Integer dtype, no negative id, every id below ``vocab_size`` (when given). The structure
    (lengths, pointers, document index, ``.bin`` size) was checked when ``ds`` was opened with
    ``validate=True``. Returns the record cached beside the index (or under ``cache_path`` when
    the index folder is not writable): counts and the smallest and largest id. A cached record
    whose largest id does not fit ``vocab_size`` is rescanned to name the first bad token.
    """
    idx_path = index_file_path(ds.prefix)
    if ds.dtype.kind not in "iu":
        raise DatasetError(f"{idx_path}: token dtype {ds.dtype} is not an integer type; token "
                           "ids must be stored as integers (preprocessing writes uint16 or "
                           "int32); re-run preprocessing")
    stats = _file_stats(ds.prefix)
    paths = [validation_cache_path(ds.prefix)]
    if cache_path is not None:
        paths.append(validation_cache_path(ds.prefix, cache_path))
    for path in paths:
        record = _read_record(path, stats)
        if record is not None:
            break
    else:
        record = None
    if record is not None:
        hi = record["max_token_id"]
        if vocab_size is not None and hi is not None and hi >= vocab_size:
            scan_token_ids(ds, vocab_size)  # names the first bad token
        logger.info(" > %s: validated (cached in %s): %d documents, %d tokens, ids %s..%s",
                    ds.prefix, path, record["num_documents"], record["num_tokens"],
                    record["min_token_id"], hi)
        return record
    lo, hi = scan_token_ids(ds, vocab_size)
    record = {"format": VALIDATION_FORMAT, "prefix": ds.prefix, "files": stats,
              "dtype": str(ds.dtype), "num_sequences": len(ds),
              "num_documents": int(ds.doc_idx.size - 1), "num_tokens": ds.num_tokens,
              "min_token_id": lo, "max_token_id": hi, "vocab_size_checked": vocab_size}
    folder = os.path.dirname(os.path.abspath(idx_path))
    target = paths[0] if os.access(folder, os.W_OK) or len(paths) == 1 else paths[1]
    _write_record(target, record)
    logger.info(" > %s: validated %d documents, %d tokens, ids %s..%s", ds.prefix,
                record["num_documents"], record["num_tokens"], lo, hi)
    return record


def make_dataset(prefix: str, impl: str = "mmap", validate: bool = True) -> MMapIndexedDataset:
    """Open ``prefix`` (Megatron's ``make_dataset``); only ``mmap`` is supported."""
    if impl not in ("mmap", "infer"):
        raise IndexedDatasetError(f"--data-impl {impl!r} is not supported; only 'mmap'")
    return MMapIndexedDataset(prefix, validate=validate)
