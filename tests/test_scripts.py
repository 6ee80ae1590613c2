"""The launch scripts, end to end: default corpus, Megatron log line, save, resume at another
layout (the README's walkthrough), and the ZeRO-2 engine example under torchrun."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, env_extra, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env_extra}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def iterations_logged(out):
    return [int(line.split("iteration")[1].split("/")[0]) for line in out.splitlines()
            if line.startswith(" iteration") and " lm loss: " in line]


def test_distributed_tp2_then_single_process_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"CHECKPOINT_DIR": str(ckpt), "SAVE_INTERVAL": "2", "LOG_INTERVAL": "1",
           "EVAL_ITERS": "0"}
    out = run(["bash", "scripts/pretrain_gpt2_distributed.sh", *SMALL],
              {**env, "NPROC_PER_NODE": "2", "TP": "2", "TRAIN_ITERS": "2",
               "MASTER_PORT": str(free_port())})
    assert iterations_logged(out) == [1, 2]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt").exists()
    # resume the tp=2 checkpoint in one process (tp=1)
    out = run(["bash", "scripts/pretrain_gpt2.sh", *SMALL], {**env, "TRAIN_ITERS": "4"})
    assert "successfully loaded checkpoint" in out or "loaded checkpoint" in out
    assert iterations_logged(out) == [3, 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_zero2_mlp_example_under_torchrun():
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), "scripts/train_mlp_zero2.py", "--steps",
               "20"], {})
    assert "step   20 | loss" in out
    assert out.count("bytes of model states") == 2


def lm_losses(out):
    """The ``lm loss`` values of the Megatron log lines, by iteration."""
    return {int(line.split("iteration")[1].split("/")[0]):
            float(line.split(" lm loss: ")[1].split(" |")[0])
            for line in out.splitlines() if line.startswith(" iteration") and " lm loss: " in line}


def test_cli_log_lines_match_the_single_process_run_at_other_layouts():
    """What users (and the independent checks) compare: pretrain_gpt2.py's ``lm loss`` lines
    under torchrun at several layouts against one process, with the same flags and seed."""
    flags = ["pretrain_gpt2.py", "--mock-data", "--vocab-size", "128", "--num-layers", "4",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3",
             "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
             "--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "1.0"]
    base = lm_losses(run([sys.executable, *flags], {}))
    assert sorted(base) == [1, 2, 3, 4]
    for layout in (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                   ["--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1"],
                   ["--zero-stage", "3"]):
        out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(free_port()), *flags, *layout], {})
        got = lm_losses(out)
        assert got.keys() == base.keys(), (layout, out[-2000:])
        for it, loss in base.items():
            assert abs(got[it] - loss) <= 1e-5 * abs(loss), (layout, it, got[it], loss)


def test_llama_tiny_script_trains_and_resumes(tmp_path):
    """scripts/pretrain_llama_tiny.sh: Megatron's Llama flags, the default corpus, Megatron's
    log line with its throughput phrase, a progress line, and a resume."""
    ckpt = tmp_path / "llama"
    env = {"CHECKPOINT_DIR": str(ckpt), "SAVE_INTERVAL": "2", "LOG_INTERVAL": "1",
           "EVAL_ITERS": "0"}
    small = SMALL + ["--num-attention-heads", "4", "--num-query-groups", "2",
                     "--ffn-hidden-size", "96"]
    out = run(["bash", "scripts/pretrain_llama_tiny.sh", *small], {**env, "TRAIN_ITERS": "2"})
    assert iterations_logged(out) == [1, 2]
    assert "throughput per GPU (TFLOP/s/GPU):" in out and " progress: 2/2 iterations" in out
    assert "Using AdamW: megazero's" in out and "ZeRO stage 1" in out  # --use-distributed-optimizer
    out = run(["bash", "scripts/pretrain_llama_tiny.sh", *small], {**env, "TRAIN_ITERS": "3"})
    assert iterations_logged(out) == [3]


_TEARDOWN_PROBE = """
import os, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())
import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.distributed import destroy_distributed
from megazero.training import pretrain
pretrain(pretrain_gpt2.train_valid_test_datasets_provider, pretrain_gpt2.model_provider,
         pretrain_gpt2.forward_step, parse_args(),
         zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)
destroy_distributed()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(os.path.join(os.environ["PROBE_OUT"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(sum("gloo" in n for n in names)))
"""


def test_teardown_joins_every_gloo_thread(tmp_path):
    """After pretrain and ``destroy_distributed`` no process group survives: a group kept
    alive by the finished model or optimizer (hooks, parameter metadata) would keep its gloo
    threads into interpreter teardown, where they sometimes abort the process (SIGABRT,
    "terminate called without an active exception") after a run that succeeded."""
    probe = tmp_path / "probe.py"
    probe.write_text(_TEARDOWN_PROBE)
    flags = ["--mock-data", "--vocab-size", "128", "--num-layers", "4", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
             "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
             "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]
    for layout in (["--zero-stage", "3"], ["--zero-stage", "2"],
                   ["--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1"]):
        out_dir = tmp_path / "_".join(layout)
        out_dir.mkdir()
        run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), str(probe), "pretrain_gpt2.py", *flags,
             *layout], {"PROBE_OUT": str(out_dir)})
        left = {f.name: int(f.read_text()) for f in out_dir.iterdir()}
        assert left == {"rank0": 0, "rank1": 0}, (layout, "gloo threads left", left)
