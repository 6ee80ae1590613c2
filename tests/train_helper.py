"""Run pretrain_gpt2's training on N gloo ranks and collect losses and the full parameters."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.checkpoint.reshard import assemble
from megazero.data_parallel.zero3 import GatheredParameters
from megazero.tensor_parallel.meta import meta_of
from megazero.training import pretrain
from tests.dist_helper import run_distributed

# A tiny GPT-2, fp32, dropout off: every layout must reproduce the single-process math.
TINY = ("--mock-data --vocab-size 96 --make-vocab-size-divisible-by 8 --num-layers 4 "
        "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 8 --log-interval 1 --eval-iters 0 --lr 1e-3 "
        "--lr-warmup-iters 2 --attention-dropout 0 --hidden-dropout 0 --seed 1234 "
        "--clip-grad 1.0 --weight-decay 0.1")


def _train_worker(argv):
    config = parse_args(argv, world_size=dist.get_world_size())
    result = pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                      pretrain_gpt2.model_provider,
                      pretrain_gpt2.forward_step, config,
                      zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)
    ps, optimizer, model = result.parallel_state, result.optimizer, result.model
    history = plain_history(result)
    memory = optimizer.memory_report()  # before gathering everything below
    pieces = {}
    with GatheredParameters([p for c in model for p in c.parameters()]):
        for chunk in model:
            for name, p in chunk.named_parameters():
                meta = meta_of(p)
                if meta.shared_embedding:
                    continue  # the last stage's copy of the tied embedding
                pieces[name] = (p.detach().float().clone(), meta.shard.to_dict())
    return {"history": history, "pieces": pieces, "dp_rank": ps.dp_rank,
            "ring": ps.comm.ring_decisions(),
            "rank": dist.get_rank(), "memory": memory}


def plain_history(result) -> dict:
    """A pretrain result as picklable values: the history plus where training ended."""
    return {**result.history, "iteration": result.iteration,
            "consumed_train_samples": result.consumed_train_samples,
            "skipped_iters": result.skipped_iters, "nan_iters": result.nan_iters}


def run_training(argv: str, world: int, timeout: float = 300):
    """(per-iteration losses from the last rank, full parameters by name, per-rank results)."""
    results = run_distributed(_train_worker, world, argv.split(), timeout=timeout)
    losses = results[-1]["history"]["lm loss"]
    grouped = defaultdict(list)
    for r in results:
        if r["dp_rank"] == 0:
            for name, piece in r["pieces"].items():
                grouped[name].append(piece)
    full = {name: assemble(pieces) for name, pieces in grouped.items()}
    return losses, full, results


def _comparable(name, t, heads=4, groups=None):
    """The key bias of attention has an analytically zero gradient (softmax is invariant to
    adding q.b_k to every score of a row), so its values are rounding noise amplified by
    Adam's normalisation and differ between any two summation orders: compare q and v only
    (rows ``[group, (q_1 .. q_{heads/groups}, k, v), head_dim]``; groups = heads without
    grouped-query attention)."""
    if name.endswith("attention.qkv.bias"):
        groups = groups or heads
        per = heads // groups
        keep = [i for i in range(per + 2) if i != per]
        return t.view(groups, per + 2, -1)[:, keep]
    return t


def assert_same_run(a, b, rtol=1e-5, what="", kv_groups=None):
    """Losses and final parameters of two runs agree to ``rtol`` (relative to each max);
    ``kv_groups``: the key/value groups of TINY's 4 heads (grouped-query attention)."""
    (la, pa, _), (lb, pb, _) = a, b
    assert len(la) == len(lb) and len(la) > 0, (len(la), len(lb))
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=rtol, atol=0,
                               msg=lambda m: f"{what} losses differ: {la} vs {lb}\n{m}")
    assert pa.keys() == pb.keys(), sorted(set(pa) ^ set(pb))
    for name in pa:
        x = _comparable(name, pa[name], groups=kv_groups)
        y = _comparable(name, pb[name], groups=kv_groups)
        err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
        assert err <= rtol, f"{what}: parameter {name} differs (max rel err {err:.2e})"
