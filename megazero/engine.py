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

Called DeepSpeed's way (``config=`` a ds_config dict or JSON path, or ``model_parameters=``),
``initialize`` returns DeepSpeed's 4-tuple ``(engine, optimizer, dataloader, lr_scheduler)``,
with the batch sizes, optimizer, ZeRO settings, precision, clipping and scheduler of the
ds_config (``megazero.config.deepspeed``, strict: unknown or unsupported keys fail by name) and
DeepSpeed's defaults where it is silent (no clipping, no weight decay, lr 1e-3, constant lr)::

    engine, optimizer, _, scheduler = megazero.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import weakref

import torch
from torch.utils.data import DataLoader, DistributedSampler

from megazero.checkpoint import CheckpointError, load_checkpoint, read_tracker, save_checkpoint
from megazero.checkpoint.paths import atomic_save, atomic_write_text
from megazero.config import MegazeroConfig, OptimizerConfig, ParallelConfig, TrainConfig
from megazero.config.deepspeed import DeepSpeedConfigError, parse_ds_config, refuse_outside_mode
from megazero.data_parallel import build_optimizer
from megazero.distributed import comm
from megazero.distributed.device import host_values
from megazero.distributed.init import destroy_distributed
from megazero.distributed.init import init_distributed as _init_distributed
from megazero.distributed.parallel_state import ParallelState
from megazero.optim import build_lr_scheduler
from megazero.optim.ds_schedulers import DeepSpeedScheduler
from megazero.pipe import PipelineModule, pipeline_units
from megazero.pipe.schedule import run_batch

