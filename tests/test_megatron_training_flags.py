"""Megatron's training flags with Megatron's meaning: recompute granularity and method, the
attention backends, the inverse-square-root and WSD schedules, --exit-on-missing-checkpoint,
and the monitoring (validation perplexity to TensorBoard, offline wandb files, the profiler
trace, the progress line, --log-throughput)."""

import glob
import math
import os

import pytest
import torch

from megazero.optim.lr_scheduler import LRScheduler
from tests.train_helper import TINY, assert_same_run, run_training

ITERS = " --train-iters 4"
DROPOUT = TINY.replace("--attention-dropout 0 --hidden-dropout 0",
                       "--attention-dropout 0.1 --hidden-dropout 0.1")
_reference = {}


def _plain(argv):
    if argv not in _reference:
        _reference[argv] = run_training(argv, 1)
    return _reference[argv]


@pytest.mark.parametrize("recompute", [
    "--recompute-granularity selective",
    "--recompute-granularity full --recompute-method block --recompute-num-layers 3",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
])
def test_recompute_is_exact_with_dropout(recompute):
    """Recomputing replays the same dropout masks: losses and parameters as without."""
    base = DROPOUT + ITERS
    assert_same_run(run_training(base + " " + recompute, 1), _plain(base), rtol=1e-6,
                    what=recompute)


def test_selective_recompute_at_tp2_with_the_llama_family():
    llama = (" --position-embedding-type rope --normalization RMSNorm --swiglu "
             "--group-query-attention --num-query-groups 2 --disable-bias-linear")
    base = DROPOUT + ITERS + llama
    run = run_training(base + " --recompute-granularity selective --tensor-model-parallel-size"
                       " 2 --sequence-parallel", 2)
    ref = run_training(base + " --tensor-model-parallel-size 2 --sequence-parallel", 2)
    assert_same_run(run, ref, rtol=1e-6, what="selective at tp2", kv_groups=2)


@pytest.mark.parametrize("backend", ["--attention-backend unfused", "--use-flash-attn",
                                     "--attention-backend fused",
                                     "--no-masked-softmax-fusion --attention-softmax-in-fp32"])
def test_attention_backends_compute_the_same_attention(backend):
    base = TINY + ITERS
    assert_same_run(run_training(base + " " + backend, 1), _plain(base), rtol=1e-4,
                    what=backend)


def test_inverse_square_root_and_wsd_schedules():
    isr = LRScheduler(1.0, 0.01, warmup_steps=100, decay_steps=10_000,
                      decay_style="inverse-square-root")
    assert isr.get_lr(50) == pytest.approx(0.5)  # warmup
    assert isr.get_lr(400) == pytest.approx(math.sqrt(100 / 400))
    assert isr.get_lr(10**9) == pytest.approx(0.01)  # floored at min
    for style, at_half in [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5**0.5 - 1),
                           ("minus_sqrt", 1 - 0.5**0.5)]:
        wsd = LRScheduler(1.0, 0.0, warmup_steps=10, decay_steps=1000, decay_style="WSD",
                          wsd_decay_steps=200, wsd_decay_style=style)
        assert wsd.get_lr(500) == 1.0 and wsd.get_lr(800) == 1.0  # stable phase
        assert wsd.get_lr(900) == pytest.approx(at_half), style
        assert wsd.get_lr(1000) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="lr-wsd-decay"):
        LRScheduler(1.0, 0.0, 10, 1000, "WSD", wsd_decay_steps=None)


def test_wsd_run_follows_the_schedule():
    run = run_training(TINY + " --train-iters 6 --lr-decay-style WSD --lr-wsd-decay-iters 2 "
                       "--lr-wsd-decay-style linear --min-lr 0", 1)
    losses = run[0]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)


def test_exit_on_missing_checkpoint(tmp_path):
    from tests.dist_helper import run_distributed
    from tests.train_helper import _train_worker

    argv = (TINY + ITERS + f" --load {tmp_path} --exit-on-missing-checkpoint").split()
    with pytest.raises(Exception, match="exit-on-missing-checkpoint"):
        run_distributed(_train_worker, 1, argv, fresh=True)


def test_monitoring_tensorboard_wandb_profile(tmp_path, monkeypatch):
    """Validation loss and perplexity in TensorBoard, offline wandb files, a Chrome trace of
    the profiled iterations, the progress line and Megatron's throughput phrase."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.dist_helper import run_distributed
    from tests.train_helper import _train_worker

    tb, wb, prof = tmp_path / "tb", tmp_path / "wandb", tmp_path / "prof"
    argv = (TINY.replace("--eval-iters 0", "--eval-iters 2") + " --train-iters 4 "
            f"--eval-interval 2 --tensorboard-dir {tb} --log-validation-ppl-to-tensorboard "
            f"--wandb-project mz-test --wandb-exp-name tiny --wandb-save-dir {wb} "
            f"--profile --profile-step-start 2 --profile-step-end 3 --profile-dir {prof} "
            "--log-throughput --manual-gc --manual-gc-interval 2").split()
    monkeypatch.setenv("WANDB_SILENT", "true")

    (result,) = run_distributed(_train_worker, 1, argv, fresh=True)
    assert len(result["history"]["validation"]) >= 1
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "lm loss validation" in tags and "lm loss validation ppl" in tags, tags
    ppl = events.Scalars("lm loss validation ppl")[-1].value
    loss = events.Scalars("lm loss validation")[-1].value
    assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
    assert "train/throughput-tflops-per-gpu" in tags
    assert glob.glob(str(wb / "wandb" / "offline-run-*" / "run-*.wandb")), \
        os.listdir(wb)
    traces = glob.glob(str(prof / "trace_rank0_iters2-3.json"))
    assert traces and os.path.getsize(traces[0]) > 0
    assert torch.__version__  # the trace was written by this torch's profiler


def test_batch_size_rampup_matches_across_layouts():
    """--rampup-batch-size 4 4 16: batches of 4 until 16 samples, then 8 (Megatron's ramp);
    7 iterations for 40 samples, the same losses on one process and at dp 2."""
    argv = TINY.replace("--global-batch-size 8", "--global-batch-size 8 --rampup-batch-size 4 4 "
                        "16") + " --train-samples 40"
    single = run_training(argv, 1)
    history = single[2][-1]["history"]
    assert history["iteration"] == 7 and history["consumed_train_samples"] == 40
    assert_same_run(run_training(argv, 2), single, what="ramp-up at dp 2")
