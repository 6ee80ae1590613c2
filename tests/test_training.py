"""GPT-2 training: tp/sp/dp parity with one process, exact resume, loss scaling, bad inputs."""

import os

import pytest
import torch

from megazero.checkpoint import CheckpointError
from tests.train_helper import TINY, assert_same_run, run_training

ITERS = " --train-iters 10"


@pytest.fixture(scope="module")
def single_process_run():
    return run_training(TINY + ITERS, 1)


@pytest.mark.parametrize("argv,world", [
    (" --tensor-model-parallel-size 2", 2),
    (" --tensor-model-parallel-size 2 --sequence-parallel", 2),
    ("", 2),  # dp = 2, same global batch
    (" --tensor-model-parallel-size 2 --sequence-parallel", 4),  # tp2 x dp2
])
def test_parallel_layouts_match_single_process(single_process_run, argv, world):
    run = run_training(TINY + ITERS + argv, world)
    assert_same_run(run, single_process_run, what=argv or f"dp={world}")


def test_gradient_accumulation_matches_large_micro_batch(single_process_run):
    # 4 micro-batches of 2 vs 1 micro-batch of 8: same samples, same update
    run = run_training(TINY.replace("--micro-batch-size 2", "--micro-batch-size 8") + ITERS, 1)
    assert_same_run(run, single_process_run, what="micro-batch 8")


def test_activation_recompute_matches(single_process_run):
    run = run_training(TINY + ITERS + " --recompute-granularity full --checkpoint-num-layers 2", 1)
    assert_same_run(run, single_process_run, rtol=1e-6, what="recompute")


DROPOUT = TINY.replace("--attention-dropout 0 --hidden-dropout 0",
                       "--attention-dropout 0.1 --hidden-dropout 0.1")


@pytest.mark.parametrize("argv,world", [("", 1), (" --tensor-model-parallel-size 2", 4)])
def test_resume_is_exact_with_dropout(tmp_path, argv, world):
    full = run_training(DROPOUT + " --train-iters 20" + argv, world)
    save = f" --save {tmp_path} --save-interval 5"
    first = run_training(DROPOUT + " --train-iters 20 --exit-interval 10" + save + argv, world)
    assert open(tmp_path / "latest_checkpointed_iteration.txt").read().strip() == "10"
    second = run_training(DROPOUT + f" --train-iters 20 --load {tmp_path}" + argv, world)
    assert first[0] == full[0][:10]
    assert second[0] == full[0][10:], "resumed losses differ from the uninterrupted run"
    assert second[2][-1]["history"]["consumed_train_samples"] == 20 * 8
    for name, p in full[1].items():
        assert torch.equal(p, second[1][name]), f"{name} differs after resume"


def test_missing_tracker_starts_fresh(tmp_path, capsys):
    losses, _, _ = run_training(TINY + f" --train-iters 3 --load {tmp_path}", 1)
    assert len(losses) == 3


def _corrupt_and_load(tmp_path, mutate, extra=""):
    run_training(TINY + f" --train-iters 3 --save {tmp_path}", 1)
    mutate(tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(RuntimeError) as exc:
        run_training(TINY + f" --train-iters 4 --load {tmp_path}" + extra, 1)
    return str(exc.value)


def test_truncated_checkpoint_gives_clear_error(tmp_path):
    def truncate(path):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    msg = _corrupt_and_load(tmp_path, truncate)
    assert "model_optim_rng.pt is corrupt or truncated" in msg
    assert CheckpointError.__name__ in msg


def test_different_hidden_size_gives_clear_error(tmp_path):
    msg = _corrupt_and_load(tmp_path, lambda p: None,
                            " --hidden-size 48 --ffn-hidden-size 128")
    assert "hidden_size: checkpoint 32 vs current 48" in msg


def test_checkpoint_files_are_weights_only_and_atomic(tmp_path):
    run_training(TINY + f" --train-iters 3 --save {tmp_path} --save-interval 2", 1)
    assert open(tmp_path / "latest_checkpointed_iteration.txt").read().strip() == "3"
    for it in ("iter_0000002", "iter_0000003"):
        path = tmp_path / it / "mp_rank_00" / "model_optim_rng.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert state["iteration"] == int(it[-1])
        meta = state["param_meta"]["embedding.word_embeddings.weight"]
        assert meta["full_shape"] == [96, 32] and meta["dim"] == 0
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if ".tmp." in f]
    assert not leftovers