logger = logging.getLogger("megazero.engine")


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer_config: OptimizerConfig,
                 ps: ParallelState | None = None, *, gradient_accumulation_steps: int = 1,
                 lr_scheduler=None, seed: int = 0, micro_batch_size: int | None = None,
                 steps_per_print: int | None = None):
        if isinstance(model, PipelineModule):
            if ps is not None and ps is not model.ps:
                raise ValueError("a PipelineModule brings its own parallel state: pass it as "
                                 "PipelineModule(parallel_state=...) only")
            ps = model.ps
        self.ps = ps or ParallelState.build()
        self.module = model
        # what the optimizer and checkpoints see: a PipelineModule's chunks on this rank
        self.chunks = list(model.chunks) if isinstance(model, PipelineModule) else [model]
        self.config = MegazeroConfig(
            model=None,  # not megazero's GPT: the checkpoints check the parameters' shapes
            optimizer=optimizer_config,
            parallel=ParallelConfig(tensor_model_parallel_size=self.ps.tp_size,
                                    pipeline_model_parallel_size=self.ps.pp_size,
                                    world_size=self.ps.world_size),
            train=TrainConfig(seed=seed))
        self.gas = gradient_accumulation_steps
        self.lr_scheduler = lr_scheduler
        dtype = getattr(torch, optimizer_config.params_dtype)
        if dtype != torch.float32:  # DeepSpeed's engine: module.half() / module.bfloat16()
            for chunk in self.chunks:  # (in place: the parameters and their metadata stay)
                chunk.to(dtype)
        policy = None
        if isinstance(model, PipelineModule):
            policy = pipeline_units
            shared = [k for k in model.tied_stages
                      if sum(k in c.tied_modules for c in model.chunks) > 1]
            if shared and optimizer_config.zero_stage == 3:
                raise ValueError(f"ZeRO-3: tied modules {shared} are used by several model "
                                 "chunks of one rank (virtual stages); partition so each "
                                 "falls in one chunk per rank, or use ZeRO stage 0-2")
        self.optimizer = build_optimizer(self.chunks, optimizer_config, self.ps,
                                         lr_scheduler=lr_scheduler, seed=seed,
                                         unit_policy=policy)
        # A user's script ends with the engine alive and the last step's parameter
        # all-gather still in flight (it completes in the next forward): finish it and
        # destroy the groups at exit, while the interpreter is whole; a gloo thread that
        # drops the work's tensors during teardown aborts the process.
        atexit.register(_finish_at_exit, weakref.ref(self))
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm = None
        self.micro_batch_size = micro_batch_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # DeepSpeed's attributes
        self.global_rank = self.ps.rank
        self.device = self.ps.device if self.ps.device is not None else torch.device("cpu")
        self.training_dataloader = None  # initialize(training_data=...)'s loader
        self._loader_iter = None
        self.steps_per_print = steps_per_print
        if self.ps.rank == 0 and getattr(self.optimizer, "rule", None) is not None:
            logger.info("Using %s optimizer; ZeRO stage %d", self.optimizer.describe(),
                        optimizer_config.zero_stage)

    # ---- DeepSpeed's getters -----------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.micro_batch_size

    def train_batch_size(self) -> int | None:
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.gas * self.ps.dp_size

    def get_lr(self) -> list[float]:
        lr = self.lr_scheduler.get_lr() if self.lr_scheduler is not None \
            else self.config.optimizer.lr
        return [lr]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

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
        ok, norm, _ = self.optimizer.step()
        if torch.is_tensor(ok):  # kept on the device by the step: DeepSpeed's API reports it
            ok, norm = host_values(torch.stack([ok.double(), norm.double()]))
        self.last_grad_norm = norm
        self.global_steps += 1
        self.skipped_steps += 0 if ok else 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(1)
        self.optimizer.zero_grad()
        if self.steps_per_print and self.global_steps % self.steps_per_print == 0 \
                and self.ps.rank == 0:
            o = self.config.optimizer
            logger.info("[Rank 0] step=%d, skipped=%d, lr=%s, mom=[(%s, %s)]",
                        self.global_steps, self.skipped_steps, self.get_lr(), o.adam_beta1,
                        o.adam_beta2)
        return ok

    # ---- pipelines (DeepSpeed's PipelineEngine) ------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches of a
        ``PipelineModule`` (each ``next(data_iter)`` an ``(inputs, labels)`` pair; default:
        the loader of ``initialize(training_data=...)``). Returns the mean loss, averaged over
        dp, on every rank."""
        module = self._pipeline("train_batch")
        module.train()
        self.optimizer.zero_grad()
        loss = run_batch(module, self._data_iter(data_iter), num_microbatches=self.gas,
                         loss_scale=self.optimizer.loss_scale, no_sync=self.optimizer.no_sync)
        self.micro_steps += self.gas - 1
        self.step()  # the boundary: reduce, update, lr scheduler, zero
        return loss

    @torch.no_grad()
    def eval_batch(self, data_iter) -> torch.Tensor:
        """The mean loss of ``gradient_accumulation_steps`` micro-batches, forward only."""
        module = self._pipeline("eval_batch")
        module.eval()
        try:
            return run_batch(module, data_iter, num_microbatches=self.gas, forward_only=True)
        finally:
            module.train()

    def _pipeline(self, what: str) -> PipelineModule:
        if not isinstance(self.module, PipelineModule):
            raise TypeError(f"engine.{what} runs a megazero.pipe.PipelineModule; for another "
                            "model call engine(batch), engine.backward(loss), engine.step()")
        return self.module

    def _data_iter(self, data_iter):
        if data_iter is not None:
            return data_iter
        if self.training_dataloader is None:
            if self.ps.is_first_stage or self.ps.is_last_stage:
                raise ValueError("train_batch needs data_iter, or initialize(training_data=)")
            return None
        if self._loader_iter is None:
            self._loader_iter = _repeat(self.training_dataloader)
        return self._loader_iter

    def memory_report(self) -> dict:
        return self.optimizer.memory_report()

    def save_checkpoint(self, save_dir: str, tag=None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Save at ``global_steps``; returns the folder written.

        Without ``tag``: Megatron's layout in ``save_dir`` (``iter_0000010/...``, tracker
        ``latest_checkpointed_iteration.txt``). With a tag (DeepSpeed's call): the same
        layout inside ``save_dir/<tag>/``, ``client_state`` (a dict of tensors, numbers,
        strings, lists, dicts) beside it, and, with ``save_latest``, DeepSpeed's
        ``save_dir/latest`` naming the tag. Either loads at any tp/pp/dp/ZeRO layout."""
        root = save_dir if tag is None else os.path.join(save_dir, _check_tag(tag))
        comm.barrier(self.ps.world_group)
        path = save_checkpoint(
            root, self.global_steps, model_chunks=self.chunks, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, config=self.config, ps=self.ps,
            consumed_train_samples=self.global_steps)
        if tag is not None and self.ps.rank == 0:
            atomic_save({"client_state": dict(client_state or {}),
                         "global_steps": self.global_steps, "micro_steps": self.micro_steps,
                         "skipped_steps": self.skipped_steps},
                        os.path.join(root, CLIENT_STATE_FILE))
            if save_latest:
                atomic_write_text(os.path.join(save_dir, LATEST_TAG_FILE), str(tag))
        comm.barrier(self.ps.world_group)
        return root if tag is not None else path

    def load_checkpoint(self, load_dir: str, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True):
        """Load a checkpoint saved at any layout. Called with ``tag`` or on a folder with
        DeepSpeed's ``latest`` file: that tag's checkpoint, returning DeepSpeed's
        ``(path, client_state)`` (``(None, None)`` when ``latest`` is missing). Otherwise
        (Megatron's layout) the iteration loaded, as before."""
        latest = os.path.join(load_dir, LATEST_TAG_FILE)
        if tag is None and not os.path.isfile(latest):
            if read_tracker(load_dir) is not None or not os.path.isdir(load_dir):
                return self._load(load_dir, load_optimizer_states, load_lr_scheduler_states)
            return None, None
        if tag is None:
            with open(latest) as f:
                tag = f.read().strip()
        root = os.path.join(load_dir, _check_tag(tag))
        if not os.path.isdir(root):
            raise CheckpointError(f"no checkpoint tag {tag!r} in {load_dir} ({root} is "
                                  "missing)")
        self._load(root, load_optimizer_states, load_lr_scheduler_states)
        path = os.path.join(root, CLIENT_STATE_FILE)
        extra = torch.load(path, map_location="cpu", weights_only=True) \
            if os.path.isfile(path) else {"client_state": {}}
        self.skipped_steps = int(extra.get("skipped_steps", self.skipped_steps))
        return root, extra["client_state"]

    def _load(self, root: str, load_optimizer_states: bool, load_lr_scheduler_states: bool):
        optimizer = self.optimizer if load_optimizer_states else None
        scheduler = self.lr_scheduler if load_lr_scheduler_states else None
        loaded = load_checkpoint(root, model_chunks=self.chunks, optimizer=optimizer,
                                 lr_scheduler=scheduler, config=self.config, ps=self.ps)
        it = loaded.start_iteration
        self.global_steps = it
        self.micro_steps = it * self.gas
        return it


