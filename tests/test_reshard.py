"""Checkpoints load at any layout: save at A after 6 steps, resume at B for 6 more, and match the
uninterrupted run (every layout reproduces the single-process math, so one 12-step run at one
process is the reference for all)."""

import pytest
import torch

from megazero.checkpoint import CheckpointError, CheckpointReader
from tests.train_helper import TINY, assert_same_run, run_training

TP2, PP2 = "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2"
PP4 = "--pipeline-model-parallel-size 4"
VPP = PP2 + " --num-layers-per-virtual-pipeline-stage 1"
T2P2 = f"{TP2} {PP2}"


@pytest.fixture(scope="module")
def uninterrupted():
    return run_training(TINY + " --train-iters 12", 1)


def _resume(tmp_path, a, wa, b, wb, extra=""):
    run_training(TINY + f" --train-iters 12 --exit-interval 6 --save {tmp_path} {a}", wa)
    return run_training(TINY + f" --train-iters 12 --load {tmp_path} {b}" + extra, wb)


PAIRS = [
    (TP2, 2, "", 1), ("", 1, TP2, 2),
    (PP2, 2, "", 1), ("", 1, PP2, 2), (PP2, 2, PP4, 4), (VPP, 2, PP2, 2),
    (f"{T2P2} --zero-stage 2", 8, "", 1), ("", 1, f"{T2P2} --zero-stage 2 --sequence-parallel", 8),
    ("--zero-stage 1", 2, "--zero-stage 3", 2), ("--zero-stage 3", 2, "--zero-stage 0", 2),
] + [(f"--zero-stage {s}", a, f"--zero-stage {s}", b) for s in range(4)
     for a, b in ((2, 4), (4, 2))]


@pytest.mark.parametrize("a,wa,b,wb", PAIRS)
def test_resume_at_another_layout(tmp_path, uninterrupted, a, wa, b, wb):
    losses, params, _ = _resume(tmp_path, a, wa, b, wb)
    assert len(losses) == 6
    ref_losses, ref_params, _ = uninterrupted
    assert_same_run((losses, params, None), (ref_losses[6:], ref_params, None),
                    what=f"[{a}] x{wa} -> [{b}] x{wb}")


def test_no_load_optim_and_finetune(tmp_path, uninterrupted):
    run_training(TINY + f" --train-iters 12 --exit-interval 6 --save {tmp_path} {TP2}", 2)
    # --finetune: the weights only, from iteration 0 (a full 12-iteration run)
    ft, _, res = run_training(TINY + f" --train-iters 12 --load {tmp_path} --finetune", 1)
    assert len(ft) == 12 and res[-1]["history"]["consumed_train_samples"] == 96
    # --no-load-optim: continues at iteration 6 with fresh Adam moments: different losses
    no_opt, _, _ = run_training(TINY + f" --train-iters 12 --load {tmp_path} --no-load-optim",
                                1)
    assert len(no_opt) == 6 and no_opt != uninterrupted[0][6:]


def test_reader_streams_only_own_slices(tmp_path):
    run_training(TINY + f" --train-iters 3 --save {tmp_path} {TP2} --zero-stage 1", 4)
    reader = CheckpointReader(str(tmp_path))
    assert (reader.tp, reader.pp, reader.dp, reader.stage) == (2, 1, 2, 1)
    full = reader.full_tensor("layers.1.mlp.fc1.weight", "main")
    from megazero.tensor_parallel.meta import ShardInfo

    # the second half of the rows (what tp rank 1 of a tp=2 layout holds) touches only cell 1
    reader = CheckpointReader(str(tmp_path))
    half = reader.read_flat("layers.1.mlp.fc1.weight", "main",
                            ShardInfo(tuple(full.shape), 0, 64, 64), (64, 32))
    assert torch.equal(half.view(64, 32), full[64:])
    assert reader.model_file.cache_info().currsize == 2  # metadata of cells (0, 0), (1, 0)
    assert reader.shard.cache_info().currsize == 2  # the two dp shards of cell (1, 0) only


def test_different_model_shape_is_named(tmp_path):
    run_training(TINY + f" --train-iters 3 --save {tmp_path} {TP2}", 2)
    with pytest.raises(RuntimeError) as exc:
        run_training(TINY.replace("--num-layers 4", "--num-layers 2")
                     + f" --train-iters 4 --load {tmp_path}", 1)
    assert "num_layers: checkpoint 4 vs current 2" in str(exc.value)
    assert CheckpointError.__name__ in str(exc.value)


def test_row_copies_equal_element_indexing(tmp_path):
    """The fast row path of read_flat agrees with per-element indexing on random regions."""
    run_training(TINY + f" --train-iters 3 --save {tmp_path} {TP2} --zero-stage 2", 4)
    reader = CheckpointReader(str(tmp_path))
    from megazero.tensor_parallel.meta import ShardInfo

    gen = torch.Generator().manual_seed(0)
    names = ["embedding.word_embeddings.weight", "layers.0.attention.qkv.weight",
             "layers.1.mlp.fc2.weight", "layers.2.attention.proj.bias", "final_layernorm.weight"]
    for name in names:
        full = tuple(reader.meta(name)["full_shape"])
        for _ in range(4):
            dim = int(torch.randint(0, len(full), (1,), generator=gen)) \
                if torch.rand(1, generator=gen) < 0.7 else None
            if dim is None:
                shard, local = ShardInfo(full, None), full
            else:
                n = full[dim]
                start = int(torch.randint(0, n, (1,), generator=gen))
                length = int(torch.randint(1, n - start + 1, (1,), generator=gen))
                pad = int(torch.randint(0, 3, (1,), generator=gen))
                local = list(full)
                local[dim] = length + pad
                shard, local = ShardInfo(full, dim, start, length), tuple(local)
            numel = int(torch.tensor(local).prod())
            a = int(torch.randint(0, numel, (1,), generator=gen))
            b = int(torch.randint(a + 1, numel + 1, (1,), generator=gen))
            for kind in ("model", "main", "exp_avg"):
                fast = reader.read_flat(name, kind, shard, local, a, b)
                slow = reader._read_indexed(name, kind, shard, local, a, b)
                assert torch.equal(fast, slow), (name, kind, shard, local, a, b)


def test_other_vocab_padding_at_the_same_layout(tmp_path, uninterrupted):
    padded = TINY.replace("--make-vocab-size-divisible-by 8", "--make-vocab-size-divisible-by 64")
    run_training(padded + f" --train-iters 12 --exit-interval 6 --save {tmp_path}", 1)
    losses, params, _ = run_training(TINY + f" --train-iters 12 --load {tmp_path}", 1)
    assert_same_run((losses, params, None), (uninterrupted[0][6:], uninterrupted[1], None),
                    what="vocab padding 128 -> 96")
