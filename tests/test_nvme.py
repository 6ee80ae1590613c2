"""ZeRO-Infinity: --offload-optimizer nvme (ZeRO 1-3: fp32 main values and Adam moments in swap
files, streamed in sub-groups) and --offload-param nvme (ZeRO-3's parameter partition in a swap
file): bit for bit the --cpu-offload run, checkpoints that load with and without NVMe at any
layout, a kill -9 mid-step, the dry run, scratch files removed, and the refusals."""

import os

import pytest
import torch

from megazero.config import ConfigError, OptimizerConfig
from tests.test_dryrun import dry_run_cli
from tests.train_helper import TINY, assert_same_run, run_training


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 2), (2, 1)])
def test_nvme_step_equals_the_cpu_offloaded_step_bit_for_bit(tmp_path, stage, world):
    base = TINY + f" --train-iters 4 --zero-stage {stage}"
    cpu = run_training(base + " --cpu-offload", world)
    # small sub-groups: every step streams several through the two slots
    nvme = run_training(base + f" --offload-optimizer nvme --nvme-path {tmp_path} "
                        "--nvme-sub-group-size 3000", world)
    assert_same_run(nvme, cpu, rtol=0, what="NVMe vs CPU offload")
    assert not [p for p in os.listdir(tmp_path) if p.startswith("megazero-swap-")]


def test_checkpoints_move_between_nvme_and_memory_at_any_layout(tmp_path):
    nvme = f" --offload-optimizer nvme --nvme-path {tmp_path} --nvme-sub-group-size 5000"
    base = TINY + " --train-iters 6 --zero-stage 2"
    full = run_training(base + " --cpu-offload", 2)
    run_training(base + nvme + f" --exit-interval 3 --save {tmp_path / 'a'} "
                 "--save-interval 3", 2)
    # NVMe checkpoint -> CPU offload, same layout: the uninterrupted run
    resumed = run_training(base + f" --cpu-offload --load {tmp_path / 'a'}", 2)
    assert resumed[0] == full[0][3:]
    # CPU-offload checkpoint -> NVMe at dp 1 and back in memory at dp 2
    run_training(base + f" --cpu-offload --exit-interval 3 --save {tmp_path / 'b'} "
                 "--save-interval 3", 2)
    one = run_training(base + nvme + f" --load {tmp_path / 'b'}", 1)
    mem = run_training(base + f" --load {tmp_path / 'b'}", 1)
    assert one[0] == mem[0]


def test_refusals_name_the_flags(tmp_path):
    with pytest.raises(ConfigError, match="--nvme-path"):
        OptimizerConfig(zero_stage=2, offload_optimizer="nvme")
    with pytest.raises(ConfigError, match="--zero-stage 1, 2 or 3"):
        OptimizerConfig(zero_stage=0, offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match="--offload-param nvme .* --zero-stage 3 \\(got 2\\)"):
        OptimizerConfig(zero_stage=2, offload_optimizer="nvme", offload_param="nvme",
                        nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match="--offload-optimizer cpu or nvme"):
        OptimizerConfig(zero_stage=3, offload_param="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match="--nvme-path"):
        OptimizerConfig(zero_stage=3, cpu_offload=True, offload_param="nvme")
    with pytest.raises(ConfigError, match="LAMB"):
        OptimizerConfig(zero_stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path),
                        optimizer="lamb")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(Exception, match="not a writable directory"):
        run_training(TINY + " --train-iters 3 --zero-stage 2 --offload-optimizer nvme "
                     f"--nvme-path {tmp_path / 'a_file' / 'swap'}", 1)
    # a missing directory is created, as DeepSpeed creates its swap folder
    run_training(TINY + " --train-iters 3 --zero-stage 2 --offload-optimizer nvme "
                 f"--nvme-path {tmp_path / 'new' / 'swap'}", 1)
    assert (tmp_path / "new" / "swap").is_dir()


@pytest.mark.parametrize("world", [2, 1])
def test_zero3_optimizer_and_parameters_on_nvme_equal_cpu_offload_bit_for_bit(tmp_path, world):
    base = TINY + " --train-iters 4 --zero-stage 3"
    cpu = run_training(base + " --cpu-offload", world)
    nvme = f" --nvme-path {tmp_path}"
    states = run_training(base + " --offload-optimizer nvme --nvme-sub-group-size 3000" + nvme,
                          world)
    assert_same_run(states, cpu, rtol=0, what="ZeRO-3 optimizer states on NVMe")
    both = run_training(base + " --offload-optimizer nvme --offload-param nvme "
                        "--nvme-sub-group-size 3000" + nvme, world)
    assert_same_run(both, cpu, rtol=0, what="ZeRO-3 states and parameters on NVMe")
    params = run_training(base + " --cpu-offload --offload-param nvme" + nvme, world)
    assert_same_run(params, cpu, rtol=0, what="ZeRO-3 parameters on NVMe")
    memory = both[2][0]["memory"]
    assert memory["params"] == 0  # TINY has no persistent parameters: none resident
    assert memory["nvme_param_bytes"] >= 4 * sum(p.numel() for p in cpu[1].values()) // world
    assert not [p for p in os.listdir(tmp_path) if p.startswith("megazero-")]


