"""The dry run (megazero.dryrun): one rank of a large job executed here on fake tensors.

* layouts at worlds 8, 64 and 1024 on fake ``cuda`` run end to end through the CLI, every
  collective on a CUDA tensor, the peer ranks' sequences of collectives and p2p messages
  matching;
* a CPU tensor sent to a collective of an NCCL group fails with a message naming the
  collective, the group, the device and the expected one;
* predicted = measured: the dry run's model-state bytes equal what a real gloo run of the same
  layout allocates (its optimizer's ``memory_report()`` and the same tracker), and its
  activation and peak figures come within 1% (the fused CPU ops' allocations are mirrored on
  fake tensors; equal to the byte but for timing-dependent staging slots).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.distributed.comm import CollectiveRecord
from megazero.distributed.device import expected_device_type, host_device_type, parse_backend
from megazero.distributed.init import init_distributed
from megazero.dryrun import fake_cuda
from megazero.dryrun.memory import MemoryTracker
from megazero.dryrun.report import compare_p2p, compare_sequences
from megazero.dryrun.run import DryRunOptions, dry_run_config, measured_pretrain
from tests.dist_helper import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ("--mock-data --vocab-size 96 --make-vocab-size-divisible-by 8 --num-layers 8 "
         "--hidden-size 32 --num-attention-heads 8 --seq-length 16 --micro-batch-size 1 "
         "--train-iters 4 --attention-dropout 0 --hidden-dropout 0 --ring-collectives native")
PROVIDERS = (pretrain_gpt2.train_valid_test_datasets_provider, pretrain_gpt2.model_provider,
             pretrain_gpt2.forward_step, pretrain_gpt2.zero3_unit_policy)


def dry_run_cli(flags: str, rank: int, world: int, device: str = "cuda", peers: bool = True):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "pretrain_gpt2.py", *SMALL.split(), *flags.split(),
               "--dry-run-rank", str(rank), "--dry-run-world-size", str(world),
               "--dry-run-device", device, "--dry-run-report", report]
        if not peers:
            cmd.append("--no-dry-run-check-peers")
        env = fake_cuda.preload_env() if device == "cuda" else dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        with open(report) as f:
            return json.load(f), done.stdout


@pytest.mark.parametrize("flags,rank,world", [
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 4 "
     "--zero-stage 1", 5, 8),
    ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
     "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 16 --zero-stage 2 --bf16 "
     "--sequence-parallel", 63, 64),
    ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --global-batch-size 128 "
     "--zero-stage 3 --recompute-granularity full", 517, 1024),
], ids=["world8-tp2-pp2-zero1", "world64-tp4-pp4-virtual-zero2-bf16-sp",
        "world1024-tp8-pp2-dp64-zero3-recompute"])
def test_dry_run_on_fake_cuda(flags, rank, world):
    report, stdout = dry_run_cli(flags, rank, world)
    assert report["rank"] == rank and report["world_size"] == world
    lay = report["layout"]
    assert lay["tp"] * lay["pp"] * lay["dp"] == world
    assert "memory (measured" in stdout and "collectives" in stdout
    # every hot-path collective of this rank ran on CUDA tensors; object gathers (the
    # checkpoint's RNG states) on the CPU route of cpu:gloo,cuda:nccl
    assert report["collectives"]
    for c in report["collectives"]:
        assert c["device"].startswith("cuda" if c["route"] == "device" else "cpu"), c
    assert sum(c["route"] == "device" for c in report["collectives"]) >= 3
    assert {c["group"] for c in report["collectives"]} >= {"tp", "dp"}
    assert (len(report["p2p"]) > 0) == (lay["pp"] > 1)
    # a peer of every group issued the same collectives; p2p messages match across stages
    peers = report["checks"]["peers"]
    assert set(peers) == {"tp", "dp", "pp"}
    assert all(p["ok"] for p in peers.values()), peers
    assert peers["pp"]["p2p"]["ok"]
    # the tracker's bytes are the optimizer's own accounting
    mr = report["memory_report"]
    assert report["param_bytes"] == mr["params"] > 0
    assert report["grad_bytes"] == mr["grads"] > 0
    assert report["main_param_bytes"] == mr["main_params"]
    assert report["optimizer_state_bytes"] == mr["optimizer_states"] > 0
    assert report["peak_bytes"] >= report["param_bytes"] + report["grad_bytes"]
    assert report["checkpoint_bytes"] > 0


def test_cpu_tensor_on_an_nccl_group_is_caught():
    script = (
        "import torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "from megazero.distributed import comm\n"
        "from megazero.distributed.comm import CollectiveDeviceError\n"
        "from megazero.distributed.parallel_state import ParallelState\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=3, world_size=8)\n"
        "ps = ParallelState.build(2, 2, device='cuda', comm_backend='cpu:gloo,cuda:nccl')\n"
        "try:\n"
        "    comm.all_reduce(torch.zeros(4, dtype=torch.float64), ps.dp_group)\n"
        "except CollectiveDeviceError as e:\n"
        "    print('CAUGHT', e)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "CAUGHT" in done.stdout, done.stdout + done.stderr
    msg = done.stdout
    for part in ("all_reduce", "dp group", "cpu", "needs cuda tensors", "cpu:gloo,cuda:nccl"):
        assert part in msg, msg


def test_backend_devices():
    assert parse_backend("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert expected_device_type("nccl") == "cuda"
    assert expected_device_type("gloo") == "cpu"
    assert expected_device_type("cpu:gloo,cuda:nccl") == "cuda"
    assert host_device_type("cpu:gloo,cuda:nccl") == "cpu"
    assert host_device_type("nccl") == "cuda"
    assert expected_device_type("fake") is None


def _real_worker(argv, world):
    """A real gloo run of the dry run's configuration, measured with the same tracker."""
    config = parse_args(argv, world_size=world)
    with tempfile.TemporaryDirectory() as save_dir:
        cfg = dry_run_config(config, DryRunOptions(rank=0, world_size=world, device="cpu"),
                             save_dir)
        ps = init_distributed(cfg.parallel)
        tracker = MemoryTracker()
        with tracker:
            measured = measured_pretrain(cfg, ps, PROVIDERS, tracker)
        dist.barrier()
    return {"rank": ps.rank, "states": measured["states"],
            "memory_report": measured["memory_report"], "peak": measured["train_peak"]["cpu"]}


