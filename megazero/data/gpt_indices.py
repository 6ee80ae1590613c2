"""Megatron's GPT sample indices (``doc_idx``, ``sample_idx``, ``shuffle_idx``) and their cache.

For a split holding ``documents`` (ids of sequences in an indexed dataset) and a request of
``num_samples`` samples of ``seq_length + 1`` tokens:

- ``num_epochs``: how many passes over the split give ``num_samples`` samples
  (``(epochs * tokens_per_epoch - 1) // seq_length >= num_samples``).
- ``doc_idx``: the split's documents repeated ``num_epochs`` times and shuffled with
  ``np.random.RandomState(seed)``. When the last epoch contributes fewer than 80% of an
  epoch's samples it is shuffled separately, so its few samples are not spread thinly over the
  whole run (``separate_last_epoch``).
- ``sample_idx``: ``[num_samples' + 1, 2]`` (doc_idx index, offset) where each sample starts
  (``megazero.data.helpers.build_sample_idx``).
- ``shuffle_idx``: a permutation of the samples, the last partial epoch permuted on its own.

The same random draws in the same order as Megatron-LM, so indices are identical to Megatron's
for the same data, split, seed and sample count. Index files are ``.npy``, written to a
temporary name and renamed into place, next to the data or under ``cache_path``; one rank
(the builder) writes them and the others memory-map them after a barrier, or poll for them
when no barrier is given. Where the folder is not writable every rank computes the indices in
memory (deterministic, so all ranks agree).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from megazero.data.helpers import build_sample_idx

logger = logging.getLogger(__name__)

INDEX_FORMAT = 1  # bump when the way indices are computed changes
DEFAULT_WAIT_TIMEOUT_S = 3600.0


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs that yields ``num_samples`` samples (Megatron's loop)."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"a split needs at least 2 tokens to make samples, got "
                         f"{tokens_per_epoch}")
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        # -1: each sample reads seq_length + 1 tokens, the last overlapping the next sample
        if (total - 1) // seq_length >= num_samples:
            return epochs


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last_epoch: bool) -> np.ndarray:
    """Documents repeated ``num_epochs`` times, shuffled (last epoch apart if separate)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_idx(num_samples: int, total_size: int,
                      rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, num_samples)`` followed by one of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_index_mappings(sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                         seq_length: int, seed: int, *, use_cpp: bool | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compute ``(doc_idx, sample_idx, shuffle_idx)`` in memory (Megatron's semantics)."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate_last_epoch = False
    if num_epochs > 1:
        from_epochs_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - from_epochs_minus_one
        per_epoch = (tokens_per_epoch - 1) // seq_length
        # Megatron's bound (<= per_epoch + 1: the last epoch can complete the sample that
        # straddles the previous epoch's end as well as its own)
        if not 0 <= last_epoch_samples <= per_epoch + 1:
            raise ValueError(f"cannot lay out {num_samples} samples of {seq_length + 1} tokens "
                             f"over {num_epochs} epochs of {tokens_per_epoch} tokens (the last "
                             f"epoch would hold {last_epoch_samples} of at most {per_epoch + 1})")
        separate_last_epoch = last_epoch_samples < int(0.80 * per_epoch)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch,
                                  use_cpp=use_cpp)
    total = sample_idx.shape[0] - 1
    first = from_epochs_minus_one if separate_last_epoch else total
    shuffle_idx = build_shuffle_idx(first, total, rng)
    logger.info("    built indices: %d epochs, %d tokens per epoch, %d samples%s", num_epochs,
                tokens_per_epoch, total,
                " (last epoch shuffled separately)" if separate_last_epoch else "")
    return doc_idx, sample_idx, shuffle_idx


@dataclass(frozen=True)
class IndexSpec:
    """What identifies one split's indices, and where their cache files go."""

    name: str  # train | valid | test
    data_prefix: str
    first_document: int
    num_documents: int
    total_documents: int  # sequences in the whole dataset (a different file -> other name)
    num_samples: int
    seq_length: int
    seed: int
    cache_path: str | None = None

    def _stem(self) -> str:
        key = (f"v{INDEX_FORMAT} {self.first_document} {self.num_documents} "
               f"{self.total_documents}")
        digest = hashlib.md5(key.encode()).hexdigest()[:10]
        tail = (f"_{self.name}_indexmap_{self.num_samples}ns_{self.seq_length}sl_"
                f"{self.seed}s_{digest}")
        if self.cache_path is None:
            return self.data_prefix + tail
        where = hashlib.md5(os.path.abspath(self.data_prefix).encode()).hexdigest()[:8]
        return os.path.join(self.cache_path,
                            f"{os.path.basename(self.data_prefix)}_{where}{tail}")

    def paths(self) -> dict[str, str]:
        stem = self._stem()
        return {k: f"{stem}_{k}.npy" for k in ("doc_idx", "sample_idx", "shuffle_idx")}

    def folder(self) -> str:
        return os.path.dirname(os.path.abspath(self._stem()))

    def writable(self) -> bool:
        folder = self.folder()
        if self.cache_path is not None:
            os.makedirs(folder, exist_ok=True)
        return os.access(folder, os.W_OK)

    def documents(self) -> np.ndarray:
        return np.arange(self.first_document, self.first_document + self.num_documents,
                         dtype=np.int32)


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}.npy"  # unique per writer
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def index_files_exist(spec: IndexSpec) -> bool:
    return all(os.path.isfile(p) for p in spec.paths().values())


def ensure_index_files(spec: IndexSpec, sizes: np.ndarray) -> None:
    """Builder side: write the spec's index files unless they are already there."""
    if index_files_exist(spec):
        return
    paths = spec.paths()
    logger.info(" > building %s indices for %s (%d samples of %d tokens) -> %s", spec.name,
                spec.data_prefix, spec.num_samples, spec.seq_length + 1, spec.folder())
    start = time.perf_counter()
    arrays = build_index_mappings(sizes, spec.documents(), spec.num_samples, spec.seq_length,
                                  spec.seed)
    for key, array in zip(("doc_idx", "sample_idx", "shuffle_idx"), arrays):
        _save_npy_atomic(paths[key], array)
    logger.info("    index files written in %.2f s", time.perf_counter() - start)


def load_index_files(spec: IndexSpec, wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Memory-map the spec's index files, waiting up to ``wait_timeout`` s for the builder."""
    deadline = time.monotonic() + wait_timeout
    next_log = time.monotonic() + 30.0
    while not index_files_exist(spec):
        if time.monotonic() > deadline:
            missing = [p for p in spec.paths().values() if not os.path.isfile(p)]
            raise TimeoutError(f"index files for the {spec.name} split of {spec.data_prefix} "
                               f"did not appear within {wait_timeout:.0f} s (missing: "
                               f"{', '.join(missing)}); did the builder rank fail?")
        if time.monotonic() > next_log:
            logger.info("waiting for %s index files in %s", spec.name, spec.folder())
            next_log = time.monotonic() + 30.0
        time.sleep(0.05)
    paths = spec.paths()
    return tuple(np.load(paths[k], mmap_mode="r", allow_pickle=False)
                 for k in ("doc_idx", "sample_idx", "shuffle_idx"))
