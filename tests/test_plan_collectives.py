"""The planner's predicted collectives equal what the dry run records (issue 28).

For each layout of a tiny GPT, the planner's own launch flags (``plan.layout.layout_flags``)
are dry-run (``megazero.dryrun``: the rank's real code on fake tensors over torch's fake
process group, one process) for the first rank of the pipeline stages checked (tp 0, dp 0),
two iterations. The collectives the second ``train_step`` records (schedule, gradient
finalisation, step; ZeRO 1-2's parameter all-gathers are posted by the step) are summed per
group and operation, calls and bytes sent, and the pipeline's exchanges are counted
(``P2P.post`` calls that post a message); all must equal
``plan.collectives.predicted_collectives`` exactly. The planner's time model charges the
same prediction (``cost.blocking_calls``, ``step_time``'s ``calls``).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.dryrun.run import DryRunOptions, run_rank
from megazero.pipeline_parallel.p2p import P2P
from megazero.plan.collectives import blocking_calls_of, predicted_collectives
from megazero.plan.cost import blocking_calls, step_time
from megazero.plan.layout import Job, Layout, layout_flags, model_flags
from megazero.plan.models import resolve_model
from megazero.plan.system import load_system

# the package re-exports the function ``pretrain`` under the module's name
PRETRAIN = importlib.import_module("megazero.training.pretrain")
PROVIDERS = (pretrain_gpt2.train_valid_test_datasets_provider, pretrain_gpt2.model_provider,
             pretrain_gpt2.forward_step, pretrain_gpt2.zero3_unit_policy)
MODEL = resolve_model("--num-layers 4 --hidden-size 32 --num-attention-heads 8 --seq-length 16 "
                      "--max-position-embeddings 16 --vocab-size 96 "
                      "--make-vocab-size-divisible-by 8")
RUN = ["--vocab-size", "96", "--make-vocab-size-divisible-by", "8", "--mock-data",
       "--attention-dropout", "0", "--hidden-dropout", "0"]

# (layout, global batch, dtype, pipeline stages checked, extra flags)
CASES = [
    (Layout(2, 1, 1, 1), 4, "fp32", (0,), []),
    (Layout(2, 1, 1, 1, sp=True), 4, "fp32", (0,), []),
    (Layout(2, 1, 1, 1, recompute="full"), 4, "fp32", (0,), []),
    (Layout(1, 2, 1, 1), 4, "fp32", (0, 1), []),
    (Layout(1, 2, 1, 1, virtual=2), 4, "fp32", (0, 1), []),
    # the interleaved schedule's blocking driver posts fewer, larger exchanges
    (Layout(1, 2, 1, 1, virtual=2), 4, "fp32", (1,), ["--no-overlap-p2p-communication"]),
    (Layout(1, 1, 2, 1, zero=0), 4, "fp32", (0,), []),
    (Layout(1, 1, 2, 1, zero=1), 4, "fp32", (0,), []),
    (Layout(1, 1, 2, 1, zero=2), 4, "fp32", (0,), []),
    (Layout(1, 1, 2, 1, zero=3), 4, "fp32", (0,), []),
    # ZeRO-3 recompute: units gathered again for the recomputed forward, and prefetched
    (Layout(1, 1, 2, 1, zero=3, recompute="full"), 4, "fp32", (0,), []),
    # ZeRO-3's last stage: layer 2's backward prefetches the tied embedding for nothing
    (Layout(1, 2, 2, 1, zero=3), 4, "fp32", (1,), []),
    # ZeRO-2 recompute: where a stage's first gradient arrives inside a recomputed layer
    # (the first stage, not the last: its final norm's come first), each layer's nested
    # backward ends the reducer's backward, and the bucket is reduced once per layer
    (Layout(1, 2, 2, 1, zero=2, recompute="full"), 4, "fp32", (0, 1), []),
    (Layout(2, 2, 2, 1, zero=1, sp=True), 4, "bf16", (0, 1), []),
    (Layout(2, 2, 1, 1, virtual=2, zero=0, sp=True, recompute="full"), 4, "fp32", (0, 1),
     []),
]


@pytest.fixture(autouse=True)
def _no_default_group():
    """The dry run installs torch's fake process group as the default one; a gloo group of one
    process that an earlier test's in-process engine left (``megazero.initialize`` in
    tests/test_pipe.py, test_onebit.py, test_nvme.py: destroyed only at exit) would make that
    fail, so it is closed first."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield


