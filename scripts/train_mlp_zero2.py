"""Train a two-layer MLP with ZeRO-2 through megazero's engine, on any number of processes.

    torchrun --nproc-per-node 2 scripts/train_mlp_zero2.py [--steps 50] [--stage 2]

Each rank feeds its own half of every batch; gradients are reduce-scattered over the
data-parallel group, each rank keeps and updates only its half of the Adam states, and the
updated parameters are all-gathered. Prints the loss every 10 steps and the per-rank bytes of
model states at the end.
"""

import argparse
import os

import torch

import megazero
from megazero.config import OptimizerConfig, ParallelConfig
from megazero.distributed import destroy_distributed, init_distributed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    state = init_distributed(ParallelConfig(world_size=world))
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 1))
    engine = megazero.initialize(model, OptimizerConfig(zero_stage=args.stage, lr=3e-3,
                                                        weight_decay=0.0), state)
    target = torch.nn.Linear(64, 1)  # a fixed random function to regress
    for step in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=gen)
        y = target(x).detach()
        xs, ys = x.chunk(state.dp_size)[state.dp_rank], y.chunk(state.dp_size)[state.dp_rank]
        loss = torch.nn.functional.mse_loss(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        if step % 10 == 0 and state.rank == 0:
            print(f"step {step:4d} | loss {loss.item():.5f}")
    report = {k: v for k, v in engine.memory_report().items() if v}
    print(f"rank {state.rank}: bytes of model states {report}")
    destroy_distributed()  # join the process groups' threads before the interpreter exits


if __name__ == "__main__":
    main()
