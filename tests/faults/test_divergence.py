"""Divergence policy (issue 14, finding 7): a run whose every step is skipped stops with an
error naming the last finite loss; non-finite initial weights are an error before the first
step (an fp16 run at --init-method-std 1e30 used to save inf weights at every interval); the
validation PPL of a NaN loss prints nan, not 4.85E+08."""

from __future__ import annotations

import logging
import math

import pytest

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.training import pretrain
from megazero.training.log import log_validation
from megazero.training.pretrain import TrainingDivergedError
from tests.faults.launch import TINY

PROVIDERS = (pretrain_gpt2.train_valid_test_datasets_provider, pretrain_gpt2.model_provider,
             pretrain_gpt2.forward_step)


def run(flags: str, tmp_path=None):
    argv = f"{TINY} --global-batch-size 2 {flags}".split()
    if tmp_path is not None:
        argv += ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    return pretrain(*PROVIDERS, parse_args(argv),
                    zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)


def test_a_run_that_only_skips_stops_naming_the_last_finite_loss(tmp_path):
    # lr 1e6 diverges within a few steps in fp32; every later step is non-finite and skipped
    with pytest.raises(TrainingDivergedError) as err:
        run("--lr 1e6 --train-iters 200 --max-consecutive-skipped-iterations 5 "
            "--lr-warmup-iters 0 --clip-grad 0", tmp_path)
    msg = str(err.value)
    assert "5 consecutive iterations skipped" in msg
    assert "--max-consecutive-skipped-iterations 5" in msg
    assert "last finite loss" in msg and "lm loss" in msg


def test_zero_means_never_stop():
    result = run("--lr 1e6 --train-iters 30 --max-consecutive-skipped-iterations 0 "
                 "--lr-warmup-iters 0 --clip-grad 0")
    assert result.iteration == 30 and result.skipped_iters > 5


def test_non_finite_initial_weights_fail_before_the_first_step(tmp_path):
    with pytest.raises(TrainingDivergedError, match="non-finite initial weights"):
        run("--fp16 --init-method-std 1e30 --train-iters 4", tmp_path)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("*.pt"))


def test_validation_ppl_of_a_nan_loss_is_nan(caplog):
    with caplog.at_level(logging.INFO, logger="megazero"):
        log_validation("iteration 1", {"lm loss": math.nan, "other": 2.0})
    text = caplog.text
    assert "lm loss PPL: nan" in text and "4.85" not in text
    assert f"other PPL: {math.exp(2.0):.6E}" in text