LAYOUTS = [
    ("--global-batch-size 4 --zero-stage 0", 2),
    ("--global-batch-size 4 --zero-stage 1", 2),
    ("--tensor-model-parallel-size 2 --global-batch-size 4 --zero-stage 2 --bf16", 4),
    ("--pipeline-model-parallel-size 2 --global-batch-size 4 --zero-stage 3", 4),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 4 "
     "--zero-stage 1 --sequence-parallel", 8),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
     "--num-layers-per-virtual-pipeline-stage 2 --global-batch-size 4 --zero-stage 2 "
     "--recompute-granularity full", 4),
]


@pytest.mark.parametrize("flags,world", LAYOUTS, ids=[f"w{w}-{i}" for i, (_, w) in
                                                       enumerate(LAYOUTS)])
def test_predicted_memory_equals_measured(flags, world):
    argv = (SMALL + " " + flags).split()
    real = run_distributed(_real_worker, world, argv, world, timeout=300)
    rank = world - 1  # the last pipeline stage: loss, head and (tied) embedding
    mine = next(r for r in real if r["rank"] == rank)
    report, _ = dry_run_cli(flags, rank, world, device="cpu", peers=False)
    predicted = {"params": report["param_bytes"], "grads": report["grad_bytes"],
                 "main_params": report["main_param_bytes"],
                 "optimizer_states": report["optimizer_state_bytes"]}
    assert predicted == mine["states"]  # the same allocations, byte for byte
    for k, v in predicted.items():
        assert v == mine["memory_report"][k], (k, v, mine["memory_report"])
    # the fused CPU ops allocate around their (skipped) kernel calls on fake tensors what
    # they allocate around the real ones: activations and peak equal, but for what depends
    # on timing in the real run (a ZeRO-2 staging slot taken while a reduction is in flight)
    for key, real_key in (("activation_bytes", "max_activations"),
                          ("peak_bytes", "peak_bytes")):
        assert abs(report[key] - mine["peak"][real_key]) <= 0.01 * mine["peak"][real_key], \
            (key, report[key], mine["peak"])


