"""The dry run's device-work counter (``megazero.dryrun.launches``) against the truth.

* On a real CPU run, one training iteration is counted by ``DeviceOpCounter`` and recorded by
  ``torch.profiler`` at once; every op the profiler saw computing (per op name) and every
  host read (a value read, or megazero's host-read mark) match the counter's launches and
  syncs of that iteration. The profiler's side is classified from its own record: an op of
  the ``aten``/``c10d``/``megazero`` namespaces with a kernel of its own (not a view, not a
  bare allocation, not a composite that decomposes before dispatch), outermost among such.
* On fake CUDA, GPT-2 345M as issue 27 states it: at most 3,000 launches and no host sync
  on an iteration that does not log, at most 2 on one that does, and no more launches than
  the plain eager PyTorch GPT-2 of the same shapes (``benchmarks/count_launches.py``).
* The multi-tensor launch model (ATen's ``multi_tensor_apply`` chunking) and the table of
  ops that launch several kernels.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.distributed.device import HOST_READ_MARK
from megazero.distributed.init import init_distributed
from megazero.dryrun import fake_cuda, launches
from megazero.dryrun.launches import DeviceOpCounter, instrument
from megazero.training.pretrain import pretrain
from tests.dist_helper import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILED = 2  # of 3 iterations, logging at the third: a steady iteration
TINY = ("--mock-data --vocab-size 96 --make-vocab-size-divisible-by 8 --num-layers 2 "
        "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 3 --log-interval 3 --eval-iters 0 "
        "--lr 1e-3 --clip-grad 1.0 --hidden-dropout 0.1 --attention-dropout 0.1 "
        "--ring-collectives native")
NAMESPACES = ("aten", "c10d", "megazero")


@functools.cache
def _kind(name: str) -> str:
    """What the profiler's op ``name`` is (it records no overload): "none" (not an op of
    ours, a view or in-place view, an allocation or metadata op: no kernel), "composite"
    (every overload is a CompositeImplicitAutograd decomposition: it runs before any
    dispatch mode and launches only through the ops it calls), "mixed" (some overloads are)
    or "kernel"."""
    if not name.startswith(tuple(f"{ns}::" for ns in NAMESPACES)):
        return "none"
    ns, op = name.split("::", 1)
    packet = getattr(getattr(torch.ops, ns), op, None)
    if packet is None:
        return "none"
    composite = []
    for overload in packet.overloads():
        op = getattr(packet, overload)
        try:
            composite.append(op.has_kernel_for_dispatch_key(
                torch._C.DispatchKey.CompositeImplicitAutograd))
        except RuntimeError:  # TorchScript's overloads of lists and scalars
            continue
        if op.is_view or torch.Tag.inplace_view in op.tags or str(op) in launches.NO_KERNEL:
            return "none"
    if composite and all(composite):
        return "composite"
    return "mixed" if any(composite) else "kernel"


def _op_children(ev):
    """The ops nearest below ``ev`` (through the profiler's non-op ranges, such as the
    dispatch mode's)."""
    for child in ev.cpu_children:
        if child.name.startswith(tuple(f"{ns}::" for ns in NAMESPACES)):
            yield child
        else:
            yield from _op_children(child)


def _launches(ev) -> bool:
    """Whether the profiler's event ``ev`` ran a kernel of its own: a kernel op, or an op
    with composite overloads that took a kernel overload (it called no launching op of
    another name: a decomposition does)."""
    kind = _kind(ev.name)
    if kind == "mixed":
        return all(name == ev.name for name in _launching_below(ev))
    return kind == "kernel"


def _launching_below(ev):
    """Names of the outermost launching ops below ``ev``."""
    for child in _op_children(ev):
        if _launches(child):
            yield child.name
        else:
            yield from _launching_below(child)


def _profiled_counts(events) -> tuple[Counter, int]:
    """Launches per op name and host-read marks in the profiler's record of the training
    thread (forward, backward and optimizer run there on a CPU job; gloo's worker threads
    copy inside its collectives, which on a GPU are one NCCL kernel each, counted as the
    collective's c10d op): events that ran a kernel, outermost (a kernel's own inner ops,
    and the call a dispatch mode re-dispatches, are nested in it)."""
    ops, reads = Counter(), 0
    main = Counter(ev.thread for ev in events).most_common(1)[0][0]
    for ev in events:
        if ev.thread != main:
            continue
        if ev.name == HOST_READ_MARK:
            reads += 1
            continue
        if not _launches(ev):
            continue
        parent = ev.cpu_parent
        while parent is not None and not _launches(parent):
            parent = parent.cpu_parent
        if parent is None:
            ops[ev.name] += 1
    return ops, reads


def _profile_worker(argv, world):
    """A real gloo run: the counter over every iteration, the profiler over ``PROFILED``."""
    config = parse_args(argv, world_size=world)
    ps = init_distributed(config.parallel)
    counter = DeviceOpCounter("cpu", root=ROOT)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def on_ready(trainer):
        instrument(trainer, counter)
        counted_start = trainer.monitor.iteration_start

        def start(iteration):
            if iteration == PROFILED + 1:
                profiler.stop()
            if iteration == PROFILED:
                profiler.start()
            counted_start(iteration)
        trainer.monitor.iteration_start = start

    with counter:
        pretrain(pretrain_gpt2.train_valid_test_datasets_provider, pretrain_gpt2.model_provider,
                 counter.forward_step(pretrain_gpt2.forward_step), config, ps=ps,
                 zero3_unit_policy=pretrain_gpt2.zero3_unit_policy, on_ready=on_ready)
    counts = next(c for c in counter.iterations if c.iteration == PROFILED)
    ops, reads = _profiled_counts(profiler.events())
    syncs = Counter(k for (k, _, _), n in counts.syncs.items() for _ in range(n))
    return {"rank": ps.rank, "logged": counts.logged,
            "counter_ops": dict(sum((Counter({launches.profiler_name(k): v})
                                     for k, v in counts.launches_by_op.items()), Counter())),
            "counter_launches": counts.kernel_launches, "counter_syncs": dict(syncs),
            "counter_phases": dict(counts.launches_by_phase),
            "profiler_ops": dict(ops), "profiler_reads": reads,
            "profiler_scalar_reads": ops.get("aten::_local_scalar_dense", 0)}


@pytest.mark.parametrize("flags,world", [
    ("--zero-stage 0", 1),
    ("--tensor-model-parallel-size 2 --zero-stage 1 --bf16", 2),
    ("--zero-stage 3 --fp16", 2),
], ids=["tp1-z0", "tp2-z1-bf16", "dp2-z3-fp16"])
def test_counter_matches_the_profiler_on_a_real_cpu_iteration(flags, world):
    argv = (TINY + " " + flags).split()
    results = run_distributed(_profile_worker, world, argv, world, timeout=300)
    for r in results:
        assert not r["logged"]
        profiled = dict(r["profiler_ops"])
        scalar_reads = profiled.pop("aten::_local_scalar_dense", 0)
        diff = {k: (r["counter_ops"].get(k, 0), profiled.get(k, 0))
                for k in set(r["counter_ops"]) | set(profiled)
                if r["counter_ops"].get(k, 0) != profiled.get(k, 0)}
        assert not diff, (r["rank"], diff)
        assert r["counter_launches"] == sum(profiled.values())
        assert sum(r["counter_phases"].values()) == r["counter_launches"]
        assert {"forward", "backward", "optimizer"} <= set(r["counter_phases"])
        syncs = r["counter_syncs"]
        assert syncs.get("local_scalar_dense", 0) == scalar_reads, (syncs, scalar_reads)
        assert syncs.get("host read", 0) == r["profiler_reads"], (syncs, r["profiler_reads"])
        assert sum(syncs.values()) == scalar_reads + r["profiler_reads"]


# GPT-2 345M as issue 27 states it: bf16, one GPU, micro-batch 8, global batch 16
GPT2_345M = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
             "--max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 16 "
             "--vocab-size 50257 --bf16 --train-iters 100 --mock-data "
             "--hidden-dropout 0.1 --attention-dropout 0.1")


