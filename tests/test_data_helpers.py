"""C++ data-index helpers against the numpy references and a loop typed from Megatron's code."""

from __future__ import annotations

import numpy as np
import pytest

from megazero.data import helpers
from megazero.ops import _loader

needs_cpp = pytest.mark.skipif(not helpers.cpp_available(),
                               reason="megazero.ops._data is not built")


def loop_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's ``_build_sample_idx`` loop, typed independently."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros([num_samples + 1, 2], dtype=np.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[sample_index] = doc_idx_index, doc_offset
        sample_index += 1
    return out


def loop_blending(weights, size):
    current = [0] * len(weights)
    index, sample = [], []
    for i in range(size):
        n = max(float(i), 1.0)
        errors = [w * n - c for w, c in zip(weights, current)]
        best = errors.index(max(errors))
        index.append(best)
        sample.append(current[best])
        current[best] += 1
    return np.array(index), np.array(sample)


def _case(seed, num_docs=300, max_len=40, epochs=3, zero_frac=0.1):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_len, size=num_docs).astype(np.int32)
    sizes[rng.random(num_docs) < zero_frac] = 0  # empty documents are allowed
    docs = np.arange(num_docs, dtype=np.int32)
    doc_idx = np.concatenate([rng.permutation(docs) for _ in range(epochs)]).astype(np.int32)
    return sizes, doc_idx, epochs, int(sizes.sum())


@pytest.mark.parametrize("seq_length", [1, 2, 7, 39, 128, 2000])
def test_sample_idx_numpy_matches_megatron_loop(seq_length):
    sizes, doc_idx, epochs, tpe = _case(seq_length)
    if (epochs * tpe - 1) // seq_length < 1:
        pytest.skip("too few tokens")
    ref = loop_sample_idx(sizes, doc_idx, seq_length, epochs, tpe)
    got = helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tpe, use_cpp=False)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)


@needs_cpp
@pytest.mark.parametrize("seed", range(6))
def test_sample_idx_cpp_matches_numpy(seed):
    rng = np.random.default_rng(100 + seed)
    sizes, doc_idx, epochs, tpe = _case(seed, num_docs=int(rng.integers(1, 2000)),
                                        max_len=int(rng.integers(2, 3000)),
                                        epochs=int(rng.integers(1, 4)))
    seq_length = int(rng.integers(1, 1500))
    cpp = helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tpe, use_cpp=True)
    ref = helpers.build_sample_idx(sizes, doc_idx, seq_length, epochs, tpe, use_cpp=False)
    assert cpp.dtype == ref.dtype == np.int32
    np.testing.assert_array_equal(cpp, ref)


@needs_cpp
def test_sample_idx_int64_doc_idx_path():
    sizes, doc_idx, epochs, tpe = _case(7)
    ext = _loader.load_extension("data")
    got = ext.build_sample_idx_int64(sizes, doc_idx.astype(np.int64), 16, epochs, tpe)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, loop_sample_idx(sizes, doc_idx, 16, epochs, tpe))


@pytest.mark.parametrize("use_cpp", [False, pytest.param(True, marks=needs_cpp)])
def test_sample_idx_errors(use_cpp):
    sizes, doc_idx, epochs, tpe = _case(1)
    with pytest.raises(ValueError, match="ran past the end of doc_idx"):
        helpers.build_sample_idx(sizes, doc_idx, 8, epochs + 1, tpe, use_cpp=use_cpp)
    with pytest.raises(ValueError, match=r"doc_idx\[0\] = 999 is not a document"):
        helpers.build_sample_idx(sizes, np.array([999, 1], np.int32), 8, 1, 10, use_cpp=use_cpp)
    with pytest.raises(ValueError, match="must be >= 1"):
        helpers.build_sample_idx(sizes, doc_idx, 0, epochs, tpe, use_cpp=use_cpp)


@pytest.mark.parametrize("weights", [[1.0], [0.5, 0.5], [0.3, 0.7], [0.2, 0.0, 0.5, 0.3],
                                     [1 / 3, 1 / 3, 1 / 3], [0.001, 0.999]])
def test_blending_numpy_matches_loop(weights):
    index, sample = helpers.build_blending_indices(weights, 3000, use_cpp=False)
    ref_index, ref_sample = loop_blending(weights, 3000)
    assert index.dtype == np.uint8 and sample.dtype == np.int64
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(sample, ref_sample)


@needs_cpp
@pytest.mark.parametrize("seed", range(5))
def test_blending_cpp_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    weights = rng.random(int(rng.integers(1, 12)))
    weights /= weights.sum()
    size = int(rng.integers(0, 50000))
    cpp = helpers.build_blending_indices(weights, size, use_cpp=True)
    ref = helpers.build_blending_indices(weights, size, use_cpp=False)
    np.testing.assert_array_equal(cpp[0], ref[0])
    np.testing.assert_array_equal(cpp[1], ref[1])
    counts = np.bincount(cpp[0], minlength=weights.size)
    assert np.all(np.abs(counts - weights * size) <= 1.0 + 1e-9 * size)


def test_blending_errors():
    with pytest.raises(ValueError, match="non-negative"):
        helpers.build_blending_indices([0.5, -0.5], 10)
    with pytest.raises(ValueError, match="1 to 255 datasets"):
        helpers.build_blending_indices([], 10)


def test_disabled_extension_falls_back(monkeypatch):
    monkeypatch.setenv("MEGAZERO_DISABLE_OPS", "data")
    _loader.reset_cache()
    try:
        assert not helpers.cpp_available()
        sizes, doc_idx, epochs, tpe = _case(3)
        np.testing.assert_array_equal(
            helpers.build_sample_idx(sizes, doc_idx, 10, epochs, tpe),
            loop_sample_idx(sizes, doc_idx, 10, epochs, tpe))
        with pytest.raises(RuntimeError, match="not built"):
            helpers.build_sample_idx(sizes, doc_idx, 10, epochs, tpe, use_cpp=True)
    finally:
        monkeypatch.delenv("MEGAZERO_DISABLE_OPS")
        _loader.reset_cache()
