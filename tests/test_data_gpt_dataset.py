"""GPT samples: Megatron's index semantics, splits, caching across ranks, blends, LM masks."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from megazero.data import gpt_indices
from megazero.data.blended_dataset import parse_data_prefix
from megazero.data.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    get_ltor_batch,
    get_train_valid_test_split,
)
from megazero.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tests.test_data_helpers import loop_sample_idx

EOD = 7


def make_corpus(prefix, num_docs=60, base=0, seed=0):
    """Document i holds base + 1000 * i + [0, len) and ends with EOD; returns the docs."""
    rng = np.random.default_rng(seed)
    docs = []
    with MMapIndexedDatasetBuilder(prefix, np.int32) as builder:
        for i in range(num_docs):
            doc = base + 1000 * i + 10 + np.arange(rng.integers(1, 90))
            doc = np.append(doc, EOD)
            docs.append(doc)
            builder.add_document(doc)
        builder.finalize()
    return docs


def megatron_index_mappings(documents, sizes, num_samples, seq_length, seed):
    """Megatron's ``_build_index_mappings`` (without caching), typed independently."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    rng = np.random.RandomState(seed=seed)
    if num_epochs == 1:
        separate = False
    else:
        from_minus_one = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = (num_samples - from_minus_one) < int(0.80 * per_epoch)

    def doc_idx_of(epochs):
        d = np.mgrid[0:epochs, 0:len(documents)][1]
        d[:] = documents
        d = d.reshape(-1).astype(np.int32)
        rng.shuffle(d)
        return d

    doc_idx = (np.concatenate((doc_idx_of(num_epochs - 1), doc_idx_of(1))) if separate
               else doc_idx_of(num_epochs))
    sample_idx = loop_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    n = sample_idx.shape[0] - 1
    first = from_minus_one if separate else n
    shuffle_first = np.arange(first, dtype=np.uint32)
    rng.shuffle(shuffle_first)
    shuffle_last = np.arange(first, n, dtype=np.uint32)
    rng.shuffle(shuffle_last)
    return doc_idx, sample_idx, np.concatenate((shuffle_first, shuffle_last)), separate


def test_split_boundaries_match_megatron():
    assert get_train_valid_test_split("949,50,1", 100) == [0, 95, 100, 100]
    assert get_train_valid_test_split("969,30,1", 1000) == [0, 969, 999, 1000]
    assert get_train_valid_test_split("8/1/1", 10) == [0, 8, 9, 10]
    assert get_train_valid_test_split("1", 7) == [0, 7, 7, 7]
    with pytest.raises(ValueError, match="--split"):
        get_train_valid_test_split("a,b", 10)


