"""Text generation: sampling filters, determinism, tp=1 (one process) equals tp=2 (two ranks)."""

import math

import pytest
import torch

from megazero.inference.generate import filter_logits, run, sample
from tests.common import assert_close
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, run_training


def _kept(logits):
    return [i for i, v in enumerate(logits.tolist()) if v != -math.inf]


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.10, 0.50, 0.05, 0.35],
                          [0.05, 0.15, 0.60, 0.20]])
    logits = probs.log()
    # row 0 by probability: 1 (0.50), 3 (0.35), 0 (0.10), 2 (0.05); cumulative .5 .85 .95 1
    for p, expect in [(0.3, [1]), (0.8, [1, 3]), (0.9, [0, 1, 3]), (0.99, [0, 1, 2, 3])]:
        assert _kept(filter_logits(logits, top_p=p)[0]) == expect, p
    # row 1 by probability: 2 (0.60), 3 (0.20), 1 (0.15), 0 (0.05); cumulative .6 .8 .95 1
    assert _kept(filter_logits(logits, top_p=0.7)[1]) == [2, 3]
    assert _kept(filter_logits(logits, top_p=0.9)[1]) == [1, 2, 3]
    assert _kept(filter_logits(logits, top_p=1.0)[1]) == [0, 1, 2, 3]
    # the kept ids keep their logits; top-k then top-p compose
    out = filter_logits(logits, top_k=2, top_p=0.99)
    assert _kept(out[0]) == [1, 3] and _kept(out[1]) == [2, 3]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_top_k_one_is_greedy_and_sampling_is_seeded():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    greedy = sample(logits, greedy=True)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(sample(logits, top_k=1, temperature=0.7, generator=g), greedy)
    draw = lambda: sample(logits, top_p=0.9, generator=torch.Generator().manual_seed(5))  # noqa
    assert torch.equal(draw(), draw())
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, temperature=0.0)


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """tp=2 run saved after 2 and 3 iterations; a wide init makes the greedy path varied (top-2
    logit gaps of 2e-3 and more, far above the ~1e-6 rounding differences between tp=1 and
    tp=2, so the comparison is meaningful and stable)."""
    path = tmp_path_factory.mktemp("gen")
    run_training(TINY + f" --train-iters 3 --init-method-std 0.5 --tensor-model-parallel-size "
                 f"2 --save {path} --save-interval 2", 2)
    return str(path)


def _generate(argv):
    return run(argv)


GREEDY = ["--prompt", "5 17 42 8", "--max-new-tokens", "8", "--greedy", "--ignore-eod"]


def test_greedy_is_deterministic_and_layout_free(tp2_checkpoint):
    argv = ["--load", tp2_checkpoint] + GREEDY
    one = run(argv)  # this process, tp=1 (resharded from the tp=2 files)
    assert one["prompt_ids"] == [5, 17, 42, 8] and len(one["ids"]) == 8
    assert len(set(one["ids"])) > 2, one["ids"]
    assert run(argv)["ids"] == one["ids"]
    two = run_distributed(_generate, 2, argv)  # two ranks, tp=2 (the saved layout)
    assert [r["ids"] for r in two] == [one["ids"], one["ids"]]
    topk1 = run(["--load", tp2_checkpoint, "--prompt", "5 17 42 8", "--max-new-tokens", "8",
                 "--top-k", "1", "--temperature", "0.5", "--ignore-eod"])
    assert topk1["ids"] == one["ids"]


def test_sampling_is_reproducible_and_context_is_cut(tp2_checkpoint):
    # 4 prompt tokens + 20 new ones exceed max_position_embeddings (16): the context is cut
    # from the left (else the position embedding lookup would fail)
    argv = ["--load", tp2_checkpoint, "--prompt", "1 2 3 4", "--max-new-tokens", "20",
            "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "7",
            "--ignore-eod"]
    a = run(argv)
    assert len(a["ids"]) == 20 and all(0 <= i < 96 for i in a["ids"])
    assert run(argv)["ids"] == a["ids"]
    b = run(argv[:-2] + ["8", "--ignore-eod"])
    assert b["ids"] != a["ids"]
    older = run(["--load", tp2_checkpoint, "--iteration", "2"] + GREEDY)  # not the tracker's
    assert len(older["ids"]) == 8


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             group_query_attention=True, num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)


def kv_cache_case(tp, family=None):
    """Logits of every position: the whole sequence at once vs the prompt, then a chunk of
    several positions, then one position at a time through the KV cache (``family``: extra
    ModelConfig fields, e.g. the Llama family's)."""
    from megazero.config import ModelConfig
    from megazero.distributed.parallel_state import ParallelState
    from megazero.inference.generate import next_logits
    from megazero.model import GPTModel, KVCache

    ps = ParallelState.build(tp_size=tp)
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=90,
                      make_vocab_size_divisible_by=8, seq_length=16,
                      max_position_embeddings=16, init_method_std=0.3, **(family or {}))
    model = GPTModel(cfg, ps, seed=11).eval()
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(3))
    full = [next_logits(model, ps, ids[:, :n], 90) for n in range(1, 17)]
    cache, got = KVCache(16), []
    for a, b in [(0, 5), (5, 9)] + [(n, n + 1) for n in range(9, 16)]:
        got.append(next_logits(model, ps, ids[:, a:b], 90, cache))
    assert cache.offset == 16
    want = [full[b - 1] for _, b in [(0, 5), (5, 9)] + [(n, n + 1) for n in range(9, 16)]]
    for i, (g, w) in enumerate(zip(got, want)):
        # the cache attends over other lengths (other reduction orders): fp32 rounding relative
        # to the logits' scale (up to ~5 here; 3e-6 of it seen), a wrong offset is off by O(1)
        scale = max(1.0, w[w.isfinite()].abs().max().item())
        assert_close(g, w, rtol=1e-5, atol=1e-5 * scale, what=f"step {i}")
    with pytest.raises(ValueError, match="cannot hold 17"):
        next_logits(model, ps, ids[:, :1], 90, cache)
    return True


def test_kv_cache_matches_the_full_forward_tp1():
    assert kv_cache_case(1)


def test_kv_cache_matches_the_full_forward_tp2():
    assert all(run_distributed(kv_cache_case, 2, 2))


def test_kv_cache_matches_the_full_forward_llama_family():
    """RoPE at the cached offsets, grouped key/value heads in the cache, untied output."""
    assert kv_cache_case(1, LLAMA)
    assert all(run_distributed(kv_cache_case, 2, 2, LLAMA))


def test_cli_with_and_without_kv_cache_agree(tp2_checkpoint):
    greedy = ["--load", tp2_checkpoint] + GREEDY
    assert run(greedy)["ids"] == run(greedy + ["--no-kv-cache"])["ids"]
    # sampling past max_position_embeddings: the cache serves the first 16 positions, then
    # the cut context is recomputed at every step
    argv = ["--load", tp2_checkpoint, "--prompt", "1 2 3 4", "--max-new-tokens", "20",
            "--temperature", "0.9", "--top-k", "20", "--seed", "7", "--ignore-eod"]
    assert run(argv)["ids"] == run(argv + ["--no-kv-cache"])["ids"]