def test_dry_run_of_a_zero_infinity_rank_moves_no_bytes(tmp_path):
    """One rank of a 64-rank ZeRO-3 job with states and parameters on NVMe, on fake CUDA:
    the swap I/O of fake tensors completes without moving bytes; parameters stay off the
    device between gathers (only the memory report's NVMe bytes carry them)."""
    report, _ = dry_run_cli(f"--tensor-model-parallel-size 2 --global-batch-size 32 "
                            f"--zero-stage 3 --offload-optimizer nvme --offload-param nvme "
                            f"--nvme-path {tmp_path}", 5, 64)
    mr = report["memory_report"]
    assert mr["params"] == 0 and mr["nvme_param_bytes"] > 0 and mr["nvme_bytes"] > 0
    assert report["optimizer_state_bytes"] == 0
    assert not os.listdir(tmp_path)


# Runs pretrain_gpt2.py with NvmeZeroOptimizer._write slowed down in one step: after that
# step's second sub-group went to the swap files it writes a marker and sleeps, so that the
# test's SIGKILL lands in the middle of the streamed update (swap files half old, half new).
_STALL = r"""
import os, runpy, sys, time
from megazero.data_parallel import nvme
write, calls = nvme.NvmeZeroOptimizer._write, {}
def stalled(self, g, slot):
    handles = write(self, g, slot)
    if self.step_count == int(os.environ["STALL_STEP"]):
        calls["n"] = calls.get("n", 0) + 1
        if calls["n"] == 2:
            self.aio.wait_all()
            open(os.environ["STALL_MARKER"], "w").close()
            time.sleep(600)
    return handles
nvme.NvmeZeroOptimizer._write = stalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_kill_9_during_an_nvme_step_leaves_the_last_checkpoint_loadable(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    swap, save, marker = tmp_path / "nvme", tmp_path / "ckpt", tmp_path / "stalled"
    swap.mkdir()
    base = TINY + " --train-iters 6 --zero-stage 2"
    nvme = f" --offload-optimizer nvme --nvme-path {swap} --nvme-sub-group-size 3000"
    env = {**os.environ, "STALL_STEP": "5", "STALL_MARKER": str(marker),
           "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _STALL, "pretrain_gpt2.py",
                             *(base + nvme).split(), "--save", str(save),
                             "--save-interval", "4"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate(timeout=60)[0].decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # in step 5, after iteration 4's checkpoint
    proc.wait(timeout=60)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    left = [p for p in os.listdir(swap) if p.startswith("megazero-swap-")]
    assert len(left) == 1  # the killed run's scratch, never read again
    # the checkpoint resumes, with NVMe and without, as the uninterrupted run goes on
    full = run_training(base + " --cpu-offload", 1)
    resumed = run_training(base + nvme + f" --load {save}", 1)
    assert resumed[0] == full[0][4:]
    assert not os.listdir(swap)  # the dead run's swap directory was removed at the start
    in_memory = run_training(base + f" --load {save}", 1)
    assert in_memory[0] == full[0][4:]


def test_zero_infinity_checkpoints_move_to_memory_and_back_at_other_layouts(tmp_path):
    nvme = (f" --offload-optimizer nvme --offload-param nvme --nvme-path {tmp_path} "
            "--nvme-sub-group-size 5000")
    base = TINY + " --train-iters 6"
    full = run_training(base + " --zero-stage 3 --cpu-offload", 2)
    # ZeRO-3 with states and parameters on NVMe at dp 2 -> ZeRO-1 in memory at dp 1
    run_training(base + " --zero-stage 3" + nvme + f" --exit-interval 3 --save {tmp_path / 'a'}"
                 " --save-interval 3", 2)
    resumed = run_training(base + f" --zero-stage 1 --load {tmp_path / 'a'}", 1)
    torch.testing.assert_close(torch.tensor(resumed[0]), torch.tensor(full[0][3:]),
                               rtol=1e-5, atol=0)
    # a ZeRO-2 checkpoint in memory at dp 2 -> ZeRO-Infinity at dp 1
    run_training(base + f" --zero-stage 2 --exit-interval 3 --save {tmp_path / 'b'} "
                 "--save-interval 3", 2)
    infinity = run_training(base + " --zero-stage 3" + nvme + f" --load {tmp_path / 'b'}", 1)
    memory = run_training(base + f" --zero-stage 3 --cpu-offload --load {tmp_path / 'b'}", 1)
    assert_same_run(infinity, memory, rtol=0, what="ZeRO-Infinity vs ZeRO-3 from a ZeRO-2 ckpt")


def _modify_worker(argv):
    import torch.distributed as dist

    import pretrain_gpt2
    from megazero.arguments import parse_args
    from megazero.data_parallel.zero3 import GatheredParameters
    from megazero.tensor_parallel.meta import meta_of
    from megazero.training import pretrain

    config = parse_args(argv, world_size=dist.get_world_size())
    result = pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                      pretrain_gpt2.model_provider, pretrain_gpt2.forward_step, config,
                      zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)
    opt, model = result.optimizer, result.model[0]
    name, param = [(n, p) for n, p in model.named_parameters()
                   if len(meta_of(p).local_shape) == 2][1]  # a layer's weight
    with GatheredParameters([param], modifier_rank=0):
        if result.parallel_state.dp_rank == 0:
            param.data.fill_(0.5)
    with GatheredParameters([param]):
        seen = param.detach().clone()
    key = next(n for n, pr in opt.layout.ranges.items() if pr.param is param)
    mains = [f["main"] for f in opt.sharded_state_dict()["fragments"].get(key, [])]
    return name, seen, mains


@pytest.mark.parametrize("offload", ["--cpu-offload", "--offload-optimizer nvme "
                                     "--offload-param nvme"])
def test_gathered_parameters_modified_on_one_rank_reach_every_rank_and_the_optimizer(
        tmp_path, offload):
    from tests.dist_helper import run_distributed

    argv = TINY + " --train-iters 3 --zero-stage 3 " + offload + f" --nvme-path {tmp_path}" \
        if "nvme" in offload else TINY + " --train-iters 3 --zero-stage 3 " + offload
    results = run_distributed(_modify_worker, 2, argv.split())
    for name, seen, _ in results:
        assert torch.all(seen == 0.5), name  # every dp rank, gathered again
    mains = [m for _, _, ms in results for m in ms]  # the owners' fp32 main values too
    assert sum(m.numel() for m in mains) == seen.numel()
    assert all(torch.all(m == 0.5) for m in mains)


def _io_sizes_worker(path, buffer_count, block_size):
    from megazero.distributed.parallel_state import ParallelState
    from megazero.engine import initialize

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    cfg = OptimizerConfig(zero_stage=2, offload_optimizer="nvme", nvme_path=path, lr=1e-2,
                          nvme_sub_group_size=300, nvme_buffer_count=buffer_count,
                          nvme_block_size=block_size)
    engine = initialize(model, cfg, ParallelState.build())
    torch.manual_seed(1)
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(4, 32)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    opt = engine.optimizer
    return losses, len(opt.slots), opt.aio.block_size, len(opt.groups)


def test_nvme_buffer_count_and_block_size_size_the_io_not_the_step(tmp_path):
    """--nvme-buffer-count (DeepSpeed's offload_optimizer.buffer_count) host slots, reading
    that many sub-groups ahead, and --nvme-block-size (aio.block_size) pieces: the same step."""
    from tests.dist_helper import run_distributed

    two = run_distributed(_io_sizes_worker, 1, str(tmp_path / "a"), 2, 1 << 20)[0]
    four = run_distributed(_io_sizes_worker, 1, str(tmp_path / "b"), 4, 8192)[0]
    assert four[0] == two[0]
    assert (two[1], two[2]) == (2, 1 << 20) and (four[1], four[2]) == (4, 8192)
    assert two[3] > 4  # more sub-groups than slots: the slots are reused
    with pytest.raises(ConfigError, match="--nvme-buffer-count"):
        OptimizerConfig(zero_stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path),
                        nvme_buffer_count=1)
    with pytest.raises(ConfigError, match="--nvme-block-size"):
        OptimizerConfig(zero_stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path),
                        nvme_block_size=5000)
    # sizes of an NVMe offload that is not there are refused, not ignored
    with pytest.raises(ConfigError, match="--nvme-buffer-count .* --offload-optimizer nvme"):
        OptimizerConfig(zero_stage=2, cpu_offload=True, nvme_buffer_count=4)
    with pytest.raises(ConfigError, match="--nvme-block-size .* needs --offload-optimizer"):
        OptimizerConfig(zero_stage=2, nvme_block_size=8192)
