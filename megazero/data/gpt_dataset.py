"""GPT pretraining samples from Megatron indexed datasets, and the batch tensors built from them.

``build_train_valid_test_datasets`` splits the documents of each ``--data-path`` dataset by
``--split`` (e.g. ``949,50,1``), builds Megatron's sample indices for each split (see
``gpt_indices``) and, for a blend ``[w1, p1, w2, p2, ...]``, combines the per-dataset splits
with Megatron's greedy blending. Each dataset is map-style: ``ds[i]`` is
``{"text": int64 array of seq_length + 1 tokens}`` (inputs plus the next-token labels).

Every dataset is checked at setup (``indexed_dataset.validate_dataset``: integer ids below
the tokenizer's vocabulary, cached beside the index) and every split asked for samples must
hold at least ``seq_length + 1`` tokens; the errors (``DatasetError``) name the dataset, the
split, its documents and tokens and ``--seq-length``. A valid or test split with no documents
(a small dataset and ``--split``) is None, with a warning, as in Megatron.

Multi-rank use: every rank calls the builder with the same arguments; only ranks with
``is_builder=True`` write index files, then every rank calls ``barrier()`` exactly once (pass
e.g. a ``torch.distributed.barrier`` over the ranks that load data) and memory-maps the files.
Without a barrier, non-builders poll for the files. This module knows nothing of process groups.

``get_ltor_batch`` turns a ``[b, s+1]`` token batch into tokens, labels, loss mask, position
ids and (with ``--reset-attention-mask``) a per-document causal mask, as Megatron's
``get_ltor_masks_and_position_ids`` does, vectorised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from megazero.data.blended_dataset import BlendedDataset, parse_data_prefix
from megazero.data.gpt_indices import (
    DEFAULT_WAIT_TIMEOUT_S,
    IndexSpec,
    build_index_mappings,
    ensure_index_files,
    load_index_files,
)
from megazero.data.indexed_dataset import (
    DatasetError,
    MMapIndexedDataset,
    index_file_path,
    validate_dataset,
)

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def parse_splits(splits_string: str) -> list[float]:
    """``"949,50,1"`` (or ``/``-separated) -> three weights normalised to sum to 1."""
    sep = "," if "," in splits_string else "/"
    try:
        splits = [float(s) for s in splits_string.split(sep)]
    except ValueError:
        raise ValueError(f"--split must be numbers separated by ',' or '/', got "
                         f"{splits_string!r}") from None
    splits = (splits + [0.0, 0.0])[:3]
    if any(s < 0 for s in splits) or sum(splits) <= 0:
        raise ValueError(f"--split needs non-negative weights with a positive sum, got "
                         f"{splits_string!r}")
    total = sum(splits)
    return [s / total for s in splits]


def get_train_valid_test_split(splits_string: str, size: int) -> list[int]:
    """Document boundaries ``[0, a, b, size]`` of the three splits (Megatron's rounding)."""
    index = [0]
    for s in parse_splits(splits_string):
        index.append(index[-1] + int(round(s * float(size))))
    diff = index[-1] - size
    return [index[0]] + [i - diff for i in index[1:]]


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens over ``documents`` of ``indexed_dataset``."""

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray,
                 indexed_dataset: MMapIndexedDataset, num_samples: int, seq_length: int,
                 seed: int, cache_path: str | None = None, *, is_builder: bool = True,
                 barrier: Callable[[], None] | None = None,
                 wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S):
        documents = np.asarray(documents)
        if documents.size == 0:
            raise ValueError(f"the {name} split of {data_prefix} has no documents")
        first = int(documents[0])
        if not np.array_equal(documents, np.arange(first, first + documents.size)):
            raise ValueError("documents must be a contiguous range of sequence ids")
        if first < 0 or first + documents.size > len(indexed_dataset):
            raise ValueError(f"documents [{first}, {first + documents.size}) out of range for "
                             f"{data_prefix} ({len(indexed_dataset)} sequences)")
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.spec = IndexSpec(name, data_prefix, first, int(documents.size),
                              len(indexed_dataset), int(num_samples), int(seq_length), int(seed),
                              cache_path)
        if self.spec.writable():
            if is_builder:
                ensure_index_files(self.spec, indexed_dataset.sizes)
            if barrier is not None:
                barrier()
            self.doc_idx, self.sample_idx, self.shuffle_idx = load_index_files(
                self.spec, wait_timeout)
            self._mapped = True
        else:
            logger.warning("cannot write index files to %s; computing the %s indices in "
                           "memory", self.spec.folder(), name)
            if barrier is not None:
                barrier()
            self.doc_idx, self.sample_idx, self.shuffle_idx = build_index_mappings(
                indexed_dataset.sizes, self.spec.documents(), num_samples, seq_length, seed)
            self._mapped = False

    def __getstate__(self):  # spawned DataLoader workers re-map the index files, not copy them
        state = dict(self.__dict__)
        if self._mapped:
            for key in ("doc_idx", "sample_idx", "shuffle_idx"):
                del state[key]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self._mapped:
            self.doc_idx, self.sample_idx, self.shuffle_idx = load_index_files(self.spec, 0.0)

    def __len__(self) -> int:
        # sample i spans sample_idx[i] .. sample_idx[i + 1]
        return int(self.sample_idx.shape[0]) - 1

    def __getitem__(self, idx) -> dict[str, np.ndarray]:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.name} dataset "
                             f"({len(self)} samples)")
        idx = int(self.shuffle_idx[idx])
        doc_f, offset_f = (int(v) for v in self.sample_idx[idx])
        doc_l, offset_l = (int(v) for v in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            sample = get(int(self.doc_idx[doc_f]), offset=offset_f,
                         length=offset_l - offset_f + 1)
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset=offset_f)]
            parts += [get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l)]
            parts.append(get(int(self.doc_idx[doc_l]), length=offset_l + 1))
            sample = np.concatenate(parts)
        return {"text": np.asarray(sample, dtype=np.int64)}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _split_specs(prefix: str, ds: MMapIndexedDataset, splits_string: str, num_samples,
                 seq_length: int):
    """(name, documents, num_samples) for each split that has documents and samples.

    A split asked for samples must hold ``seq_length + 1`` tokens (one sample), else
    ``DatasetError``; one with no documents is None (the caller decides whether that is fatal).
    """
    wanted = [n for n, k in zip(SPLIT_NAMES, num_samples) if k > 0]
    if len(ds) == 0 and wanted:
        raise DatasetError(f"the {wanted[0]} split of {prefix} is empty: {prefix} has no "
                           f"documents (0 tokens) in {index_file_path(prefix)}; was it "
                           "preprocessed from an empty input?")
    bounds = get_train_valid_test_split(splits_string, len(ds))
    logger.info(" > %s: %d documents, split %s -> %s", prefix, len(ds), splits_string,
                ", ".join(f"{n} [{bounds[i]}, {bounds[i + 1]})"
                          for i, n in enumerate(SPLIT_NAMES)))
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        docs = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)
        if not docs.size or num_samples[i] <= 0:
            out.append(None)
            continue
        tokens = int(ds.sizes[bounds[i]:bounds[i + 1]].sum(dtype=np.int64))
        if tokens < seq_length + 1:
            raise DatasetError(
                f"the {name} split of {prefix} has {_plural(docs.size, 'document')} "
                f"[{bounds[i]}, {bounds[i + 1]}) with {_plural(tokens, 'token')} in all, too "
                f"few for one sample: --seq-length {seq_length} needs {seq_length + 1} tokens "
                f"per sample; use more data, a shorter --seq-length or another --split "
                f"(now {splits_string})")
        out.append((name, docs, int(num_samples[i])))
    return out


def _no_documents(name: str, prefixes, opened, splits_string: str) -> DatasetError:
    where = "; ".join(
        f"{p} has {_plural(len(ds), 'document')}, of which --split {splits_string} gives the "
        f"{name} split [{b[0]}, {b[1]})"
        for p, ds in zip(prefixes, opened)
        for b in [get_train_valid_test_split(splits_string, len(ds))[:2]])
    return DatasetError(f"the {name} split has no documents: {where}; use more data or "
                        "another --split")


def build_train_valid_test_datasets(data_prefix: list[str], splits_string: str,
                                    train_valid_test_num_samples, seq_length: int, seed: int,
                                    cache_path: str | None = None, *, build_indices: bool = True,
                                    is_builder: bool = True,
                                    barrier: Callable[[], None] | None = None,
                                    wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
                                    vocab_size: int | None = None):
    """``(train, valid, test)`` datasets; a split with no samples is None, and so is a valid
    or test split with no documents (a train split asked for samples must have some).

    ``data_prefix`` is ``[prefix]`` or ``[w1, p1, w2, p2, ...]``. Every dataset is validated
    first, on every rank, before any barrier (so bad data stops all ranks alike, none waits):
    with ``vocab_size`` (the tokenizer's) every token id must be below it. This rank writes
    index files only when ``is_builder`` and ``build_indices`` are both true; every rank calls
    ``barrier`` once, after the builders wrote all index files and before any rank reads them.
    """
    if len(train_valid_test_num_samples) != 3:
        raise ValueError("train_valid_test_num_samples must hold 3 counts")
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    prefixes, weights, per_dataset_samples = parse_data_prefix(data_prefix,
                                                               train_valid_test_num_samples)
    opened = [MMapIndexedDataset(p) for p in prefixes]
    for ds in opened:
        validate_dataset(ds, vocab_size, cache_path=cache_path)
    specs = [_split_specs(p, ds, splits_string, n, seq_length)
             for p, ds, n in zip(prefixes, opened, per_dataset_samples)]
    for i, name in enumerate(SPLIT_NAMES):
        if int(train_valid_test_num_samples[i]) <= 0 or any(s[i] for s in specs):
            continue
        if i == 0:
            raise _no_documents(name, prefixes, opened, splits_string)
        logger.warning("the %s split has no documents (--split %s over %s); no %s data", name,
                       splits_string, ", ".join(f"{len(ds)} documents" for ds in opened),
                       name)
    # Phase 1: the builder writes every index file; phase 2: one barrier; phase 3: all load.
    index_specs = {}
    for p, ds, per_split in zip(prefixes, opened, specs):
        for item in per_split:
            if item is None:
                continue
            name, docs, n = item
            spec = IndexSpec(name, p, int(docs[0]), int(docs.size), len(ds), n, seq_length,
                             seed, cache_path)
            index_specs[(p, name)] = spec
            if is_builder and build_indices and spec.writable():
                ensure_index_files(spec, ds.sizes)
    if barrier is not None:
        barrier()
    outputs = []
    for i, name in enumerate(SPLIT_NAMES):
        parts = []
        for p, ds, per_split, w in zip(prefixes, opened, specs, weights):
            if per_split[i] is None:
                continue
            _, docs, n = per_split[i]
            parts.append((GPTDataset(name, p, docs, ds, n, seq_length, seed, cache_path,
                                     is_builder=False, wait_timeout=wait_timeout), w))
        total = int(train_valid_test_num_samples[i])
        if not parts or total <= 0:
            outputs.append(None)
        elif len(prefixes) == 1:
            outputs.append(parts[0][0])
        else:
            if len(parts) < len(prefixes):
                logger.warning("%s split: only %d of %d blended datasets have documents; "
                               "blending those", name, len(parts), len(prefixes))
            outputs.append(BlendedDataset([d for d, _ in parts], [w for _, w in parts], total))
    return tuple(outputs)


def get_ltor_batch(tokens_with_next: torch.Tensor, eod: int, reset_position_ids: bool,
                   reset_attention_mask: bool, eod_mask_loss: bool) -> dict:
    """Left-to-right LM batch from ``[b, s+1]`` tokens (Megatron's masks and position ids).

    Returns ``tokens`` and ``labels`` ``[b, s]`` (labels shifted by one), ``loss_mask``
    ``[b, s]`` float (0 where the input token is eod, with ``eod_mask_loss``),
    ``position_ids`` ``[b, s]`` (restarting after each eod with ``reset_position_ids``) and
    ``attention_mask``: ``[b, 1, s, s]`` bool, True = masked out, causal and blocking attention
    across documents, with ``reset_attention_mask``; otherwise None (plain causal).
    """
    if tokens_with_next.dim() != 2 or tokens_with_next.size(1) < 2:
        raise ValueError(f"expected tokens of shape [b, s+1] with s >= 1, got "
                         f"{tuple(tokens_with_next.shape)}")
    data = tokens_with_next.long()
    tokens = data[:, :-1].contiguous()  # [b, s]
    labels = data[:, 1:].contiguous()  # [b, s]
    b, s = tokens.shape
    device = tokens.device
    is_eod = tokens == eod  # [b, s]
    loss_mask = torch.ones((b, s), dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    arange = torch.arange(s, dtype=torch.long, device=device)
    position_ids = arange.unsqueeze(0).expand(b, s).clone()  # [b, s]
    attention_mask = None
    if reset_position_ids:
        # first position of the document holding t: one past the last eod strictly before t
        after_eod = torch.where(is_eod, arange + 1, torch.zeros_like(arange))  # [b, s]
        starts = torch.cummax(after_eod, dim=1).values
        doc_start = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, :-1]], dim=1)
        position_ids = position_ids - doc_start
    if reset_attention_mask:
        eods_before = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()  # [b, s] document no.
        same_doc = eods_before.unsqueeze(2) == eods_before.unsqueeze(1)  # [b, s(q), s(k)]
        causal = torch.ones((s, s), dtype=torch.bool, device=device).tril()
        attention_mask = ~(same_doc & causal).unsqueeze(1)  # [b, 1, s, s]
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "attention_mask": attention_mask}
