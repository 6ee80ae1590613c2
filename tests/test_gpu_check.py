"""scripts/gpu_check.sh and its report helper, on CPU: the FLOP, tokens/s and MFU arithmetic
of scripts/gpu_check_report.py against numbers worked out here from the matrix products of a
GPT-2 layer, the loss comparison of the parity step, and the script itself end to end (GPU steps
SKIP, exit 0; a failing step gives exit 1)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megazero.arguments import parse_args
from megazero.training.log import flops_per_iteration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

_spec = importlib.util.spec_from_file_location("gpu_check_report",
                                               ROOT / "scripts" / "gpu_check_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

# GPT-2 345M on a 50304-token (padded) vocabulary, 8 sequences per iteration
L, H, S, V, B = 24, 1024, 1024, 50304, 8


def log_line(it, iters, ms, batch, loss):
    """A line as megazero.training.log prints it (Megatron's, plus tokens/s and TFLOP/s)."""
    return (f" iteration {it:8d}/{iters:8d} | consumed samples: {it * batch:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000E-04 |"
            f" global batch size: {batch:5d} | lm loss: {loss:.6E} | loss scale: 1.0 |"
            f" grad norm: 1.234 | number of skipped iterations:   0 |"
            f" number of nan iterations:   0 | tokens per second: 1.0 | TFLOP/s per rank: 1.0 |")


def make_log(ms=(900.0, 400.0, 420.0, 380.0), losses=(8.3, 7.9, 7.5, 7.2), iters=40,
             batch=B, vocab_line=f"> building tokenizer: vocab size 50257, padded to {V}"):
    lines = ["setup done in 1.0 s", vocab_line] if vocab_line else []
    interval = iters // len(ms)
    lines += [log_line(interval * (i + 1), iters, m, batch, loss)
              for i, (m, loss) in enumerate(zip(ms, losses))]
    return "\n".join(lines) + "\n"


def model_flops_by_hand(b, s, layers, h, v):
    """Forward matmul FLOPs (2 per multiply-add) of GPT-2, times 3 for forward + backward."""
    per_layer = (2 * b * s * h * 3 * h      # QKV projection
                 + 2 * b * s * s * h        # scores Q K^T
                 + 2 * b * s * s * h        # probabilities x V
                 + 2 * b * s * h * h        # attention output projection
                 + 2 * b * s * h * 4 * h    # MLP h -> 4h
                 + 2 * b * s * 4 * h * h)   # MLP 4h -> h
    logits = 2 * b * s * h * v
    return 3 * (layers * per_layer + logits)


def test_flops_match_the_matrix_products():
    assert report.flops_per_iteration(B, S, L, H, V) == pytest.approx(
        model_flops_by_hand(B, S, L, H, V), rel=1e-12)
    assert report.flops_per_iteration(16, 256, 4, 256, 4096) == pytest.approx(
        model_flops_by_hand(16, 256, 4, 256, 4096), rel=1e-12)


def test_the_log_lines_flops_are_the_matrix_products():
    """megazero.training.log's TFLOP/s per rank uses the same count (and, with recompute,
    one more forward of the transformer layers but not of the output layer)."""
    config = parse_args(f"--num-layers {L} --hidden-size {H} --num-attention-heads 16 "
                        f"--seq-length {S} --global-batch-size {B}".split())
    config.model.vocab_size = V
    assert flops_per_iteration(config) == pytest.approx(model_flops_by_hand(B, S, L, H, V),
                                                        rel=1e-12)
    config.model.recompute_activations = True
    logits = 3 * 2 * B * S * H * V
    assert flops_per_iteration(config) == pytest.approx(
        (model_flops_by_hand(B, S, L, H, V) - logits) * 4 / 3 + logits, rel=1e-12)


def test_throughput_and_mfu_of_a_synthetic_log():
    t = report.throughput(make_log(), layers=L, hidden=H, seq=S, device_name="NVIDIA H200",
                          env={})
    ms = (400.0 + 420.0 + 380.0) / 3  # the first line is warm-up
    assert t["lines_used"] == 3 and t["vocab"] == V and t["global_batch"] == B
    assert t["elapsed_ms"] == pytest.approx(ms)
    assert t["tokens_per_s"] == pytest.approx(B * S / (ms / 1000))
    flops = model_flops_by_hand(B, S, L, H, V)
    assert t["tflops"] == pytest.approx(flops / (ms / 1000) / 1e12)
    assert t["mfu"] == pytest.approx(flops / (ms / 1000) / 989e12)
    assert (t["first_loss"], t["last_loss"], t["iterations"]) == (8.3, 7.2, 40)
    # two GPUs: the same FLOP/s over twice the peak
    t2 = report.throughput(make_log(), layers=L, hidden=H, seq=S, device_name="NVIDIA H100 80GB",
                           gpus=2, env={}, warmup_lines=0)
    ms_all = (900.0 + 400.0 + 420.0 + 380.0) / 4
    assert t2["mfu"] == pytest.approx(flops / (ms_all / 1000) / (2 * 989e12))


def test_throughput_row_text():
    status, detail = report.throughput_row(make_log(), layers=L, hidden=H, seq=S,
                                           device_name="NVIDIA H200", expect_iters=40,
                                           require_loss_drop=True, env={})
    tokens = B * S / 0.4
    mfu = model_flops_by_hand(B, S, L, H, V) / 0.4 / 989e12
    assert status == "PASS", detail
    assert f"{tokens:,.0f} tok/s" in detail and "400.0 ms/it" in detail
    assert f"MFU {100 * mfu:.3g}% of 989 TF" in detail and "loss 8.300->7.200" in detail


@pytest.mark.parametrize("name,env,peak", [
    ("NVIDIA H200", {}, 989e12), ("NVIDIA H100 80GB HBM3", {}, 989e12),
    ("NVIDIA A100-SXM4-80GB", {}, 312e12), ("Tesla T4", {}, None), ("cpu", {}, None),
    ("Tesla T4", {"PEAK_TFLOPS": "65"}, 65e12), ("NVIDIA H100 PCIe", {"PEAK_TFLOPS": "756"},
                                                 756e12)])
def test_peak_from_device_name_or_env(name, env, peak):
    assert report.peak_flops(name, env) == peak


def test_unknown_gpu_reports_mfu_na_and_still_passes():
    status, detail = report.throughput_row(make_log(), layers=L, hidden=H, seq=S,
                                           device_name="Tesla T4", env={})
    assert status == "PASS" and "MFU n/a (set PEAK_TFLOPS)" in detail


def test_vocab_from_megatron_line_or_argument():
    megatron = " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"
    assert report.padded_vocab_size(make_log(vocab_line=megatron)) == 50304
    assert report.throughput(make_log(vocab_line=None), layers=L, hidden=H, seq=S,
                             vocab=V, env={})["vocab"] == V
    status, detail = report.throughput_row(make_log(vocab_line=None), layers=L, hidden=H,
                                           seq=S, env={})
    assert status == "FAIL" and "--vocab-size" in detail


@pytest.mark.parametrize("log,kwargs,why", [
    (make_log(iters=40), {"expect_iters": 50}, "expected 50"),
    (make_log(losses=(8.3, 7.9, float("nan"), 7.2)), {}, "non-finite lm loss"),
    (make_log(losses=(8.3, 8.4, 8.5, 8.6)), {"require_loss_drop": True}, "did not fall"),
    ("no training here\n", {}, "no ' iteration"),
])
def test_throughput_row_fails(log, kwargs, why):
    status, detail = report.throughput_row(log, layers=L, hidden=H, seq=S, env={}, **kwargs)
    assert status == "FAIL" and why in detail


def test_parity_rows():
    base = make_log(losses=(8.3, 7.9, 7.5, 7.2))
    assert report.parity_row(base, base)[0] == "PASS"
    near = make_log(losses=(8.3, 7.9, 7.5 * (1 + 5e-5), 7.2))
    status, detail = report.parity_row(base, near)
    assert status == "PASS" and "at iteration 30" in detail
    far = make_log(losses=(8.3, 7.9, 7.5 * (1 + 3e-4), 7.2))
    status, detail = report.parity_row(base, far, rtol=1e-4)
    assert status == "FAIL" and "at iteration 30" in detail
    assert report.parity_row(base, make_log(losses=(8.3, 7.9, float("nan"), 7.2)))[0] == "FAIL"
    # a run that stopped early, or printed nothing
    assert report.parity_row(base, make_log(ms=(1.0, 1.0), losses=(8.3, 7.9)))[0] == "FAIL"
    assert report.parity_row("", base)[0] == "FAIL"
    # lines printed twice (several ranks) count once
    assert report.parity_row(base, base + base)[0] == "PASS"


def test_command_line_prints_one_row(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(make_log())
    assert report.main(["throughput", str(log), "--num-layers", str(L), "--hidden-size", str(H),
                        "--seq-length", str(S), "--device-name", "NVIDIA A100",
                        "--expect-iters", "40"]) == 0
    status, detail = capsys.readouterr().out.strip().split("\t")
    assert status == "PASS" and "of 312 TF" in detail
    report.main(["parity", str(log), str(tmp_path / "missing.log")])
    status, detail = capsys.readouterr().out.strip().split("\t")
    assert status == "FAIL" and "cannot read log" in detail


def bench_doc(statuses=None, mz_mfu=0.2):
    """bench_gpu_step.py's JSON: megazero eager and a compiled plain GPT-2 at two sizes."""
    statuses = statuses or {}
    rows = []
    for model, tok in (("gpt2-345m", 100_000.0), ("gpt2-1.3b", 30_000.0)):
        for contender, variant, factor in (("megazero", "eager", 1.0),
                                           ("plain-gpt2", "compile", 1.5),
                                           ("megatron-core", "eager", 0.8)):
            status = statuses.get((contender, model), "ok")
            ok = status == "ok"
            rows.append({"contender": contender, "variant": variant, "model": model,
                         "micro_batch_size": 8 if model == "gpt2-345m" else 4, "status": status,
                         "tokens_per_s": tok * factor if ok else None,
                         "mfu": mz_mfu * factor if ok and mz_mfu is not None else None})
    return {"schema": "megazero.bench_gpu_step/1", "results": rows}


def test_bench_row():
    status, detail = report.bench_row(bench_doc())
    assert status == "PASS", detail
    assert "megazero 345m (mb 8): 100,000 tok/s, MFU 20%" in detail
    assert "megazero 1.3b (mb 4): 30,000 tok/s, MFU 20%" in detail
    assert "best peer 345m: plain-gpt2:compile 150,000 tok/s" in detail
    assert "best peer 1.3b: plain-gpt2:compile 45,000 tok/s" in detail
    assert "MFU n/a" in report.bench_row(bench_doc(mz_mfu=None))[1]
    # a peer that is not installed, or megazero out of memory at one size: still PASS
    assert report.bench_row(bench_doc({("megatron-core", "gpt2-345m"): "skipped: not "
                                       "importable", ("megazero", "gpt2-1.3b"): "oom"}))[0] \
        == "PASS"
    status, detail = report.bench_row(bench_doc({("megazero", "gpt2-1.3b"): "failed: exit 1"}))
    assert status == "FAIL" and "failed: megazero:eager 1.3b" in detail
    nothing = {(c, m): "skipped: no CUDA device" for c in ("megazero", "plain-gpt2",
                                                             "megatron-core")
               for m in ("gpt2-345m", "gpt2-1.3b")}
    status, detail = report.bench_row(bench_doc(nothing))
    assert status == "SKIP" and "no CUDA device" in detail
    only_peers = {("megazero", m): "skipped: budget spent" for m in ("gpt2-345m", "gpt2-1.3b")}
    status, detail = report.bench_row(bench_doc(only_peers))
    assert status == "FAIL" and "megazero measured nothing" in detail


def test_bench_row_of_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bench.json"
    bad.write_text("{not json")
    assert report.main(["bench", str(bad)]) == 0
    status, detail = capsys.readouterr().out.strip().split("\t")
    assert status == "FAIL" and "cannot read" in detail


# ------------------------------------------------------------------- the script, on this CPU
needs_cpu_machine = pytest.mark.skipif(
    torch.cuda.is_available() or shutil.which("timeout") is None,
    reason="on a GPU machine the script runs its GPU steps (minutes); needs coreutils timeout")


def run_script(tmp_path, **env):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_CHECK_DIR": str(tmp_path / "logs"), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


def table(stdout):
    """{step: (status, detail)} of the summary table at the end of the output."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.split("|")[0].strip() == "step")
    rows = {}
    for line in lines[start + 2:]:
        if line.count(" | ") >= 2:
            step, status, detail = (part.strip() for part in line.split(" | ", 2))
            rows[step] = (status, detail)
    return rows


@needs_cpu_machine
def test_script_on_cpu_skips_the_gpu_steps(tmp_path):
    proc = run_script(tmp_path, GPU_CHECK_QUICK="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = table(proc.stdout)
    assert list(rows) == ["build CUDA kernels", "test_ops_cuda.py", "smoke train (tiny, fp32)",
                          "train gpt2 (README) bf16", "train gpt2-345m bf16",
                          "bench GPU step", "parity tp2",
                          "parity pp2", "parity dp2", "parity tp2xpp2xdp2", "GPU vs CPU"],\
        out[-4000:]
    for step, (status, detail) in rows.items():
        if step.startswith("smoke"):
            assert status == "PASS", (step, detail)
            assert "tok/s" in detail and "MFU n/a" in detail
        else:
            assert status == "SKIP", (step, detail)
    assert "no GPU" in rows["build CUDA kernels"][1]
    assert "passed" in rows["test_ops_cuda.py"][1]
    assert "needs 2 GPUs" in rows["parity tp2"][1]
    assert (tmp_path / "logs" / "smoke.log").exists()


@needs_cpu_machine
def test_script_parity_step_runs_on_gloo(tmp_path):
    """The NCCL step's plumbing (torchrun, the 1-GPU reference, the comparison), on gloo."""
    proc = run_script(tmp_path, GPU_CHECK_STEPS="parity", GPU_CHECK_PARITY_ON_CPU="2",
                      GPU_CHECK_LAYOUTS="dp2 tp2xpp2xdp2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = table(proc.stdout)
    assert rows["parity dp2"][0] == "PASS" and "20 iterations" in rows["parity dp2"][1]
    assert rows["parity tp2xpp2xdp2"][0] == "SKIP"
    assert list(rows) == ["parity dp2", "parity tp2xpp2xdp2"]


@needs_cpu_machine
def test_script_vscpu_step_runs_on_cpu(tmp_path):
    """The one-GPU-against-the-CPU step's plumbing (reference, ZeRO-3, NVMe, offload, a resume
    joined from two runs), with both sides on this CPU: every row equal."""
    proc = run_script(tmp_path, GPU_CHECK_STEPS="vscpu", GPU_CHECK_PARITY_ON_CPU="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = table(proc.stdout)
    assert list(rows) == [f"GPU vs CPU: {n}" for n in
                          ("fp32", "zero3", "zero3-nvme", "zero2-cpu-offload", "resume")]
    for status, detail in rows.values():
        assert status == "PASS" and "20 iterations" in detail, detail
    assert (tmp_path / "logs" / "vscpu_zero3-nvme.log").read_text().count("lm loss") == 20


@needs_cpu_machine
def test_script_bench_step_runs_on_cpu(tmp_path):
    """The bench step's plumbing (budget, JSON, its row) with bench_gpu_step.py's CPU smoke run."""
    proc = run_script(tmp_path, GPU_CHECK_STEPS="bench", GPU_CHECK_BENCH_ON_CPU="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = table(proc.stdout)
    assert list(rows) == ["bench GPU step"]
    status, detail = rows["bench GPU step"]
    assert status == "PASS", detail
    assert "megazero 345m (mb 2):" in detail and "tok/s, MFU n/a" in detail
    assert "best peer 345m: plain-gpt2:eager" in detail
    assert (tmp_path / "logs" / "bench_gpu_step.json").exists()


@needs_cpu_machine
def test_script_exits_nonzero_when_a_step_fails(tmp_path):
    proc = run_script(tmp_path, GPU_CHECK_STEPS="smoke", GPU_CHECK_BUDGET="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status, detail = table(proc.stdout)["smoke train (tiny, fp32)"]
    assert status == "FAIL" and "GPU_CHECK_BUDGET" in detail