def test_gpt2_345m_on_fake_cuda_meets_the_launch_and_sync_targets(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "pretrain_gpt2.py", *GPT2_345M.split(), "--dry-run-rank", "0",
         "--dry-run-world-size", "1", "--dry-run-iters", "2", "--no-dry-run-check-peers",
         "--dry-run-report", str(report)],
        cwd=ROOT, env=fake_cuda.preload_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    steady, logged = data["device_ops"]
    assert data["counted_iteration"] == steady["iteration"] == 1 and not steady["logged"]
    assert logged["logged"] and data["logging_iteration"]["iteration"] == 2
    assert data["kernel_launches"] == steady["kernel_launches"] <= 3000
    assert data["host_syncs"] == steady["host_syncs"] == 0, steady["syncs"]
    assert logged["host_syncs"] <= 2, logged["syncs"]
    assert all(s["phase"] == "logging" for s in logged["syncs"])
    by_phase = steady["launches_by_phase"]
    assert sum(by_phase.values()) == steady["kernel_launches"]
    assert {"forward", "backward", "optimizer"} <= set(by_phase) and "logging" not in by_phase
    # the fused chains are megazero's CUDA ops, one launch per call: 24 layers x 2
    # micro-batches of bias-GELU; the Adam step is torch's fused kernel, no per-tensor loop
    ops = steady["launches_by_op"]
    assert ops["megazero.bias_gelu.default"] == 48
    assert ops.get("aten._fused_adamw_.default", 0) + ops.get("aten._fused_adam_.default", 0) > 0
    assert "device work per training iteration" in done.stdout
    # no more launches than the plain eager PyTorch GPT-2 of the same shapes, same dropout
    plain_json = tmp_path / "plain.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/count_launches.py", "--contenders", "plain-gpt2",
         "--dropout", "0.1", "--json", str(plain_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plain = json.loads(plain_json.read_text())["results"][0]
    assert plain["status"] == "ok"
    assert steady["kernel_launches"] <= plain["kernel_launches"], (steady, plain)
    # the README's "GPU performance" table and RESULTS.md state these counts
    _documented_counts_are(steady["kernel_launches"], plain["kernel_launches"])


def _documented_counts_are(megazero: int, plain: int) -> None:
    readme = (Path(ROOT) / "README.md").read_text()
    row = next(line for line in readme.splitlines()
               if line.startswith("| 345M") and "dropout 0.1: launches" in line)
    cells = [c.strip(" *") for c in row.split("|")[2:4]]
    assert cells == [f"{megazero:,}", f"{plain:,}"], row
    results = (Path(ROOT) / "benchmarks" / "RESULTS.md").read_text()
    assert f"| GPT-2 345M, dropout 0.1 | **megazero** | **{megazero:,}** |" in results
    assert f"| | plain GPT-2 (eager) | {plain:,} |" in results


def test_multi_tensor_launches_follow_aten_chunking():
    # depth 4 (Adam: grads, params, exp_avg, exp_avg_sq): 252 tensors per launch
    assert launches.mta_launches([1000] * 252, depth=4) == 1
    assert launches.mta_launches([1000] * 253, depth=4) == 2
    # 2,240 blocks of 65,536 elements per launch: one tensor of 2,241 chunks takes two
    assert launches.mta_launches([launches.CHUNK * 2240], depth=1) == 1
    assert launches.mta_launches([launches.CHUNK * 2240 + 1], depth=1) == 2
    assert launches.mta_launches([0, 0], depth=2) == 0
    # a tensor list off the fast path (mixed dtypes) loops: one kernel per tensor
    fake = [torch.empty(4), torch.empty(4, dtype=torch.bfloat16)]
    assert launches.device_kernels(torch.ops.aten._foreach_mul_.Scalar, (fake, 2.0),
                                   "cuda") == 2
    same = [torch.empty(4), torch.empty(4)]
    assert launches.device_kernels(torch.ops.aten._foreach_mul_.Scalar, (same, 2.0),
                                   "cuda") == 1
    assert launches.device_kernels(torch.ops.aten._foreach_norm.Scalar, (same,), "cuda") == 2
    # on a CPU job every computing op is one (what torch.profiler records there)
    assert launches.device_kernels(torch.ops.aten._foreach_mul_.Scalar, (fake, 2.0),
                                   "cpu") == 1


def test_the_counter_knows_every_multi_kernel_cuda_op():
    from megazero.ops import cuda_ops
    for op, kernels in cuda_ops.KERNELS_PER_CALL.items():
        assert launches.MULTI_KERNEL[op] == kernels
    assert launches.profiler_name("aten._foreach_norm.Scalar") == "aten::_foreach_norm"
    assert launches.profiler_name("megazero.rms_norm_backward.default") == \
        "megazero::rms_norm_backward"
