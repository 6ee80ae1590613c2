"""Issue 14, checkpoint integrity: corrupted, swapped or misplaced checkpoint files, bad trackers
and layout files, stale temporaries, two writers on one --save, a --load typo next to a newer
--save, and non-finite states are each an error naming the file (or tensor), never a silent
load, a silent fresh start or a lost checkpoint.

Real checkpoints are written once per module (one process, ZeRO-1; and tp2 x dp2, ZeRO-1 at
iterations 2 and 4) and damaged in copies; most cases check them with the loader's own
verification (``CheckpointReader.verify_all``, what ``load_checkpoint`` runs first), a few
load them end to end."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.checkpoint import (
    CheckpointError,
    CheckpointReader,
    checkpoint_model_args,
    load_checkpoint,
    prepare_save_dir,
    read_tracker,
    save_checkpoint,
)
from megazero.checkpoint.paths import LOCK_FILE, TRACKER, read_layout_file
from megazero.distributed.parallel_state import ParallelState
from megazero.training import pretrain
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, run_training

ROOT = Path(__file__).resolve().parents[2]
ONE = " --zero-stage 1"
TP2 = " --tensor-model-parallel-size 2 --zero-stage 1"
CELL = "iter_0000003/mp_rank_00"
MODEL, SHARD0, SHARD1 = ("model_optim_rng.pt", "zero_dp_rank_000_optim_states.pt",
                         "zero_dp_rank_001_optim_states.pt")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, ZeRO-1, 3 iterations: a model file and one optimizer shard."""
    root = tmp_path_factory.mktemp("single") / "ckpt"
    run_training(TINY + f" --train-iters 3 --save {root}" + ONE, 1)
    return root


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """tp2 x dp2, ZeRO-1, saved at iterations 2 and 4: two cells of two shards each."""
    root = tmp_path_factory.mktemp("grid") / "ckpt"
    run_training(TINY + f" --train-iters 4 --save-interval 2 --save {root}" + TP2, 4)
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _verify(root, verify=True) -> None:
    CheckpointReader(str(root), verify=verify).verify_all()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _config(argv: str):
    return parse_args((TINY + " --train-iters 3 " + argv).split(), world_size=1)


# ---- checksums ---------------------------------------------------------------------------
def test_every_file_records_its_checksum_and_coordinates(single, grid):
    for root, iteration in ((single, 3), (grid, 4)):
        layout = read_layout_file(str(root), iteration)
        assert layout["checksums"] == "crc32" and layout["megazero_format"] == 2
    side = json.loads((grid / "iter_0000004/mp_rank_01" / (SHARD1 + ".crc")).read_text())
    assert side["coords"] == {"kind": "zero_shard", "iteration": 4, "tp_rank": 1, "tp_size": 2,
                              "pp_rank": 0, "pp_size": 1, "dp_rank": 1, "dp_size": 2}
    path = grid / "iter_0000004/mp_rank_01" / SHARD1
    assert side["size"] == path.stat().st_size
    state = torch.load(path, weights_only=True)
    assert state["coords"] == side["coords"]
    model = torch.load(grid / "iter_0000004/mp_rank_01" / MODEL, weights_only=True)
    assert model["coords"] == {"kind": "model", "iteration": 4, "tp_rank": 1, "tp_size": 2,
                               "pp_rank": 0, "pp_size": 1}
    # and the slice it holds: each tensor's full shape, dim, start and length
    meta = model["param_meta"]["embedding.word_embeddings.weight"]
    assert (meta["full_shape"], meta["dim"], meta["start"]) == ([96, 32], 0, 48)
    assert len(CheckpointReader(str(grid)).verify_all()) == 6


def _flip(data: bytes, rng: random.Random, n: int) -> bytes:
    out = bytearray(data)
    at = rng.randrange(len(out) - n)
    for i in range(at, at + n):
        out[i] ^= rng.randrange(1, 256)
    return bytes(out)


def test_100_random_byte_flips_are_each_an_error_naming_the_file(single, tmp_path):
    root = _copy(single, tmp_path / "ckpt")
    rng = random.Random(14)
    files = [root / CELL / MODEL, root / CELL / SHARD0]
    originals = {f: f.read_bytes() for f in files}
    for i in range(100):
        path = files[i % 2]
        n = 1 if i % 4 < 2 else 16  # one byte, or 16 bytes XOR-ed as in the issue
        path.write_bytes(_flip(originals[path], rng, n))
        with pytest.raises(CheckpointError) as exc:
            _verify(root)
        msg = str(exc.value)
        assert f"checkpoint file {path} is corrupt" in msg and "crc32" in msg, msg
        path.write_bytes(originals[path])
    _verify(root)


