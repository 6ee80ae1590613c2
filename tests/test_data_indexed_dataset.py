"""MMIDIDX ``.bin/.idx``: round trip, an independent writer, validation errors, atomic writes."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from megazero.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    make_dataset,
)

# Format as described in the issue, written without megazero's code.
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
         np.float32: 7, np.uint16: 8}


def write_independent(prefix, docs, dtype, version=1, code=None, magic=b"MMIDIDX\x00\x00"):
    """``docs``: list of documents, each a list of sequences (lists of numbers)."""
    seqs = [np.asarray(s, dtype=dtype) for doc in docs for s in doc]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    sizes, pointers, pos = [], [], 0
    for s in seqs:
        sizes.append(len(s))
        pointers.append(pos)
        pos += len(s) * np.dtype(dtype).itemsize
    doc_idx, count = [0], 0
    for doc in docs:
        count += len(doc)
        doc_idx.append(count)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", CODES[dtype] if code is None else code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    return seqs, doc_idx


DOCS = [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]], [[]], [[10, 11], [12], [13, 14, 15]]]


@pytest.mark.parametrize("dtype", list(CODES))
def test_reads_independently_written_files(tmp_path, dtype):
    prefix = str(tmp_path / "indep")
    seqs, doc_idx = write_independent(prefix, DOCS, dtype)
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(seqs) == 7
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in seqs])
    np.testing.assert_array_equal(ds.doc_idx, doc_idx)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
        assert ds[i].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ds.get(2, offset=1, length=3), [6, 7, 8])
    np.testing.assert_array_equal(ds.get(2, offset=2), [7, 8, 9])
    np.testing.assert_array_equal(ds[-1], [13, 14, 15])
    assert [list(x) for x in ds[5:7]] == [[12], [13, 14, 15]]
    with pytest.raises(IndexError):
        ds.get(2, offset=3, length=5)


def test_written_files_match_independent_bytes(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write_independent(theirs, DOCS, np.uint16)
    with MMapIndexedDatasetBuilder(ours, np.uint16) as builder:
        for doc in DOCS:
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()
        builder.finalize()
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read()


def test_round_trip_and_pickle(tmp_path):
    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "rt")
    docs = [rng.integers(0, 50000, size=rng.integers(0, 300)) for _ in range(200)]
    with MMapIndexedDatasetBuilder(prefix, best_fitting_dtype(50257)) as builder:
        for d in docs:
            builder.add_document(d)
        builder.finalize()
    ds = make_dataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 200
    assert ds.num_tokens == sum(len(d) for d in docs)
    for d, got in zip(docs, ds[0:200]):
        np.testing.assert_array_equal(got, d)
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[7], docs[7])
    assert best_fitting_dtype(65500) == np.int32 and best_fitting_dtype(None) == np.int32


def test_merge_file(tmp_path):
    a, b, out = (str(tmp_path / n) for n in ("a", "b", "merged"))
    write_independent(a, DOCS[:2], np.int32)
    write_independent(b, DOCS[2:], np.int32)
    with MMapIndexedDatasetBuilder(out, np.int32) as builder:
        builder.merge_file_(a)
        builder.merge_file_(b)
        builder.finalize()
    write_independent(str(tmp_path / "whole"), DOCS, np.int32)
    for ext in (".bin", ".idx"):
        assert open(out + ext, "rb").read() == open(str(tmp_path / "whole") + ext, "rb").read()


def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_validation_errors_name_the_file(tmp_path):
    prefix = str(tmp_path / "bad")

    def fresh():
        write_independent(prefix, DOCS, np.int32)

    fresh()
    _corrupt(prefix + ".idx", 0, b"NOTMMIDX\x00")
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx: bad magic"):
        MMapIndexedDataset(prefix)
    _corrupt(prefix + ".idx", 0, b"TNTIDX\x00\x00\x00")
    with pytest.raises(IndexedDatasetError, match="TNTIDX format"):
        MMapIndexedDataset(prefix)
    write_independent(prefix, DOCS, np.int32, version=2)
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx: unknown MMIDIDX version 2"):
        MMapIndexedDataset(prefix)
    write_independent(prefix, DOCS, np.int32, code=9)
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx: unknown dtype code 9"):
        MMapIndexedDataset(prefix)
    fresh()
    os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") - 4)
    with pytest.raises(IndexedDatasetError, match=r"bad\.bin is shorter than its index says"):
        MMapIndexedDataset(prefix)
    fresh()
    n = 7  # sequences in DOCS
    _corrupt(prefix + ".idx", 34 + 4 * n + 8 * 3, struct.pack("<q", 999))  # pointer of seq 3
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx: inconsistent pointers: sequence 3"):
        MMapIndexedDataset(prefix)
    fresh()
    os.truncate(prefix + ".idx", os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(IndexedDatasetError, match=r"bad\.idx: index truncated"):
        MMapIndexedDataset(prefix)
    fresh()
    _corrupt(prefix + ".idx", 34 + 12 * n + 8 * 4, struct.pack("<q", 6))  # doc_idx[-1] != N
    with pytest.raises(IndexedDatasetError, match="inconsistent document index"):
        MMapIndexedDataset(prefix)
    fresh()
    os.remove(prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"data file not found: .*bad\.bin"):
        MMapIndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match=r"index file not found: .*nothing\.idx"):
        MMapIndexedDataset(str(tmp_path / "nothing"))
    with pytest.raises(IndexedDatasetError, match="has no MMIDIDX code"):
        MMapIndexedDatasetBuilder(str(tmp_path / "x"), np.complex64)


def test_interrupted_write_keeps_the_old_dataset(tmp_path):
    prefix = str(tmp_path / "partial")
    write_independent(prefix, DOCS, np.int32)  # an older, valid pair at the same prefix
    before = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
    with pytest.raises(KeyboardInterrupt):
        with MMapIndexedDatasetBuilder(prefix, np.int32) as builder:
            builder.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")] == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # only its temporaries went
    assert MMapIndexedDataset(prefix).doc_idx.size - 1 == len(DOCS)