LATEST_TAG_FILE = "latest"  # DeepSpeed's: the tag of the last save_checkpoint(tag=...)
CLIENT_STATE_FILE = "client_state.pt"


def _check_tag(tag) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("iter_"):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a folder name (no '/', not "
                              "'.'/'..', not Megatron's iter_XXXXXXX)")
    return tag


# DeepSpeed's defaults where a ds_config is silent (its Adam's, and no clipping)
_DS_DEFAULTS = dict(lr=1e-3, min_lr=0.0, weight_decay=0.0, clip_grad=0.0, adam_eps=1e-8,
                    lr_decay_style="constant")
# ds_config settings the engine honours besides the optimizer's (pretrain takes all)
_ENGINE_TRAIN_FIELDS = {"train.micro_batch_size", "train.global_batch_size",
                        "train.log_interval"}


def from_ds_config(model: torch.nn.Module, ds_config, ps: ParallelState | None = None, *,
                   seed: int = 0) -> Engine:
    """An ``Engine`` for ``model`` from a ds_config (dict or JSON path)."""
    if isinstance(model, PipelineModule) and ps is None:
        ps = model.ps
    ps = ps or ParallelState.build()
    settings = parse_ds_config(ds_config, ps.world_size, ps.tp_size, ps.pp_size)
    other = sorted(k for k in settings.fields
                   if not k.startswith("optimizer.") and k not in _ENGINE_TRAIN_FIELDS)
    if other:
        raise DeepSpeedConfigError(
            f"the engine cannot apply ds_config settings {other} (activation checkpointing "
            "is your model's: use megazero.tensor_parallel.checkpoint; logging to "
            "tensorboard/wandb and wall_clock_breakdown are pretrain_gpt2.py's)")
    values = {**_DS_DEFAULTS, **{k.split(".", 1)[1]: v for k, v in settings.fields.items()
                                 if k.startswith("optimizer.")}}
    optimizer_config = OptimizerConfig(**values)
    refuse_outside_mode(settings.fields, optimizer_config)
    scheduler = None
    if settings.scheduler is not None:
        kind, params = settings.scheduler
        scheduler = DeepSpeedScheduler(kind, params, base_lr=optimizer_config.lr)
    return Engine(model, optimizer_config, ps, gradient_accumulation_steps=settings.accumulation,
                  lr_scheduler=scheduler, seed=seed, micro_batch_size=settings.micro_batch,
                  steps_per_print=settings.fields.get("train.log_interval"))


