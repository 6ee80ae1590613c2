"""ZeRO for any PyTorch model: ``engine = megazero.initialize(model, optimizer_config, ps)``.

The engine wraps one ``torch.nn.Module`` and megazero's data-parallel optimizer over
``ps.dp_group`` (ZeRO stage 0-3 from ``optimizer_config.zero_stage``), the same machinery GPT-2
training uses. Each rank feeds its own micro-batches; gradients are averaged over dp::

    engine = megazero.initialize(model, OptimizerConfig(zero_stage=2, lr=1e-3), ps,
                                 gradient_accumulation_steps=2)
    for batch in loader:
        loss = loss_fn(engine(batch["x"]), batch["y"])
        engine.backward(loss)   # scales by the loss scale and 1/accumulation
        engine.step()           # updates at accumulation boundaries, a no-op otherwise
    engine.save_checkpoint("ckpt")

Parameters without megazero metadata (``ParamMeta``) are treated as replicated over tp.
"""

from __future__ import annotations

import contextlib

import torch

from megazero.checkpoint import load_checkpoint, save_checkpoint
from megazero.config import MegazeroConfig, OptimizerConfig, ParallelConfig, TrainConfig
from megazero.data_parallel import build_optimizer
from megazero.distributed.parallel_state import ParallelState
from megazero.optim import build_lr_scheduler


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer_config: OptimizerConfig,
                 ps: ParallelState | None = None, *, gradient_accumulation_steps: int = 1,
                 lr_scheduler=None, seed: int = 0):
        self.ps = ps or ParallelState.build()
        self.module = model
        self.config = MegazeroConfig(
            optimizer=optimizer_config,
            parallel=ParallelConfig(tensor_model_parallel_size=self.ps.tp_size,
                                    pipeline_model_parallel_size=self.ps.pp_size,
                                    world_size=self.ps.world_size),
            train=TrainConfig(seed=seed))
        self.gas = gradient_accumulation_steps
        self.lr_scheduler = lr_scheduler
        self.optimizer = build_optimizer([model], optimizer_config, self.ps,
                                         lr_scheduler=lr_scheduler, seed=seed)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (scaled by the loss scale and 1/accumulation steps)."""
        boundary = self.is_gradient_accumulation_boundary()
        ctx = contextlib.nullcontext() if boundary else self.optimizer.no_sync()
        with ctx:
            (loss * (self.optimizer.loss_scale / self.gas)).backward()

    def step(self) -> bool:
        """At an accumulation boundary: reduce gradients, update, zero them. Returns whether
        the parameters were updated (False between boundaries or on fp16 overflow)."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        self.optimizer.finish_grad_sync()
        ok, self.last_grad_norm, _ = self.optimizer.step()
        self.global_steps += 1
        self.skipped_steps += 0 if ok else 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(1)
        self.optimizer.zero_grad()
        return ok

    def memory_report(self) -> dict:
        return self.optimizer.memory_report()

    def save_checkpoint(self, save_dir: str) -> str:
        """Megatron-layout checkpoint (model, ZeRO shards, RNG) at ``global_steps``."""
        return save_checkpoint(
            save_dir, self.global_steps, model_chunks=[self.module], optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, config=self.config, ps=self.ps,
            consumed_train_samples=self.global_steps)

    def load_checkpoint(self, load_dir: str) -> int:
        loaded = load_checkpoint(load_dir, model_chunks=[self.module], optimizer=self.optimizer,
                                 lr_scheduler=self.lr_scheduler, config=self.config, ps=self.ps)
        it = loaded.start_iteration
        self.global_steps = it
        self.micro_steps = it * self.gas
        return it


def initialize(model: torch.nn.Module, optimizer_config: OptimizerConfig | None = None,
               parallel_state: ParallelState | None = None, **kwargs) -> Engine:
    """Wrap ``model`` with megazero's ZeRO optimizer (see ``Engine``)."""
    return Engine(model, optimizer_config or OptimizerConfig(), parallel_state, **kwargs)


__all__ = ["Engine", "initialize", "build_lr_scheduler"]