@pytest.mark.parametrize("num_samples,seq_length", [(40, 16), (300, 16), (183, 33), (5, 512)])
def test_indices_and_samples_match_megatron(tmp_path, num_samples, seq_length):
    prefix = str(tmp_path / "corpus")
    docs = make_corpus(prefix)
    ds = MMapIndexedDataset(prefix)
    documents = np.arange(5, 50, dtype=np.int32)
    gpt = GPTDataset("train", prefix, documents, ds, num_samples, seq_length, seed=1234)
    doc_idx, sample_idx, shuffle_idx, _ = megatron_index_mappings(
        documents, ds.sizes, num_samples, seq_length, 1234)
    np.testing.assert_array_equal(gpt.doc_idx, doc_idx)
    np.testing.assert_array_equal(gpt.sample_idx, sample_idx)
    np.testing.assert_array_equal(gpt.shuffle_idx, shuffle_idx)
    assert len(gpt) >= num_samples
    stream = np.concatenate([docs[d] for d in doc_idx])
    for i in range(len(gpt)):
        j = int(shuffle_idx[i])
        text = gpt[i]["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        np.testing.assert_array_equal(text, stream[j * seq_length: j * seq_length + seq_length + 1])


def test_separate_last_epoch(tmp_path):
    prefix = str(tmp_path / "corpus")
    make_corpus(prefix, num_docs=20)
    ds = MMapIndexedDataset(prefix)
    documents = np.arange(20, dtype=np.int32)
    per_epoch = (int(ds.sizes.sum()) - 1) // 8
    num_samples = per_epoch + 3  # a second epoch contributing only 3 samples
    *_, separate = megatron_index_mappings(documents, ds.sizes, num_samples, 8, 5)
    assert separate
    gpt = GPTDataset("train", prefix, documents, ds, num_samples, 8, seed=5)
    first = ((2 - 1) * int(ds.sizes.sum()) - 1) // 8
    assert sorted(gpt.shuffle_idx[:first]) == list(range(first))
    assert sorted(gpt.shuffle_idx[first:]) == list(range(first, len(gpt)))
    assert sorted(gpt.doc_idx[:20]) == list(range(20))


def test_build_train_valid_test(tmp_path):
    prefix = str(tmp_path / "corpus")
    make_corpus(prefix)
    train, valid, test = build_train_valid_test_datasets([prefix], "80,20,0", (100, 0, 5), 16, 1)
    assert len(train) >= 100 and valid is None and test is None  # 0 samples / 0 documents
    train, valid, test = build_train_valid_test_datasets([prefix], "80,20,0", (100, 10, 0), 16, 1)
    assert valid is not None and len(valid) >= 10
    assert set(np.unique(train.doc_idx)) == set(range(48))
    assert set(np.unique(valid.doc_idx)) == set(range(48, 60))


def test_index_cache_reused_and_cache_path(tmp_path, monkeypatch):
    prefix = str(tmp_path / "data" / "corpus")
    os.makedirs(os.path.dirname(prefix))
    make_corpus(prefix)
    cache = str(tmp_path / "cache")
    first = build_train_valid_test_datasets([prefix], "90,10,0", (50, 5, 0), 16, 3, cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 6 and all(f.endswith(".npy") for f in files)
    assert not [f for f in os.listdir(tmp_path / "data") if f.endswith(".npy")]

    def fail(*args, **kwargs):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gpt_indices, "build_index_mappings", fail)
    again = build_train_valid_test_datasets([prefix], "90,10,0", (50, 5, 0), 16, 3, cache)
    for a, b in zip(first[:2], again[:2]):
        np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
        assert isinstance(b.sample_idx, np.memmap)
        clone = pickle.loads(pickle.dumps(b))  # what a spawned DataLoader worker receives
        assert isinstance(clone.sample_idx, np.memmap)
        np.testing.assert_array_equal(clone[1]["text"], b[1]["text"])
    with pytest.raises(AssertionError, match="rebuilt"):  # another split string: other files
        build_train_valid_test_datasets([prefix], "80,20,0", (50, 5, 0), 16, 3, cache)


def test_ranks_build_once_with_barrier(tmp_path):
    prefix = str(tmp_path / "corpus")
    make_corpus(prefix)
    world = 3
    barrier = threading.Barrier(world, timeout=60)
    results, errors = [None] * world, []

    def rank(r):
        try:
            if r > 0:
                time.sleep(0.05)
            results[r] = build_train_valid_test_datasets(
                [prefix], "90,10,0", (64, 8, 0), 16, 9, is_builder=(r == 0),
                barrier=barrier.wait)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in range(1, world):
        for a, b in zip(results[0][:2], results[r][:2]):
            np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
            np.testing.assert_array_equal(a[3]["text"], b[3]["text"])


def test_non_builder_waits_without_barrier(tmp_path):
    prefix = str(tmp_path / "corpus")
    make_corpus(prefix)
    ds = MMapIndexedDataset(prefix)
    docs = np.arange(60, dtype=np.int32)
    with pytest.raises(TimeoutError, match="did not appear within"):
        GPTDataset("train", prefix, docs, ds, 20, 16, 2, is_builder=False, wait_timeout=0.2)
    out = {}
    waiter = threading.Thread(target=lambda: out.setdefault(
        "ds", GPTDataset("train", prefix, docs, ds, 20, 16, 2, is_builder=False)))
    waiter.start()
    time.sleep(0.2)
    built = GPTDataset("train", prefix, docs, ds, 20, 16, 2, is_builder=True)
    waiter.join(30)
    np.testing.assert_array_equal(out["ds"].shuffle_idx, built.shuffle_idx)


def test_unwritable_folder_computes_in_memory(tmp_path, monkeypatch):
    prefix = str(tmp_path / "corpus")
    make_corpus(prefix)
    monkeypatch.setattr(gpt_indices.IndexSpec, "writable", lambda self: False)
    train, _, _ = build_train_valid_test_datasets([prefix], "1", (30, 0, 0), 16, 4,
                                                  is_builder=False)
    assert len(train) >= 30 and not [p for p in os.listdir(tmp_path) if p.endswith(".npy")]


def test_blended_datasets(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_corpus(a, num_docs=40, base=0, seed=1)
    make_corpus(b, num_docs=40, base=100000, seed=2)
    train, valid, test = build_train_valid_test_datasets(["0.3", a, "0.7", b], "90,10,0",
                                                         (1000, 20, 0), 16, 7)
    assert len(train) == 1000 and len(valid) == 20 and test is None
    from_b = [int(train[i]["text"][0] >= 100000 or train[i]["text"][1] >= 100000)
              for i in range(1000)]
    assert abs(sum(from_b) - 700) <= 2
    for i in (0, 1, 2, 500, 999):
        d, s = train.dataset_index[i], train.dataset_sample_index[i]
        np.testing.assert_array_equal(train[i]["text"], train.datasets[d][s]["text"])
    prefixes, weights, per = parse_data_prefix(["1", a, "3", b], (1000, 10, 0))
    assert prefixes == [a, b] and weights == [0.25, 0.75]
    assert per == [[252, 3, 0], [754, 8, 0]]
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_prefix(["0.3", a, b], (1, 1, 1))
    with pytest.raises(ValueError, match="weight 'x' .* is not a number"):
        parse_data_prefix(["x", a, "1", b], (1, 1, 1))


def megatron_ltor(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's ``get_ltor_masks_and_position_ids`` loop, typed independently."""
    b, s = data.size()
    att = torch.tril(torch.ones((b if reset_attention_mask else 1, s, s))).view(-1, 1, s, s)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    for i in range(b):
        eod_index = pos[i, data[i] == eod].clone()
        prev = 0
        for j in range(eod_index.size(0)):
            k = int(eod_index[j])
            if reset_attention_mask:
                att[i, 0, k + 1:, :k + 1] = 0
            if reset_position_ids:
                pos[i, k + 1:] -= k + 1 - prev
                prev = k + 1
    return att < 0.5, loss_mask, pos


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True),
                                   (True, False, True), (False, True, False)])
def test_get_ltor_batch_matches_megatron(flags):
    torch.manual_seed(0)
    data = torch.randint(0, 6, (3, 21))
    data[0, 0] = EOD
    data[1, -2] = EOD
    data[2, 5:8] = EOD
    data[2, 12] = EOD
    out = get_ltor_batch(data, EOD, *flags)
    torch.testing.assert_close(out["tokens"], data[:, :-1])
    torch.testing.assert_close(out["labels"], data[:, 1:])
    att, loss_mask, pos = megatron_ltor(data[:, :-1], EOD, *flags)
    torch.testing.assert_close(out["loss_mask"], loss_mask)
    torch.testing.assert_close(out["position_ids"], pos)
    if flags[1]:
        assert out["attention_mask"].dtype == torch.bool
        torch.testing.assert_close(out["attention_mask"], att)
    else:
        assert out["attention_mask"] is None