def _finish_at_exit(ref) -> None:
    engine = ref()
    # after an uncaught exception (sys.last_value) peers may never join a collective: no wait
    if engine is not None and torch.distributed.is_initialized() \
            and not hasattr(sys, "last_value"):
        engine.optimizer.finish_param_sync()
        engine.optimizer.reducer.wait()
    destroy_distributed()


def init_distributed(dist_backend: str | None = None, *, timeout=None, **_ignored_launcher):
    """DeepSpeed's ``deepspeed.init_distributed()``: the default process group from the
    launcher's environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR; one process without
    it), gloo on CPU and NCCL with GPUs unless ``dist_backend`` says otherwise. Returns the
    data-parallel ``ParallelState`` of the world (build others with ``ParallelState.build``)."""
    from_launcher = int(os.environ.get("WORLD_SIZE", "1"))
    values = {"world_size": from_launcher, "distributed_backend": dist_backend}
    if timeout is not None:
        values["distributed_timeout_minutes"] = max(1, int(timeout.total_seconds() // 60))
    return _init_distributed(ParallelConfig(**values))


def _repeat(loader):
    """DeepSpeed's ``RepeatingLoader``: epochs of ``loader`` without end."""
    while True:
        yield from loader


def _dataloader(engine: Engine, training_data, collate_fn=None):
    """DeepSpeed's training loader: micro-batches of this dp rank's share."""
    ps = engine.ps
    sampler = DistributedSampler(training_data, num_replicas=ps.dp_size, rank=ps.dp_rank)
    return DataLoader(training_data, batch_size=engine.micro_batch_size, sampler=sampler,
                      collate_fn=collate_fn)


def initialize(model: torch.nn.Module | None = None,
               optimizer_config: OptimizerConfig | None = None,
               parallel_state: ParallelState | None = None, *, config=None,
               config_params=None, model_parameters=None, optimizer=None, training_data=None,
               collate_fn=None, args=None, lr_scheduler=None, **kwargs):
    """Wrap ``model`` with megazero's ZeRO optimizer (see ``Engine``). Called DeepSpeed's way
    (``config``/``config_params``, ``model_parameters``, ``training_data`` or ``args`` with
    ``deepspeed_config``), build it from the ds_config and return DeepSpeed's
    ``(engine, optimizer, dataloader, lr_scheduler)``."""
    ds_config = config if config is not None else config_params
    if ds_config is None and args is not None:
        ds_config = getattr(args, "deepspeed_config", None)
    deepspeed_way = ds_config is not None or model_parameters is not None \
        or training_data is not None
    if not deepspeed_way:
        return Engine(model, optimizer_config or OptimizerConfig(), parallel_state,
                      lr_scheduler=lr_scheduler, **kwargs)
    if ds_config is None:
        raise DeepSpeedConfigError("megazero.initialize needs config= (a ds_config dict or "
                                   "JSON path) when called DeepSpeed's way")
    if optimizer is not None or lr_scheduler is not None:
        raise DeepSpeedConfigError(
            "megazero's engine builds its ZeRO optimizer and scheduler from the ds_config's "
            "optimizer and scheduler sections; pass optimizer=None and lr_scheduler=None and "
            "describe them there")
    if model_parameters is not None:
        given = {id(p) for p in model_parameters}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in
                   given]
        if missing:
            raise DeepSpeedConfigError(f"model_parameters leaves out {missing[:4]}: megazero "
                                       "trains every parameter that requires grad")
    engine = from_ds_config(model, ds_config, parallel_state, **kwargs)
    loader = _dataloader(engine, training_data, collate_fn) if training_data is not None \
        else None
    engine.training_dataloader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler


__all__ = ["Engine", "build_lr_scheduler", "from_ds_config", "init_distributed", "initialize"]
