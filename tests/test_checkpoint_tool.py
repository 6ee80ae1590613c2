"""python -m megazero.tools.checkpoint: offline groups, inspect, convert (tp2 pp2 -> tp1 pp1 ->
tp2 pp2, then training resumes with the losses of an uninterrupted run), to-fp32, errors."""

import json

import pytest
import torch

from megazero.checkpoint import read_tracker
from megazero.distributed import comm
from megazero.distributed.parallel_state import rank_grid
from megazero.tensor_parallel.meta import meta_of
from megazero.tools.checkpoint import main as tool
from megazero.tools.consolidate import consolidate
from megazero.tools.offline import build_cell, offline_parallel_state
from tests.train_helper import TINY, assert_same_run, run_training

ARGV = TINY + " --train-iters 8"
TP2PP2 = " --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"


def test_offline_groups_describe_a_rank_and_refuse_collectives():
    g = comm.OfflineGroup(4, 3, "tp")
    assert comm.group_size(g) == 4 and comm.group_rank(g) == 3
    for call in (lambda: comm.all_reduce(torch.zeros(2), g), lambda: comm.barrier(g),
                 lambda: comm.broadcast(torch.zeros(2), 0, g),
                 lambda: comm.all_gather_object({}, g)):
        with pytest.raises(comm.OfflineGroupError, match="offline group 'tp'"):
            call()
    ps = offline_parallel_state(2, 1, 2, 1, dp_size=2, dp_rank=1)
    grid = rank_grid(8, 2, 2)
    assert ps.rank == 7 and ps.world_size == 8
    for kind in ("tp", "dp", "pp", "mp", "embedding"):
        assert getattr(ps, f"{kind}_ranks") in grid[kind], kind
    assert (comm.group_size(ps.tp_group), comm.group_rank(ps.tp_group)) == (2, 1)
    assert ps.is_last_stage and comm.group_size(ps.embedding_group) == 2


def test_offline_cell_has_the_shapes_of_a_live_rank():
    from megazero.config import ModelConfig

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100,
                      make_vocab_size_divisible_by=8)
    last = build_cell(cfg, 2, 1, 2, 1)  # tp rank 1 of 2, last of 2 stages
    params = dict(last.named_parameters())
    assert all(p.device.type == "meta" for p in params.values())
    assert sorted({n.split(".")[1] for n in params if n.startswith("layers.")}) == ["2", "3"]
    emb = params["embedding.word_embeddings.weight"]  # vocab 100 padded to 112: 56 per rank
    shard = meta_of(emb).shard
    assert emb.shape == (56, 32) and shard.start == 56 and shard.length == 44
    assert params["layers.3.mlp.fc2.weight"].shape == (32, 64)
    assert "embedding.position_embeddings.weight" not in params


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 8-iteration run (one process) and a tp2 pp2 run stopped after 4."""
    root = tmp_path_factory.mktemp("convert")
    full = run_training(ARGV, 1)
    run_training(ARGV + TP2PP2 + f" --exit-interval 4 --save {root / 'a'}", 4)
    return root, full


def test_inspect_reports_layout_and_tensors(runs, capsys):
    root, _ = runs
    assert tool(["inspect", str(root / "a")]) == 0
    out = capsys.readouterr().out
    assert "iteration 4" in out and "tp=2 pp=2 dp=1 zero_stage=0" in out
    line = next(s for s in out.splitlines() if s.startswith("layers.3.attention.proj.weight"))
    assert "32x32" in line and "float32" in line and "tp dim 1: 2 x [32, 16]" in line
    assert " 1 " in line  # pipeline stage 1
    assert "adam step 4" in out and "consumed samples 32" in out
    assert tool(["inspect", str(root / "a"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    emb = next(t for t in d["tensors"] if t["name"] == "embedding.word_embeddings.weight")
    assert emb["full_shape"] == [96, 32] and emb["stages"] == [0, 1]
    assert d["total_parameters"] == sum(t["numel"] for t in d["tensors"])


def test_convert_there_and_back_resumes_exactly(runs):
    root, (losses, params, _) = runs
    a, b, c = (str(root / n) for n in "abc")
    assert tool(["convert", a, b, "--tp", "1", "--pp", "1"]) == 0
    assert tool(["convert", b, c, "--tp", "2", "--pp", "2"]) == 0
    assert read_tracker(b) == read_tracker(c) == 4
    for kind in ("model", "main", "exp_avg", "exp_avg_sq"):  # nothing lost on the way
        src, back = consolidate(a, kind=kind), consolidate(c, kind=kind)
        assert all(torch.equal(src[n], back[n]) for n in src), kind
    uninterrupted = (losses[4:], params, None)
    resumed_tp1 = run_training(ARGV + f" --load {b}", 1)
    assert_same_run(resumed_tp1, uninterrupted, what="converted to tp1 pp1")
    resumed_tp2pp2 = run_training(ARGV + TP2PP2 + f" --load {c}", 4)
    assert_same_run(resumed_tp2pp2, uninterrupted, what="converted back to tp2 pp2")


def test_convert_to_fp32_and_errors(runs, tmp_path, capsys):
    root, _ = runs
    out = tmp_path / "fp32.pt"
    assert tool(["to-fp32", str(root / "a"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    ref = consolidate(str(root / "a"))
    assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)
    assert tool(["convert", str(root / "a"), str(tmp_path / "x"), "--tp", "3"]) == 1
    assert "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (3)" \
        in capsys.readouterr().err
    assert tool(["convert", str(root / "a"), str(tmp_path / "y"), "--tp", "1", "--pp",
                 "3"]) == 1
    assert "--num-layers (4) must be divisible by --pipeline-model-parallel-size (3)" \
        in capsys.readouterr().err
    assert tool(["convert", str(root / "a"), str(root / "a"), "--tp", "1", "--force"]) == 1
    assert "would write over its source" in capsys.readouterr().err
    assert tool(["convert", str(root / "a"), str(tmp_path / "z"), "--tp", "1"]) == 0
    assert tool(["convert", str(root / "a"), str(tmp_path / "z"), "--tp", "1"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert tool(["inspect", str(tmp_path / "none")]) == 1
