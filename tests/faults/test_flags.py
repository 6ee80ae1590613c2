"""Issue 14, finding 8: every numeric flag with a valid range is checked before anything
starts, and the message names the flag, the value and the range (argparse's exit code 2).

Covers ``pretrain_gpt2.py``'s parser (``megazero.arguments``), ``megazero.inference.generate``
and the numeric flags of ``megazero.tools.checkpoint``.
"""

import math
import os
import re
import subprocess
import sys

import pytest

from megazero.arguments import build_parser, parse_args
from megazero.config import ConfigError, MegazeroConfig, OptimizerConfig, TrainConfig
from megazero.inference import generate
from megazero.tools.checkpoint import main as checkpoint_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANGE = re.compile(r"(>=|>|<=|<|in [\[(]|choose from|such as)")

# Numeric flags that parse_args does not check, each for a reason: the dry-run flags are
# checked by megazero.dryrun.DryRunOptions.
UNCHECKED = {"--dry-run-rank", "--dry-run-world-size", "--dry-run-iters"}


def _rejected(argv, capsys, world=1) -> str:
    if "--world-size" in argv:
        world = None  # the flag, not the caller, gives the world size
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world)
    assert exc.value.code == 2
    return capsys.readouterr().err


# The findings of the issue and the exact messages they now give.
@pytest.mark.parametrize("argv,message", [
    ("--lr inf", "--lr must be a finite number >= 0, got inf"),
    ("--lr nan", "--lr must be a finite number >= 0, got nan"),
    ("--min-lr -1", "--min-lr must be a finite number >= 0, got -1.0"),
    ("--layernorm-epsilon -1", "--layernorm-epsilon must be a finite number > 0, got -1.0"),
    ("--init-method-std -1", "--init-method-std must be a finite number > 0, got -1.0"),
    ("--adam-beta1 1.5", "--adam-beta1 must be in [0, 1), got 1.5"),
    ("--adam-beta2 -0.1", "--adam-beta2 must be in [0, 1), got -0.1"),
    ("--adam-eps 0", "--adam-eps must be a finite number > 0, got 0.0"),
    ("--weight-decay -1", "--weight-decay must be a finite number >= 0, got -1.0"),
    ("--sgd-momentum 1", "--sgd-momentum must be in [0, 1), got 1.0"),
    ("--clip-grad inf", "--clip-grad must be a finite number >= 0, got inf"),
    ("--fp16 --loss-scale inf", "--loss-scale must be a finite number > 0, got inf"),
    ("--initial-loss-scale 0", "--initial-loss-scale must be a finite number > 0, got 0.0"),
    ("--min-loss-scale inf", "--min-loss-scale must be a finite number > 0, got inf"),
    ("--fp16 --initial-loss-scale 4 --min-loss-scale 8",
     "--min-loss-scale (8.0) must not exceed --initial-loss-scale (4.0)"),
    ("--position-embedding-type rope --rotary-base 0",
     "--rotary-base must be an integer >= 1, got 0"),
    ("--lr-warmup-iters -1", "--lr-warmup-iters must be an integer >= 0, got -1"),
    ("--lr-warmup-samples -1", "--lr-warmup-samples must be an integer >= 0, got -1"),
    ("--lr-decay-iters 0", "--lr-decay-iters must be an integer >= 1, got 0"),
    ("--lr-decay-samples 0", "--lr-decay-samples must be an integer >= 1, got 0"),
    ("--zero-param-persistence-threshold -1",
     "--zero-param-persistence-threshold must be an integer >= 0, got -1"),
    ("--exit-interval -1", "--exit-interval must be an integer >= 1, got -1"),
    ("--exit-duration-in-mins -1", "--exit-duration-in-mins must be a finite number > 0, "
                                   "got -1.0"),
    ("--global-batch-size 0", "--global-batch-size must be an integer >= 1, got 0"),
    ("--train-iters -1", "--train-iters must be an integer >= 0, got -1"),
    ("--train-samples -1", "--train-samples must be an integer >= 0, got -1"),
    ("--seed -1", "--seed must be an integer in [0, 2^63), got -1"),
    ("--num-workers -1", "--num-workers must be an integer >= 0, got -1"),
    ("--vocab-size 0", "--vocab-size must be an integer >= 1, got 0"),
    ("--mock-data --vocab-size 1", "--mock-data needs --vocab-size >= 2, got 1"),
    ("--max-consecutive-skipped-iterations -1",
     "--max-consecutive-skipped-iterations must be an integer >= 0 (0: never stop), got -1"),
    ("--distributed-timeout-minutes inf",
     "--distributed-timeout-minutes must be a finite number > 0, got inf"),
    ("--num-layers 0", "--num-layers must be an integer >= 1, got 0"),
    ("--world-size 0", "--world-size (or WORLD_SIZE) must be an integer >= 1, got 0"),
    ("--num-layers-per-virtual-pipeline-stage 0 --pipeline-model-parallel-size 2",
     "--num-layers-per-virtual-pipeline-stage must be an integer >= 1, got 0"),
    ("--split 1,inf,1", "--split must hold up to 3 finite non-negative weights"),
    ("--exit-signal SIGFOO", "--exit-signal must be the name of a signal that can be caught, "
                             "such as SIGTERM, SIGINT or SIGUSR1, got 'SIGFOO'"),
    ("--exit-signal SIGKILL", "got 'SIGKILL'"),
])
def test_bad_flag_names_flag_value_and_range(argv, message, capsys):
    err = _rejected(argv.split(), capsys, world=2 if "pipeline" in argv else 1)
    assert message in err, err


