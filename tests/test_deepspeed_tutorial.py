"""DeepSpeed's tutorial training loops, run unchanged but for ``import megazero as deepspeed``.

Two scripts in the shape of DeepSpeed's getting-started (CIFAR-10) and pipeline-parallelism
tutorials, on a synthetic dataset (nothing is downloaded): ``add_config_arguments``,
``init_distributed``, ``initialize(args=..., model=..., model_parameters=..., training_data=...)``
returning the 4-tuple, ``engine(x)``/``backward``/``step`` and ``PipelineModule`` with
``train_batch()`` on the engine's own loader. The pipeline one must print the same losses on
two pipeline stages as on one.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COMMON = '''
import argparse
import torch
import megazero as deepspeed


def get_args():
    parser = argparse.ArgumentParser(description="tutorial")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("-s", "--steps", type=int, default=16)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).long()
    return torch.utils.data.TensorDataset(x, y)
'''

GETTING_STARTED = COMMON + '''
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


args = get_args()
deepspeed.init_distributed()
torch.manual_seed(42)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
model_engine, optimizer, trainloader, _ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=dataset())
criterion = torch.nn.CrossEntropyLoss()
for epoch in range(2):
    running_loss = 0.0
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        running_loss += loss.item()
    print(f"epoch {epoch} rank {model_engine.global_rank} loss {running_loss / (i + 1):.6f}")
'''

PIPELINE = COMMON + '''
from megazero.pipe import PipelineModule


def join_layers():
    return [torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
            lambda x: torch.relu(x), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 2)]


args = get_args()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(42)
net = PipelineModule(layers=join_layers(), loss_fn=torch.nn.CrossEntropyLoss(),
                     num_stages=args.pipeline_parallel_size, partition_method="parameters",
                     activation_checkpoint_interval=0)
engine, _, _, _ = deepspeed.initialize(
    args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
    training_data=dataset())
for step in range(args.steps):
    loss = engine.train_batch()
    if torch.distributed.get_rank() == 0:
        print(f"step {step} loss {loss.item():.6f}")
'''

CONFIG = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
          "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                    "eps": 1e-8, "weight_decay": 3e-7}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                       "warmup_max_lr": 0.001,
                                                       "warmup_num_steps": 4}},
          "gradient_clipping": 1.0, "steps_per_print": 2000,
          "zero_optimization": {"stage": 1}}


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, source, extra, nproc=1, config=CONFIG):
    script, cfg = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text(source)
    cfg.write_text(json.dumps(config))
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*launch, str(script), "--deepspeed", "--deepspeed_config", str(cfg),
                           *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_getting_started_loop_runs_on_two_data_parallel_ranks(tmp_path):
    out = _run(tmp_path, GETTING_STARTED, [], nproc=2)
    losses = {(int(e), int(r)): float(v)  # the two ranks' lines may interleave
              for e, r, v in re.findall(r"epoch (\d+) rank (\d+) loss ([0-9.]+)", out)}
    assert sorted(losses) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert losses[(1, 0)] < losses[(0, 0)] and losses[(1, 1)] < losses[(0, 1)]


def _step_losses(out):
    return [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]


def test_pipeline_tutorial_two_stages_print_the_one_stage_losses(tmp_path):
    one = _step_losses(_run(tmp_path, PIPELINE, ["-p", "1"]))
    two = _step_losses(_run(tmp_path, PIPELINE, ["-p", "2"], nproc=2))
    assert len(one) == 16 and len(two) == 16
    assert two == pytest.approx(one, rel=1e-5)
    assert sum(one[-4:]) < sum(one[:4])  # and it learns


def test_a_tutorial_config_key_megazero_lacks_is_refused_by_name(tmp_path):
    config = {**CONFIG, "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3,
                                                                        "freeze_step": 2}}}
    with pytest.raises(AssertionError, match="OneBitLamb"):
        _run(tmp_path, PIPELINE, ["-p", "1"], config=config)
