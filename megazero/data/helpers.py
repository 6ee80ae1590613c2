"""Python face of the data-index helpers (``csrc/data/helpers.cpp``) with numpy references.

``build_sample_idx`` and ``build_blending_indices`` call the compiled ``megazero.ops._data``
when it is built and fall back to the numpy reference otherwise (``use_cpp`` forces a path);
both paths return identical arrays (tests compare them).

``build_sample_idx``: the documents in ``doc_idx`` order form one token stream; sample ``i``
holds the ``seq_length + 1`` tokens starting at stream position ``i * seq_length`` (consecutive
samples share one token). Row ``i`` of the ``[num_samples + 1, 2]`` result is (index into
``doc_idx``, offset in that document) of position ``i * seq_length``; row 0 is always (0, 0).
The numpy reference finds these rows with a ``searchsorted`` over the cumulative document
lengths instead of Megatron's loop; the two agree exactly.

``build_blending_indices``: Megatron's greedy blend: for sample ``i`` pick the dataset ``d``
maximising ``weights[d] * max(i, 1) - count[d]`` (first on ties), record ``d`` and ``count[d]``.
The reference is a plain Python loop (sequential by nature), O(size * datasets).
"""

from __future__ import annotations

import numpy as np

from megazero.ops._loader import load_extension

_INT32_MAX = np.iinfo(np.int32).max


def _extension(use_cpp: bool | None):
    if use_cpp is False:
        return None
    ext = load_extension("data")
    if ext is None and use_cpp:
        raise RuntimeError("megazero.ops._data is not built (build it with "
                           "`MEGAZERO_BUILD_ONLY=data python setup.py build_ext --inplace`)")
    return ext


def cpp_available() -> bool:
    return load_extension("data") is not None


def _sample_idx_dtype(doc_idx: np.ndarray) -> type:
    return np.int32 if doc_idx.size < _INT32_MAX else np.int64


def _check_sample_idx_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    if sizes.ndim != 1 or doc_idx.ndim != 1:
        raise ValueError("build_sample_idx: sizes and doc_idx must be 1-d arrays")
    if seq_length < 1 or num_epochs < 1 or tokens_per_epoch < 1:
        raise ValueError(f"build_sample_idx: seq_length ({seq_length}), num_epochs "
                         f"({num_epochs}) and tokens_per_epoch ({tokens_per_epoch}) must be >= 1")


def build_sample_idx_numpy(sizes, doc_idx, seq_length: int, num_epochs: int,
                           tokens_per_epoch: int) -> np.ndarray:
    """Reference ``sample_idx`` (see the module docstring)."""
    sizes, doc_idx = np.asarray(sizes), np.asarray(doc_idx)
    _check_sample_idx_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    if doc_idx.size and (int(doc_idx.min()) < 0 or int(doc_idx.max()) >= sizes.size):
        bad = int(np.flatnonzero((doc_idx < 0) | (doc_idx >= sizes.size))[0])
        raise ValueError(f"build_sample_idx: doc_idx[{bad}] = {int(doc_idx[bad])} is not a "
                         f"document of sizes ({sizes.size} entries)")
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)  # stream position one past each document
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    docs = np.searchsorted(ends, positions, side="right")
    if docs.size and docs[-1] >= doc_idx.size:
        raise ValueError(f"build_sample_idx: ran past the end of doc_idx ({doc_idx.size} "
                         "entries); tokens_per_epoch or num_epochs does not match doc_idx")
    out = np.empty((num_samples + 1, 2), dtype=_sample_idx_dtype(doc_idx))
    out[:, 0] = docs
    out[:, 1] = positions - (ends[docs] - lengths[docs])
    out[0] = 0
    return out


def build_sample_idx(sizes, doc_idx, seq_length: int, num_epochs: int, tokens_per_epoch: int,
                     *, use_cpp: bool | None = None) -> np.ndarray:
    """``sample_idx`` ``[num_samples + 1, 2]`` (int32, or int64 for > 2^31 documents)."""
    ext = _extension(use_cpp)
    if ext is None:
        return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx)
    _check_sample_idx_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    if _sample_idx_dtype(doc_idx) is np.int32:
        return ext.build_sample_idx_int32(sizes, np.ascontiguousarray(doc_idx, dtype=np.int32),
                                          int(seq_length), int(num_epochs),
                                          int(tokens_per_epoch))
    return ext.build_sample_idx_int64(sizes, np.ascontiguousarray(doc_idx, dtype=np.int64),
                                      int(seq_length), int(num_epochs), int(tokens_per_epoch))


def _check_weights(weights) -> np.ndarray:
    weights = np.ascontiguousarray(weights, dtype=np.float64).reshape(-1)
    if not 1 <= weights.size <= 255:
        raise ValueError(f"blending needs 1 to 255 datasets, got {weights.size}")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError(f"blending weights must be finite and non-negative, got {weights}")
    return weights


def build_blending_indices_numpy(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference greedy blend: ``(dataset_index uint8, dataset_sample_index int64)``."""
    w = [float(x) for x in _check_weights(weights)]
    rest = range(1, len(w))
    counts = [0] * len(w)
    index = [0] * size
    sample_index = [0] * size
    for i in range(size):
        n = float(i) if i > 1 else 1.0
        best, best_error = 0, w[0] * n - float(counts[0])
        for d in rest:
            error = w[d] * n - float(counts[d])
            if error > best_error:
                best, best_error = d, error
        index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return np.array(index, dtype=np.uint8), np.array(sample_index, dtype=np.int64)


def build_blending_indices(weights, size: int, *, use_cpp: bool | None = None
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy blend of ``size`` samples over ``len(weights)`` datasets (see module docstring)."""
    if size < 0:
        raise ValueError(f"blending size must be >= 0, got {size}")
    ext = _extension(use_cpp)
    if ext is None:
        return build_blending_indices_numpy(weights, size)
    weights = _check_weights(weights)
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    ext.build_blending_indices(dataset_index, dataset_sample_index, weights, weights.size,
                               int(size))
    return dataset_index, dataset_sample_index