def _recorded(job: Job, lay: Layout, stage: int, extra: list[str]) -> dict:
    """The dry run's collectives of its second training iteration on the first rank of
    ``stage``: {group: {op: {"calls", "bytes"}}}, with the pipeline's exchanges as
    ``pp``/``exchange`` (bytes 0)."""
    argv = model_flags(job.model) + layout_flags(lay, job) + RUN + extra
    config = parse_args(argv, world_size=lay.world)
    rank = stage * lay.tp * lay.dp
    steps, posts = [], []
    train_step, post = PRETRAIN.train_step, P2P.post

    def counted_step(*args, **kwargs):
        records = args[5].comm.records  # train_step(..., config, ps, ...)
        start, posted = len(records), len(posts)
        result = train_step(*args, **kwargs)
        steps.append((start, len(records), posted, len(posts)))
        return result

    def counted_post(self, *args, **kwargs):
        exchange = post(self, *args, **kwargs)
        posts.append(bool(exchange.reqs))
        return exchange

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PRETRAIN, "train_step", counted_step)
        mp.setattr(P2P, "post", counted_post)
        run = run_rank(config, DryRunOptions(rank=rank, world_size=lay.world, device="cpu",
                                             iters=2, check_peers=False), rank, PROVIDERS)
    assert len(steps) == 2
    start, end, p0, p1 = steps[-1]
    got: dict = {}
    for r in run.records[start:end]:
        row = got.setdefault(r.group, {}).setdefault(r.op, {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += r.bytes
    if any(posts[p0:p1]):
        got["pp"]["exchange"] = {"calls": sum(posts[p0:p1]), "bytes": 0}
    return got


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("lay,gbs,dtype,stages,extra", CASES, ids=[
    "-".join([lay.short().replace(" ", "-")] + ([dtype] if dtype != "fp32" else [])
             + (["blocking"] if extra else [])) for lay, _, dtype, _, extra in CASES])
def test_predicted_collectives_equal_the_dry_run(lay, gbs, dtype, stages, extra):
    job = Job(MODEL, lay.world, gbs, dtype)
    for stage in stages:
        predicted = predicted_collectives(job, lay, stage, overlap_p2p=not extra)
        recorded = _recorded(job, lay, stage, extra)
        assert recorded == predicted, (stage, recorded, predicted)


def test_the_time_model_charges_the_prediction():
    """On the CPU system with more ranks than cores, ``step_time`` charges the blocking calls
    ``predicted_collectives`` gives the fullest stage (here the last: the output layer and
    the loss on top), by group size: tp, dp and the embedding group of 2, mp (tp x pp) of 4,
    and the pipeline's exchanges."""
    cpu = dataclasses.replace(load_system("cpu-local"), cores=2)
    model = resolve_model("--num-layers 4 --hidden-size 128 --num-attention-heads 8 "
                          "--seq-length 128 --vocab-size 2048")
    job = Job(model, 8, 16, "fp32")
    lay = Layout(2, 2, 2, 1, zero=1, sp=True)
    calls = step_time(job, lay, cpu).parts["calls"]
    assert calls == blocking_calls(job, lay) == blocking_calls_of(job, lay, 4 << 20)
    size = {"tp": 2, "dp": 2, "embedding": 2, "mp": 4, "pp": "p2p"}
    last: dict = {}
    for group, ops in predicted_collectives(job, lay, -1).items():
        for op, row in ops.items():
            if group != "pp" or op == "exchange":
                last[size[group]] = last.get(size[group], 0) + row["calls"]
    assert calls == last
    assert calls["p2p"] == 9  # 1F1B over 8 micro-batches: m + 1 exchanges on either stage