# sizes at which the fused CPU kernels run (LayerNorm from 262144 elements), dropout on
KERNEL_SIZES = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
                "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 "
                "--attention-dropout 0.1 --hidden-dropout 0.1 --tensor-model-parallel-size 2")


def test_dry_run_keeps_what_the_cpu_kernels_keep():
    """Where a real CPU run takes the fused kernels, the dry run allocates what they do (not
    what the reference formulas would: dropout masks and hash temporaries, eager norms)."""
    argv = (SMALL + " " + KERNEL_SIZES).split()
    real = run_distributed(_real_worker, 2, argv, 2, timeout=300)
    report, _ = dry_run_cli(KERNEL_SIZES, 0, 2, device="cpu", peers=False)
    mine = next(r for r in real if r["rank"] == 0)
    for key, real_key in (("activation_bytes", "max_activations"),
                          ("peak_bytes", "peak_bytes")):
        assert abs(report[key] - mine["peak"][real_key]) <= 0.01 * mine["peak"][real_key], \
            (key, report[key], mine["peak"])


def _fake_run(rank, records, **ranks):
    ps = SimpleNamespace(**{f"{k}_ranks": v for k, v in ranks.items()})
    return SimpleNamespace(rank=rank, ps=ps, records=records)


def test_sequence_comparison_finds_the_first_divergence():
    def rec(op, shape, group="dp", peer=None):
        return CollectiveRecord(group, op, shape, "bfloat16", 8, peer, "cuda:0")

    groups = dict(mp=[0], embedding=[])
    same = [rec("reduce_scatter", (8,)), rec("all_gather", (4,))]
    a = _fake_run(0, same, **groups)
    assert compare_sequences(a, _fake_run(2, list(same), **groups), "dp")["ok"]
    b = _fake_run(2, [rec("reduce_scatter", (8,)), rec("all_gather", (6,))], **groups)
    result = compare_sequences(a, b, "dp")
    assert not result["ok"]
    div = result["groups"]["dp"]["first_divergence"]
    assert div["index"] == 1 and "[4]" in div["rank 0"] and "[6]" in div["rank 2"]
    c = _fake_run(2, same[:1], **groups)  # one collective short: rank 0 would hang
    assert compare_sequences(a, c, "dp")["groups"]["dp"]["first_divergence"]["rank 2"] \
        == "nothing more"
    # p2p: what 0 sends 4 is what 4 receives from 0
    s = _fake_run(0, [rec("send", (16, 2, 8), "pp", 4)], **groups)
    r = _fake_run(4, [rec("recv", (16, 2, 8), "pp", 0)], **groups)
    assert compare_p2p(s, r)["ok"]
    r_bad = _fake_run(4, [rec("recv", (16, 1, 8), "pp", 0)], **groups)
    assert not compare_p2p(s, r_bad)["ok"]


def test_dry_run_rejects_an_impossible_layout():
    done = subprocess.run(
        [sys.executable, "pretrain_gpt2.py", *SMALL.split(), "--tensor-model-parallel-size",
         "8", "--dry-run-rank", "0", "--dry-run-world-size", "12", "--dry-run-device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "world size (12) is not divisible by --tensor-model-parallel-size (8)" in done.stderr


def test_checkpoint_in_cpu_moves_saved_activations_off_the_device():
    """--checkpoint-in-cpu (DeepSpeed's cpu_checkpointing): the recompute chunks' saved inputs
    wait in host memory, so one rank's measured device peak (during the backward, with the
    saved inputs of the layers not yet back-propagated alive) drops by about those bytes."""
    flags = ("--tensor-model-parallel-size 2 --global-batch-size 32 --zero-stage 1 "
             "--recompute-granularity full --seq-length 256 --max-position-embeddings 256 "
             "--micro-batch-size 8")
    plain, _ = dry_run_cli(flags, 1, 8, peers=False)
    offloaded, _ = dry_run_cli(flags + " --checkpoint-in-cpu", 1, 8, peers=False)
    saved_input = 256 * 8 * 32 * 4  # [s, b, h] fp32, one per layer
    drop = plain["peak_bytes"] - offloaded["peak_bytes"]
    assert 4 * saved_input <= drop <= 8 * saved_input, (plain["peak_bytes"], drop)
