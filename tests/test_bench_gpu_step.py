"""The GPU step benchmark's CPU-checkable parts (benchmarks/bench_gpu_step.py, gpt2_plain.py,
gpu_step_jobs.py, count_launches.py):

* the plain PyTorch GPT-2 is megazero's GPT-2: with megazero's weights copied in, its logits,
  loss and every gradient equal megazero's (fp32, 1e-5); its initial weights have megazero's
  distributions; its training step (micro-batches accumulated, clipped, AdamW) equals the
  full-batch step written out by hand;
* the CPU smoke run (``--device cpu --tiny``) writes JSON of the schema bench_schema.md gives,
  with tokens/s and TFLOP/s by megazero's FLOP formula; without CUDA every row is skipped;
  a spent budget skips with the reason; rounds rotate the order;
* count_launches.py counts the plain GPT-2 (and Megatron-core's, when installed) on fake CUDA:
  launches by phase, flash attention as a GPU runs it, the fused AdamW, no host sync.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_gpu_step, gpt2_plain, gpu_step_jobs
from benchmarks.megatron_core_gpt import import_error as megatron_core_missing
from megazero.config import ModelConfig
from megazero.distributed.parallel_state import ParallelState
from megazero.model import build_gpt_model_chunks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, H, NH, S, V = 2, 32, 4, 16, 100


def megazero_gpt2(num_layers=L, hidden=H, heads=NH, seq=S, vocab=V, seed=1):
    cfg = ModelConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                      seq_length=seq, vocab_size=vocab, attention_dropout=0.0,
                      hidden_dropout=0.0)
    (model,) = build_gpt_model_chunks(cfg, ParallelState.build(), seed=seed)
    return model


def plain_name(name: str) -> str:
    """megazero's parameter name -> the plain GPT-2's."""
    for a, b in (("embedding.word_embeddings", "wte"), ("embedding.position_embeddings", "wpe"),
                 ("layers.", "blocks."), ("input_layernorm", "ln_1"),
                 ("post_attention_layernorm", "ln_2"), ("attention.qkv", "attn.c_attn"),
                 ("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"),
                 ("mlp.fc2", "mlp.c_proj"), ("final_layernorm", "ln_f")):
        name = name.replace(a, b)
    return name


def plain_tensor(name: str, t: torch.Tensor, heads: int = NH) -> torch.Tensor:
    """megazero's qkv rows are [head, (q, k, v), hn]; nanoGPT's [(q, k, v), head, hn]."""
    if "attention.qkv" in name:
        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return t


def test_plain_gpt2_equals_megazeros_gpt2():
    mz = megazero_gpt2()
    plain = gpt2_plain.GPT2(gpt2_plain.GPT2Config(num_layers=L, hidden_size=H, num_heads=NH,
                                                  seq_length=S, vocab_size=V))
    assert plain.wte.weight.shape == mz.embedding.word_embeddings.weight.shape == (128, H)
    plain.load_state_dict({plain_name(n): plain_tensor(n, p.detach())
                           for n, p in mz.named_parameters()}, strict=True)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, V, (3, S), generator=g), torch.randint(0, V, (3, S), generator=g)
    pos = torch.arange(S).expand(3, S)
    torch.testing.assert_close(plain(ids), mz(ids, pos)[..., :V], rtol=1e-5, atol=1e-5)
    loss_mz, loss_plain = mz(ids, pos, labels=labels).mean(), plain(ids, labels)
    torch.testing.assert_close(loss_plain, loss_mz, rtol=1e-5, atol=1e-5)
    loss_mz.backward()
    loss_plain.backward()
    grads = dict(plain.named_parameters())
    for n, p in mz.named_parameters():
        torch.testing.assert_close(grads[plain_name(n)].grad, plain_tensor(n, p.grad),
                                   rtol=1e-5, atol=1e-6 * p.grad.abs().max().item(), msg=n)


def test_plain_gpt2_initial_weights_have_megazeros_distributions():
    layers, hidden = 4, 128
    mz = megazero_gpt2(num_layers=layers, hidden=hidden, heads=4, vocab=1000)
    plain = gpt2_plain.GPT2(gpt2_plain.GPT2Config(num_layers=layers, hidden_size=hidden,
                                                  num_heads=4, seq_length=S, vocab_size=1000))
    ours = dict(plain.named_parameters())
    for n, p in mz.named_parameters():
        q = ours[plain_name(n)]
        assert q.shape == p.shape, n
        torch.testing.assert_close(q.mean(), p.mean(), atol=2e-3, rtol=0, msg=n)
        torch.testing.assert_close(q.std(), p.std(), rtol=0.05, atol=1e-7, msg=n)


def test_plain_train_step_is_the_full_batch_step():
    """Two micro-batches of 2 accumulate the full batch's mean-loss gradient; clipping at 0.01
    (below the norm) and AdamW as written out here."""
    cfg = gpt2_plain.GPT2Config(num_layers=L, hidden_size=H, num_heads=NH, seq_length=S,
                                vocab_size=V)
    torch.manual_seed(0)
    model = gpt2_plain.GPT2(cfg)
    ref = gpt2_plain.GPT2(cfg)
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, V, (4, S), generator=g), torch.randint(0, V, (4, S), generator=g)
    # eps 1e-3: Adam's first step is ~sign(grad); eps keeps it smooth for the near-zero ones
    opt = gpt2_plain.make_optimizer(model, lr=1e-2, weight_decay=0.1, eps=1e-3)
    loss = gpt2_plain.train_step(model, opt, [(ids[:2], labels[:2]), (ids[2:], labels[2:])],
                                 amp_dtype=torch.float32, clip_grad=0.01)
    full = ref(ids, labels)
    full.backward()
    torch.testing.assert_close(loss, full.detach(), rtol=1e-5, atol=1e-6)
    params = list(ref.parameters())
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    assert norm > 0.01
    with torch.no_grad():
        for p in params:  # AdamW, step 1: m/(sqrt(v)+eps) with bias correction = sign-like
            grad = p.grad * (0.01 / (norm + 1e-6))
            m, v = 0.1 * grad, 0.001 * grad * grad
            update = (m / 0.1) / ((v / 0.001).sqrt() + 1e-3)
            p.mul_(1 - 1e-2 * (0.1 if p.dim() >= 2 else 0.0)).sub_(1e-2 * update)
    for (n, a), b in zip(model.named_parameters(), params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
        assert a.grad is None, n  # zero_grad(set_to_none=True)


# --------------------------------------------------------------------- bench_gpu_step.py
def check_schema(doc: dict) -> None:
    """bench_schema.md: the top level and every row, keys and types."""
    assert set(doc) == {"schema", "date", "device", "gpu_count", "torch", "cuda", "peak_tflops",
                        "results"}
    assert doc["schema"] == "megazero.bench_gpu_step/1"
    assert len(doc["date"]) == 10 and doc["date"][4] == "-"
    assert isinstance(doc["device"], str) and isinstance(doc["gpu_count"], int)
    for row in doc["results"]:
        assert tuple(row) == bench_gpu_step.ROW_KEYS
        assert row["contender"] in ("megazero", "plain-gpt2", "megatron-core")
        assert row["variant"] in ("eager", "compile")
        assert row["model"] in ("gpt2-345m", "gpt2-1.3b") and row["dtype"] == "bf16"
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "vocab_size", "micro_batch_size", "global_batch_size", "iterations"):
            assert isinstance(row[key], int), key
        status = row["status"]
        assert status in ("ok", "oom") or status.startswith(("failed: ", "skipped: ")), status
        measured = ("iter_ms", "tokens_per_s", "model_tflops_per_s", "first_iter_s",
                    "launches_per_iter", "gpu_busy")
        if status == "ok":
            assert row["iterations"] > 0
            for key in measured:
                assert isinstance(row[key], (int, float)) and row[key] > 0, key
            assert isinstance(row["launches_per_iter"], int) and 0 < row["gpu_busy"] <= 1
        else:
            assert all(row[key] is None for key in measured)


def megatron_flops(b, s, layers, h, v):
    """72 B s L h^2 (1 + s/6h + V/12Lh): Megatron's model FLOPs, worked out here."""
    return 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def test_cpu_smoke_run_writes_the_schema(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu_step.py", "--device", "cpu", "--tiny",
         "--contenders", "megazero:eager,plain-gpt2:eager,megatron-core", "--models",
         "gpt2-345m", "--warmup", "1", "--iters", "2", "--rounds", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    check_schema(doc)
    rows = {(r["contender"], r["variant"]): r for r in doc["results"]}
    assert list(rows) == [("megazero", "eager"), ("megatron-core", "eager"),
                          ("plain-gpt2", "eager")]
    assert rows["megatron-core", "eager"]["status"].startswith("skipped: ")
    tiny = bench_gpu_step.TINY["gpt2-345m"]
    flops = megatron_flops(4, tiny["seq_length"], 2, tiny["hidden_size"], 512)
    for key in (("megazero", "eager"), ("plain-gpt2", "eager")):
        r = rows[key]
        assert r["status"] == "ok", r
        assert (r["num_layers"], r["vocab_size"], r["micro_batch_size"]) == (2, 512, 2)
        assert r["iterations"] == 2 and r["mfu"] is None and r["peak_mem_gib"] is None
        seconds = r["iter_ms"] / 1e3
        assert r["tokens_per_s"] == pytest.approx(4 * tiny["seq_length"] / seconds)
        assert r["model_tflops_per_s"] == pytest.approx(flops / seconds / 1e12)
    assert "megazero:eager" in done.stdout and "tokens/s" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_every_row_is_skipped(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_gpu_step.main(["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    check_schema(doc)
    assert len(doc["results"]) == 10  # 5 contenders x 2 models
    assert {r["status"] for r in doc["results"]} == {"skipped: no CUDA device"}
    assert doc["gpu_count"] == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_a_spent_budget_skips_with_the_reason(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_gpu_step.main(["--device", "cpu", "--tiny", "--budget-s", "5", "--json",
                                str(out)]) == 0
    doc = json.loads(out.read_text())
    check_schema(doc)
    statuses = [r["status"] for r in doc["results"]]
    assert statuses and all(s.startswith("skipped: budget spent (") for s in statuses), statuses


def test_rounds_rotate_the_order():
    jobs = ["a", "b", "c"]
    assert [bench_gpu_step.round_order(jobs, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_refused_compile_flag_is_reported(monkeypatch):
    spec = {**bench_gpu_step.TINY["gpt2-345m"], "warmup": 1, "iters": 1}
    megazero_args = gpu_step_jobs.megazero_args
    monkeypatch.setattr(gpu_step_jobs, "megazero_args", lambda s, mb, c: megazero_args(
        s, mb, False) + (["--no-such-compile-flag"] if c else []))
    assert bench_gpu_step.megazero_compile_refused(spec).startswith("--compile not available (")


def test_busy_time_is_the_union_of_intervals():
    assert gpu_step_jobs.union_length([(5, 6), (0, 2), (1, 3), (2.5, 2.8)]) == 4
    assert gpu_step_jobs.union_length([]) == 0


# --------------------------------------------------------------------- count_launches.py
def test_count_launches_of_the_peers_on_fake_cuda(tmp_path):
    out = tmp_path / "counts.json"
    contenders = "plain-gpt2" + ("" if megatron_core_missing() else ",megatron-core")
    done = subprocess.run(
        [sys.executable, "benchmarks/count_launches.py", "--contenders", contenders,
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--vocab-size", "500", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["contender"]: r for r in json.loads(out.read_text())["results"]}
    plain = rows["plain-gpt2"]
    assert plain["status"] == "ok" and plain["iteration"] == 2
    phases = plain["launches_by_phase"]
    assert set(phases) == {"forward", "backward", "optimizer"}, phases
    assert plain["kernel_launches"] == sum(phases.values()) > 0
    assert plain["host_syncs"] == 0
    ops = plain["launches_by_op"]
    # 2 layers x 2 micro-batches of flash attention (its backward: 3 kernels each), one fused
    # AdamW launch per parameter group, the grad norm and clip multi-tensor too
    assert ops["aten._scaled_dot_product_flash_attention.default"] == 4
    assert ops["aten._scaled_dot_product_flash_attention_backward.default"] == 12
    assert ops["aten._fused_adamw_.default"] == 2
    assert ops["aten._foreach_norm.Scalar"] >= 1 and "plain-gpt2" in done.stdout
    if "megatron-core" in rows:
        mc = rows["megatron-core"]
        assert mc["status"] == "ok", mc
        assert {"forward", "backward", "optimizer"} <= set(mc["launches_by_phase"])
        assert mc["launches_by_op"]["aten.baddbmm.default"] == 4  # unfused attention
        assert mc["host_syncs"] == 1 and "get_grad_norm_fp32" in mc["syncs"][0]["where"]
        assert math.isfinite(mc["kernel_launches"]) and mc["kernel_launches"] > 0