def test_truncated_or_damaged_sidecar_is_an_error(single, tmp_path):
    root = _copy(single, tmp_path / "ckpt")
    path = root / CELL / SHARD0
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt or truncated: .* bytes"):
        _verify(root)
    shutil.copy(single / CELL / SHARD0, path)
    side = Path(str(path) + ".crc")
    side.write_bytes(b"\x00\xff garbage")
    with pytest.raises(CheckpointError, match=f"checksum file {side}"):
        _verify(root)
    side.unlink()  # a format-2 checkpoint without one of its checksum files
    with pytest.raises(CheckpointError, match=f"{path} has no checksum file"):
        _verify(root)
    _verify(root, verify=False)  # --no-verify-checkpoint: no checksums needed


def _tensor_data_offset(path: Path) -> int:
    """An offset inside the largest tensor record of a torch zip file: a flip there leaves a
    file that unpickles (torch.load does not check the zip CRCs)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


def _cli(argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "pretrain_gpt2.py", *argv.split()], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_flipped_checkpoint_fails_on_the_command_line(single, tmp_path):
    root = _copy(single, tmp_path / "ckpt")
    path = root / CELL / MODEL
    data = bytearray(path.read_bytes())
    at = _tensor_data_offset(path)
    for i in range(at, at + 16):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))
    argv = TINY + f" --train-iters 4 --load {root}" + ONE
    bad = _cli(argv)
    assert bad.returncode != 0
    assert "CheckpointError" in bad.stderr and f"{path} is corrupt" in bad.stderr, \
        bad.stderr[-2000:]
    # --no-verify-checkpoint skips the checksums (the damage is in tensor values: it loads)
    unchecked = _cli(argv + " --no-verify-checkpoint")
    assert unchecked.returncode == 0, unchecked.stderr[-2000:]


# ---- coordinates -------------------------------------------------------------------------
def _swap(a: Path, b: Path, sidecars: bool = True) -> None:
    for suffix in ("", ".crc") if sidecars else ("",):
        x, y = Path(str(a) + suffix), Path(str(b) + suffix)
        tmp = x.with_name(x.name + ".swap")
        x.rename(tmp)
        y.rename(x)
        tmp.rename(y)


def test_swapped_tp_folders_are_an_error_naming_the_file(grid, tmp_path):
    root = _copy(grid, tmp_path / "ckpt")
    it = root / "iter_0000004"
    _swap(it / "mp_rank_00", it / "mp_rank_01", sidecars=False)  # folders: files and sidecars
    for verify in (True, False):  # coordinates are checked with or without checksums
        with pytest.raises(CheckpointError) as exc:
            _verify(root, verify)
        msg = str(exc.value)
        assert f"{it / 'mp_rank_00' / MODEL} belongs elsewhere" in msg, msg
        assert "tp_rank 1 (expected 0)" in msg
    # end to end at the saved tp (the case loaded with rc 0), checksums off
    with pytest.raises(RuntimeError) as exc:
        run_training(TINY + f" --train-iters 6 --load {root} --no-verify-checkpoint" + TP2, 2)
    assert "CheckpointError" in str(exc.value) and "tp_rank 1 (expected 0)" in str(exc.value)


def _shard_swaps(root: Path) -> list[tuple[Path, Path]]:
    it2, it4 = root / "iter_0000002", root / "iter_0000004"
    c0, c1 = "mp_rank_00", "mp_rank_01"
    return [
        (it4 / c0 / SHARD0, it4 / c0 / SHARD1), (it4 / c1 / SHARD0, it4 / c1 / SHARD1),  # dp
        (it4 / c0 / SHARD0, it4 / c1 / SHARD0), (it4 / c0 / SHARD1, it4 / c1 / SHARD1),  # tp
        (it4 / c0 / SHARD0, it4 / c1 / SHARD1), (it4 / c0 / SHARD1, it4 / c1 / SHARD0),  # both
        *[(it4 / c / s, it2 / c / s) for c in (c0, c1) for s in (SHARD0, SHARD1)],  # iteration
    ]


def test_10_swapped_zero_shards_are_each_an_error_naming_the_files(grid, tmp_path):
    root = _copy(grid, tmp_path / "ckpt")
    swaps = _shard_swaps(root)
    assert len(swaps) == 10
    for a, b in swaps:
        # file and checksum moved together: the recorded coordinates differ, before unpickling
        _swap(a, b)
        with pytest.raises(CheckpointError, match="belongs elsewhere") as exc:
            CheckpointReader(str(root), iteration=int(a.parent.parent.name[5:])).verify_all()
        assert str(a) in str(exc.value)
        _swap(a, b)
        # the .pt files alone: their bytes are not the ones recorded there
        _swap(a, b, sidecars=False)
        with pytest.raises(CheckpointError, match=f"{a} is corrupt or truncated"):
            CheckpointReader(str(root), iteration=int(a.parent.parent.name[5:])).verify_all()
        # ... and with --no-verify-checkpoint, the coordinates inside the file
        with pytest.raises(CheckpointError, match=f"{a} belongs elsewhere"):
            CheckpointReader(str(root), iteration=int(a.parent.parent.name[5:]),
                             verify=False).verify_all()
        _swap(a, b, sidecars=False)
    _verify(root)
    # end to end: a load at another layout reads every shard (was a bare KeyError)
    a, b = swaps[0]
    _swap(a, b, sidecars=False)
    with pytest.raises(RuntimeError) as exc:
        run_training(TINY + f" --train-iters 6 --load {root} --no-verify-checkpoint" + ONE, 1)
    assert "CheckpointError" in str(exc.value) and "dp_rank" in str(exc.value)
    assert "zero_dp_rank_00" in str(exc.value)


# ---- the tracker and layout.json ---------------------------------------------------------
TRACKERS = {
    "folder": None,
    "binary junk": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    "negative": b"-3\n",
    "not an integer": b"3.5\n",
    "empty": b"",
    "missing iteration": b"7\n",
    "too long": b"3" * 100,
}


@pytest.mark.parametrize("case", list(TRACKERS))
def test_bad_tracker_is_an_error_naming_the_file(single, tmp_path, case):
    root = _copy(single, tmp_path / "ckpt")
    tracker = root / TRACKER
    tracker.unlink()
    if TRACKERS[case] is None:
        tracker.mkdir()
    else:
        tracker.write_bytes(TRACKERS[case])
    for call in (lambda: read_tracker(str(root)), lambda: CheckpointReader(str(root)),
                 lambda: checkpoint_model_args(str(root)),
                 lambda: load_checkpoint(str(root), model_chunks=[], optimizer=None,
                                         lr_scheduler=None, config=None, ps=ParallelState())):
        with pytest.raises(CheckpointError, match=f"tracker file {tracker}"):
            call()


def test_tracker_folder_never_trains_from_random(single, tmp_path):
    root = _copy(single, tmp_path / "ckpt")
    (root / TRACKER).unlink()
    (root / TRACKER).mkdir()
    with pytest.raises(RuntimeError) as exc:
        run_training(TINY + f" --train-iters 4 --load {root}" + ONE, 1)
    assert "CheckpointError" in str(exc.value) and "is a folder" in str(exc.value)


LAYOUTS = {
    "binary junk": b"\x00\x01\xfe\xff{",
    "not json": b'{"layout": {"tp": 1,',
    "not an object": b"[1, 2]",
    "bad sizes": b'{"layout": {"tp": "two", "pp": 1, "dp": 1, "zero_stage": 1}, "model": {}}',
    "bad stage": b'{"layout": {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 7}, "model": {}}',
    "folder": None,
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_bad_layout_file_is_an_error_naming_the_file(single, tmp_path, case):
    root = _copy(single, tmp_path / "ckpt")
    path = root / "iter_0000003" / "layout.json"
    path.unlink()
    if LAYOUTS[case] is None:
        path.mkdir()
    else:
        path.write_bytes(LAYOUTS[case])
    for call in (lambda: read_layout_file(str(root), 3), lambda: CheckpointReader(str(root)),
                 lambda: checkpoint_model_args(str(root))):
        with pytest.raises(CheckpointError, match=f"layout file {path}"):
            call()


def test_layout_file_disagreeing_with_the_files_is_an_error(single, tmp_path):
    root = _copy(single, tmp_path / "ckpt")
    path = root / "iter_0000003" / "layout.json"
    data = json.loads(path.read_text())
    data["layout"]["zero_stage"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"layout file {path} and .* disagree "
                       r"\(zero_stage: 2 vs 1\)"):
        _ = CheckpointReader(str(root)).args


def test_old_checkpoint_without_records_loads_with_a_warning(single, tmp_path, caplog):
    """Checkpoints saved before checksums and coordinates (format 1) still load."""
    root = _copy(single, tmp_path / "ckpt")
    for name in (MODEL, SHARD0):
        path = root / CELL / name
        state = torch.load(path, weights_only=True)
        del state["coords"], state["megazero_format"]
        torch.save(state, path)
        Path(str(path) + ".crc").unlink()
    layout = root / "iter_0000003" / "layout.json"
    data = json.loads(layout.read_text())
    del data["checksums"], data["megazero_format"]
    layout.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="megazero.checkpoint.reader"):
        _verify(root)
    assert "saved without checksums or coordinates" in caplog.text
    layout.unlink()  # older still: no layout.json either
    reader = CheckpointReader(str(root))
    assert reader.verify_all() and reader.layout["zero_stage"] == 1
    losses, _, _ = run_training(TINY + f" --train-iters 4 --load {root}" + ONE, 1)
    assert len(losses) == 1


# ---- the save folder: stale temporaries, the lock, --load next to --save ------------------
def _plant_temps(root: Path, dead: int) -> tuple[list[Path], list[Path]]:
    stale = [root / f"{TRACKER}.tmp.{dead}", root / "iter_0000003" / f"layout.json.tmp.{dead}",
             root / CELL / f"{MODEL}.tmp.{dead}", root / CELL / f"{SHARD0}.crc.tmp.{dead}"]
    kept = [root / CELL / f"{MODEL}.tmp.{os.getpid()}",  # a live writer's
            root / f"notes.txt.tmp.{dead}"]  # not a checkpoint file
    for p in stale + kept:
        p.write_bytes(b"x" * 1000)
    return stale, kept


def test_stale_temporaries_of_dead_writers_are_removed(single, tmp_path, caplog):
    root = _copy(single, tmp_path / "ckpt")
    stale, kept = _plant_temps(root, _dead_pid())
    with caplog.at_level(logging.WARNING, logger="megazero.checkpoint"):
        prepare_save_dir(_config(f"--save {root} --load {root}"), ParallelState()).release()
    assert not [p for p in stale if p.exists()] and all(p.exists() for p in kept)
    assert "no longer running" in caplog.text
    # and at the next save of a run
    stale, kept = _plant_temps(root, _dead_pid())
    run_training(TINY + f" --train-iters 4 --load {root} --save {root}" + ONE, 1)
    assert read_tracker(str(root)) == 4
    assert not [p for p in stale if p.exists()] and all(p.exists() for p in kept)


def _holder(root: Path) -> subprocess.Popen:
    """Another process that takes the lock of ``root`` and keeps it."""
    code = ("import sys, time; from megazero.checkpoint.savedir import acquire_save_lock; "
            "acquire_save_lock(sys.argv[1]); print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_is_refused_naming_the_first_and_a_dead_lock_is_taken_over(
        tmp_path, caplog):
    root = tmp_path / "save"
    root.mkdir()
    holder = _holder(root)
    try:
        with pytest.raises(CheckpointError) as exc:
            prepare_save_dir(_config(f"--save {root}"), ParallelState())
        msg = str(exc.value)
        assert f"pid {holder.pid} on host {socket.gethostname()!r}" in msg, msg
        assert "which is alive" in msg and str(root / LOCK_FILE) in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without releasing: its lock is taken over, with a warning
    with caplog.at_level(logging.WARNING, logger="megazero.checkpoint"):
        guard = prepare_save_dir(_config(f"--save {root}"), ParallelState())
    assert f"took over the lock {root / LOCK_FILE} of pid {holder.pid}" in caplog.text
    record = json.loads((root / LOCK_FILE).read_text())
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    guard.release()
    guard.release()  # idempotent
    assert not (root / LOCK_FILE).exists()


def test_lock_from_another_host_is_refused_as_unknown(tmp_path):
    root = tmp_path / "save"
    root.mkdir()
    (root / LOCK_FILE).write_text(json.dumps({"host": "node-017", "pid": 4242,
                                              "started": "2025-01-01 00:00:00"}))
    with pytest.raises(CheckpointError, match="pid 4242 on host 'node-017'.*another host"):
        prepare_save_dir(_config(f"--save {root}"), ParallelState())
    assert json.loads((root / LOCK_FILE).read_text())["pid"] == 4242  # left alone


def test_unwritable_save_is_an_error_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for save in (blocker, blocker / "sub"):
        with pytest.raises(CheckpointError, match=f"--save {save} is"):
            prepare_save_dir(_config(f"--save {save}"), ParallelState())


def test_missing_load_next_to_a_newer_save_is_an_error(single, tmp_path, caplog):
    save = _copy(single, tmp_path / "save")
    typo = tmp_path / "sav"
    with pytest.raises(CheckpointError) as exc:
        prepare_save_dir(_config(f"--save {save} --load {typo}"), ParallelState())
    msg = str(exc.value)
    assert f"--load {typo} does not exist" in msg and f"--save {save}" in msg
    assert "iteration 3" in msg and not (save / LOCK_FILE).exists()
    typo.mkdir()  # a folder without a tracker is no checkpoint either
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        prepare_save_dir(_config(f"--save {save} --load {typo}"), ParallelState())
    assert read_tracker(str(save)) == 3
    # Megatron's idiom: --load equal to --save, on a first run where neither exists
    first = tmp_path / "first"
    prepare_save_dir(_config(f"--save {first} --load {first}"), ParallelState()).release()
    # resuming from an older checkpoint elsewhere is allowed, with a warning
    older = _copy(single, tmp_path / "older")
    (save / TRACKER).write_text("5\n")
    (save / "iter_0000005").mkdir()
    with caplog.at_level(logging.WARNING, logger="megazero.checkpoint"):
        prepare_save_dir(_config(f"--save {save} --load {older}"), ParallelState()).release()
    assert "move its tracker back" in caplog.text


# ---- non-finite states are never saved ---------------------------------------------------
def _poisoned_saves(argv, root):
    """Train three iterations (saved), then save with NaN/inf planted in an Adam moment, then in a
    parameter (and its fp32 main value): both saves must be refused, writing nothing."""
    config = parse_args(argv, world_size=dist.get_world_size())
    result = pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                      pretrain_gpt2.model_provider, pretrain_gpt2.forward_step, config)
    ps, optimizer, model = result.parallel_state, result.optimizer, result.model
    kwargs = dict(model_chunks=model, optimizer=optimizer, lr_scheduler=None, config=config,
                  ps=ps, consumed_train_samples=16)
    messages = []
    clean = optimizer.sharded_state_dict()
    state = optimizer.sharded_state_dict()
    state["fragments"]["layers.2.mlp.fc1.weight"][0]["exp_avg"][3] = float("inf")
    optimizer.load_sharded_state_dict(state)
    for poison in ("exp_avg", "param"):
        if poison == "param":
            optimizer.load_sharded_state_dict(clean)
            with torch.no_grad():
                dict(model[0].named_parameters())["layers.1.attention.proj.weight"] \
                    .view(-1)[0] = float("nan")
            optimizer.reload_model_params()
        try:
            save_checkpoint(root, 4 if poison == "exp_avg" else 5, **kwargs)
            messages.append(None)
        except CheckpointError as exc:
            messages.append(str(exc))
    return messages


def test_non_finite_states_are_never_saved(tmp_path):
    root = tmp_path / "ckpt"
    argv = (TINY + f" --train-iters 3 --save {root}" + ONE).split()
    moment, param = run_distributed(_poisoned_saves, 1, argv, str(root))[0]
    assert moment and "refusing to save iteration 4" in moment
    assert "layers.2.mlp.fc1.weight (exp_avg" in moment and "1 inf" in moment, moment
    assert param and "refusing to save iteration 5" in param
    assert "layers.1.attention.proj.weight (model values: 1 NaN" in param, param
    assert "layers.1.attention.proj.weight (main" in param
    assert read_tracker(str(root)) == 3  # the last good checkpoint is kept
    assert not (root / "iter_0000004").exists() and not (root / "iter_0000005").exists()

