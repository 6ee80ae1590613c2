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

``MMapIndexedDatasetBuilder`` writes both files to temporary names and renames them into place
only in ``finalize`` (``.bin`` first, ``.idx`` last; a stale ``.idx`` is removed on open), so an
interrupted write never leaves an ``.idx`` that reads as valid for a partial ``.bin``.
``MMapIndexedDataset`` validates the header, the pointers and the ``.bin`` size on open, with
errors that name the file.
"""

from __future__ import annotations

import logging
import os
import struct

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedDatasetError(ValueError):
    """An ``.idx``/``.bin`` pair that is missing, truncated or inconsistent."""


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
    exception removes the temporary files and leaves no ``.idx``.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self._tmp_bin = f"{data_file_path(prefix)}.tmp{os.getpid()}"
        self._tmp_idx = f"{index_file_path(prefix)}.tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        # An .idx left from an earlier run must not be paired with the .bin we are replacing.
        if os.path.exists(index_file_path(prefix)):
            os.remove(index_file_path(prefix))
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
        """Write the index, then rename ``.bin`` and ``.idx`` into place (``.idx`` last)."""
        self._file.close()
        index_file = index_file or index_file_path(self.prefix)
        sizes = np.asarray(self._sizes, dtype=np.int32)
        if sizes.size and int(np.max(np.asarray(self._sizes, dtype=np.int64))) > 2**31 - 1:
            raise IndexedDatasetError(f"{self.prefix}: a sequence exceeds 2^31-1 tokens")
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
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(self._tmp_idx, index_file)
        logger.info("wrote %s (%d sequences, %d documents, %d tokens, %s)", index_file,
                    sizes.size, doc_idx.size - 1, self.num_tokens, self.dtype)

    def abort(self) -> None:
        """Close and delete the temporary files (nothing is renamed into place)."""
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

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(prefix: str) -> bool:
        return dataset_exists(prefix)


def make_dataset(prefix: str, impl: str = "mmap", validate: bool = True) -> MMapIndexedDataset:
    """Open ``prefix`` (Megatron's ``make_dataset``); only ``mmap`` is supported."""
    if impl not in ("mmap", "infer"):
        raise IndexedDatasetError(f"--data-impl {impl!r} is not supported; only 'mmap'")
    return MMapIndexedDataset(prefix, validate=validate)