def _numeric_actions():
    out = []
    for action in build_parser()._actions:
        if action.type in (int, float) and not UNCHECKED & set(action.option_strings):
            out.append(action)
    return out


@pytest.mark.parametrize("action", _numeric_actions(), ids=lambda a: a.option_strings[0])
def test_every_numeric_flag_rejects_out_of_range_values(action, capsys):
    """Every int flag refuses -1, every float flag nan and inf, each message naming the flag
    (one of its spellings), the value and a range."""
    values = ["-1"] if action.type is int else ["nan", "inf"]
    for value in values:
        count = action.nargs if isinstance(action.nargs, int) else 1  # --rampup-batch-size: 3
        argv = [action.option_strings[0]] + [value] * count
        if action.dest == "num_layers_per_virtual_pipeline_stage":
            argv += ["--pipeline-model-parallel-size", "2"]
        err = _rejected(argv, capsys, world=2).split(": error: ", 1)[1]  # not the usage
        assert any(flag in err for flag in action.option_strings), err
        assert value in err or f"{float(value)}" in err, err
        assert RANGE.search(err), err


def test_defaults_and_edges_stay_valid():
    c = MegazeroConfig()
    assert MegazeroConfig.from_dict(c.to_dict()) == c
    ok = parse_args("--lr 0 --min-lr 0 --weight-decay 0 --adam-beta1 0 --clip-grad 0 "
                    "--train-iters 0 --max-consecutive-skipped-iterations 0 --seed 0 "
                    "--exit-interval 1 --exit-signal SIGUSR1 --exit-signal-handler "
                    "--lr-decay-style linear --lr-decay-iters 1".split())
    assert ok.train.exit_signal == "SIGUSR1" and ok.optimizer.lr == 0
    assert parse_args(["--exit-signal", "int", "--exit-signal-handler"]).train.exit_signal \
        == "SIGINT"
    assert TrainConfig(exit_signal="TERM").exit_signal == "SIGTERM"
    assert OptimizerConfig(fp16=True, initial_loss_scale=0.5, min_loss_scale=0.5).fp16


