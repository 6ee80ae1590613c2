"""Data wiring of the training loop: tokenizer, default corpus, loaders sharded over dp.

Part of ``training`` (the one place that joins data and parallelism): rank 0 builds the
default corpus while the others wait, each data-parallel rank gets its slice of every global
batch through the pretraining sampler (driven by consumed samples, so a resume continues with
exactly the next samples), and batches are turned into model inputs (tokens, labels, loss mask,
position ids, attention mask) here. ``--mock-data`` gives deterministic random tokens.
``--data-path`` datasets are validated against the tokenizer at setup (``gpt_dataset``).
"""

from __future__ import annotations

import logging

import torch

from megazero.data.default_corpus import build_default_corpus
from megazero.data.gpt_dataset import build_train_valid_test_datasets, get_ltor_batch
from megazero.data.mock import MockGPTDataset
from megazero.data.samplers import build_pretraining_data_loader
from megazero.distributed import comm
from megazero.distributed.device import host_side
from megazero.distributed.parallel_state import ParallelState
from megazero.tokenizer import build_tokenizer
from megazero.tokenizer.null import NullTokenizer

logger = logging.getLogger(__name__)


def prepare_tokenizer(config, ps: ParallelState):
    """Build the tokenizer (the default corpus first when no data is given); sets
    ``config.model.vocab_size`` from it."""
    d = config.data
    if d.tokenizer_type == "NullTokenizer":  # Megatron's: ids < vocab_size, eod = vocab_size
        tokenizer = NullTokenizer(d.vocab_size + 1)
    elif d.mock_data:
        tokenizer = NullTokenizer(d.vocab_size)
    else:
        if not d.data_path and d.tokenizer_type is None:
            corpus = _default_corpus(d.default_corpus_dir, ps)
            d.data_path = [corpus.data_prefix]
            d.tokenizer_type = corpus.tokenizer_type
            d.tokenizer_model = corpus.tokenizer_model
        tokenizer = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file,
                                    merge_file=d.merge_file, tokenizer_model=d.tokenizer_model,
                                    make_vocab_size_divisible_by=(
                                        config.model.make_vocab_size_divisible_by),
                                    tensor_model_parallel_size=ps.tp_size)
    config.model.vocab_size = tokenizer.vocab_size
    return tokenizer


def _default_corpus(cache_dir, ps):
    if ps.rank == 0:
        corpus = build_default_corpus(cache_dir)
    comm.barrier(ps.world_group)
    if ps.rank != 0:
        corpus = build_default_corpus(cache_dir)  # cached by now: only reads
    return corpus


def default_datasets_provider(config, tokenizer, num_samples, ps: ParallelState):
    """GPT datasets from ``--data-path`` (or mock data), as Megatron's provider builds them.

    Every rank validates the data before the first barrier (token ids below the tokenizer's
    true vocabulary size, enough tokens per split; cached beside the index), so bad data
    stops every rank with the same error instead of leaving the others waiting."""
    d, m = config.data, config.model
    if d.mock_data:
        return tuple(MockGPTDataset(n, m.seq_length, tokenizer.vocab_size,
                                    config.train.seed + k) if n > 0 else None
                     for k, n in enumerate(num_samples))
    return build_train_valid_test_datasets(
        d.data_path, d.split, tuple(num_samples), m.seq_length, config.train.seed,
        d.data_cache_path, barrier=lambda: comm.barrier(ps.world_group),
        is_builder=ps.rank == 0, vocab_size=tokenizer.vocab_size)


class BatchIterator:
    """Iterates model-ready micro-batches of one dp rank, from ``consumed_samples`` on.

    ``cyclic`` restarts at the beginning when exhausted (validation); ``reset()`` goes back to
    the start (every evaluation sees the same batches, so a resumed run evaluates alike).
    """

    def __init__(self, dataset, config, ps, tokenizer, consumed_samples=0, cyclic=False):
        self.dataset, self.config, self.ps = dataset, config, ps
        self.eod = tokenizer.eod
        self.cyclic = cyclic
        self.reset(consumed_samples)

    def reset(self, consumed_samples: int = 0):
        t = self.config.train
        self.loader = build_pretraining_data_loader(
            self.dataset, consumed_samples, t.micro_batch_size, self.ps.dp_rank, self.ps.dp_size,
            num_workers=self.config.data.num_workers)
        # Creating a DataLoader iterator draws a seed from torch's default generator; keep
        # that out of the training RNG stream so a resumed run draws the same dropout masks.
        with torch.random.fork_rng(devices=[]), host_side():
            self._it = iter(self.loader)

    def __iter__(self):
        return self

    def _next_host_batch(self) -> dict:
        try:
            raw = next(self._it)
        except StopIteration:
            if not self.cyclic:
                raise
            self.reset(0)
            raw = next(self._it)
        d = self.config.data
        return get_ltor_batch(raw["text"].long(), self.eod, d.reset_position_ids,
                              d.reset_attention_mask, d.eod_mask_loss)

    def __next__(self):
        with host_side():  # samples are read on the host, real also in the dry run
            batch = self._next_host_batch()
        return {k: to_device(v, self.ps.device) if torch.is_tensor(v) else v
                for k, v in batch.items()}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor on the rank's device without the host waiting: on a GPU from
    page-locked memory with ``non_blocking`` (a copy from pageable memory waits for the
    stream); the dry run's fake CUDA has no page-locked memory but makes the same call."""
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def build_data_iterators(provider, config, ps, tokenizer, train_iters, consumed_samples):
    """(train, valid, test) iterators; a list of identical ones per virtual pipeline chunk."""
    t = config.train
    gbs = t.global_batch_size
    eval_samples = t.eval_iters * gbs
    train_samples = t.train_samples if t.rampup_batch_size is not None else train_iters * gbs
    datasets = provider(config, tokenizer, (train_samples, eval_samples, eval_samples), ps)
    iterators = []
    for k, ds in enumerate(datasets):
        if ds is None:
            iterators.append(None)
            continue
        start = consumed_samples if k == 0 else 0
        make = lambda ds=ds, start=start, k=k: BatchIterator(ds, config, ps, tokenizer,  # noqa
                                                             start, cyclic=k > 0)
        v = ps.virtual_pp_size or 1
        iterators.append(make() if v == 1 else _MultiIterator([make() for _ in range(v)]))
    return tuple(iterators)


class _MultiIterator(list):
    """One iterator per virtual chunk (each yields the same micro-batches)."""

    def reset(self, consumed_samples: int = 0):
        for it in self:
            it.reset(consumed_samples)
