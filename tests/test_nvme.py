"""--offload-optimizer nvme: ZeRO stages 1-2 with the fp32 main values and Adam moments in swap
files, streamed in sub-groups: bit for bit the --cpu-offload run, checkpoints that load with and
without NVMe at any layout, scratch files removed, and the refusals."""

import os

import pytest

from megazero.config import ConfigError, OptimizerConfig
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
    with pytest.raises(ConfigError, match="--zero-stage 1 or 2"):
        OptimizerConfig(zero_stage=3, offload_optimizer="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ConfigError, match="LAMB"):
        OptimizerConfig(zero_stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path),
                        optimizer="lamb")
    with pytest.raises(Exception, match="not a writable directory"):
        run_training(TINY + " --train-iters 3 --zero-stage 2 --offload-optimizer nvme "
                     f"--nvme-path {tmp_path / 'missing'}", 1)