def test_config_errors_without_argparse():
    with pytest.raises(ConfigError, match=re.escape("--adam-eps must be a finite number > 0")):
        OptimizerConfig(adam_eps=math.nan)
    with pytest.raises(ConfigError, match="--exit-signal"):
        TrainConfig(exit_signal="SIGSTOP")
    d = MegazeroConfig().to_dict()
    d["optimizer"]["lr"] = math.inf  # a checkpoint's args go through the same checks
    with pytest.raises(ConfigError, match="--lr must be a finite number"):
        MegazeroConfig.from_dict(d)


@pytest.mark.parametrize("argv,message", [
    ("--lr inf", "--lr must be a finite number >= 0, got inf"),
    ("--global-batch-size 0", "--global-batch-size must be an integer >= 1, got 0"),
])
def test_pretrain_gpt2_exits_2_before_training(argv, message):
    proc = subprocess.run([sys.executable, "pretrain_gpt2.py", "--mock-data", "--vocab-size",
                           "96", "--train-iters", "1", *argv.split()], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


# ---- megazero.inference.generate ---------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    ("--max-new-tokens -5", "--max-new-tokens must be an integer >= 1, got -5"),
    ("--max-new-tokens 0", "--max-new-tokens must be an integer >= 1, got 0"),
    ("--temperature 0", "--temperature must be a finite number > 0 (or use --greedy), got 0.0"),
    ("--temperature -1", "--temperature must be a finite number > 0 (or use --greedy), "
                         "got -1.0"),
    ("--temperature nan", "--temperature must be a finite number > 0 (or use --greedy), "
                          "got nan"),
    ("--greedy --temperature inf", "--temperature must be a finite number >= 0, got inf"),
    ("--top-k -1", "--top-k must be an integer >= 0 (0: no top-k filtering), got -1"),
    ("--top-p 0", "--top-p must be in (0, 1], got 0.0"),
    ("--top-p 1.5", "--top-p must be in (0, 1], got 1.5"),
    ("--top-p nan", "--top-p must be in (0, 1], got nan"),
    ("--seed -1", "--seed must be an integer in [0, 2^63), got -1"),
    ("--tensor-model-parallel-size 0", "--tensor-model-parallel-size must be an integer >= 1, "
                                       "got 0"),
    ("--iteration -3", "--iteration must be an integer >= 0 or 'release', got '-3'"),
    ("--iteration abc", "--iteration must be an integer >= 0 or 'release', got 'abc'"),
])
def test_generate_bad_flags(argv, message, tmp_path, capsys):
    """Checked before the checkpoint is opened (the folder here does not exist)."""
    with pytest.raises(SystemExit) as exc:
        generate.main(["--load", str(tmp_path / "missing"), *argv.split()])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_generate_bad_flag_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megazero.inference.generate", "--load",
                           str(tmp_path), "--max-new-tokens", "-5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "--max-new-tokens must be an integer >= 1, got -5" in proc.stderr


# ---- megazero.tools.checkpoint -----------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    ("convert CKPT OUT --tp 0", "argument --tp: must be an integer >= 1, got '0'"),
    ("convert CKPT OUT --tp 1 --pp -1", "argument --pp: must be an integer >= 1, got '-1'"),
    ("from-hf CKPT OUT --tp 0", "argument --tp: must be an integer >= 1, got '0'"),
    ("from-hf CKPT OUT --make-vocab-size-divisible-by 0",
     "argument --make-vocab-size-divisible-by: must be an integer >= 1, got '0'"),
    ("inspect CKPT --iteration -2", "argument --iteration: must be an integer >= 0 or "
                                    "'release', got '-2'"),
])
def test_checkpoint_tool_bad_flags(argv, message, tmp_path, capsys):
    argv = argv.replace("CKPT", str(tmp_path / "ckpt")).replace("OUT", str(tmp_path / "out"))
    with pytest.raises(SystemExit) as exc:
        checkpoint_tool(argv.split())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
