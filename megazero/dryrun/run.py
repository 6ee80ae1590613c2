"""Execute one rank of an N-rank job in this process: real code, fake tensors, fake groups.

``dry_run`` plays global rank R of a world of N (``--dry-run-rank``, ``--dry-run-world-size``)
with torch's fake process group (every collective returns at once) and ``FakeTensorMode``
(tensors have shapes, dtypes and devices, never memory) on ``--dry-run-device`` (``cuda``
works on a CPU-only torch through ``fake_cuda``). It runs ``pretrain`` itself: the model at
the rank's tp/pp/virtual layout, the ZeRO optimizer, ``--dry-run-iters`` iterations of the
schedule with its p2p exchanges, reductions and the optimizer step, and a checkpoint save to
a temporary folder. Data are synthetic tokens of the job's shapes (``--mock-data``); values
read on the host (loss, norm) are zeros.

While it runs, ``memory.MemoryTracker`` measures the rank's tensor storages and the rank's
``Communicator`` records every collective and p2p message, checked against the backend the
job will have (``cpu:gloo,cuda:nccl`` on cuda). Then the same is done for one other rank of
each of its groups (``--dry-run-check-peers``, on by default) and their sequences of
collectives on the shared group are compared: the first divergence is reported (an
unmatched collective deadlocks a real job). The report is ``report.build``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from megazero.config import ConfigError, MegazeroConfig
from megazero.distributed.device import MAPPED_BACKEND
from megazero.distributed.parallel_state import ParallelState, coords_of
from megazero.dryrun import fake_cuda
from megazero.dryrun.launches import DeviceOpCounter, instrument
from megazero.dryrun.memory import STATE_CATEGORIES, MemoryTracker
from megazero.dryrun.report import build_report, compare_p2p, compare_sequences
from megazero.tensor_parallel.meta import meta_of
from megazero.training import pretrain

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DryRunOptions:
    """What ``--dry-run-*`` asked for."""

    rank: int
    world_size: int
    device: str = "cuda"
    iters: int = 1
    report: str | None = None
    check_peers: bool = True

    def __post_init__(self):
        if self.world_size < 1:
            raise ConfigError(f"--dry-run-world-size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"--dry-run-rank must be in [0, {self.world_size}), got "
                              f"{self.rank}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--dry-run-device must be cpu or cuda, got {self.device!r}")
        if self.iters < 1:
            raise ConfigError(f"--dry-run-iters must be >= 1, got {self.iters}")


@dataclasses.dataclass
class RankRun:
    """What one rank's dry run measured."""

    rank: int
    ps: ParallelState
    tracker: MemoryTracker
    records: list
    states: dict  # category -> bytes of model states, from the optimizer's tensors
    memory_report: dict  # the optimizer's own accounting (memory_report())
    train_peak: dict  # device type -> peak over the training iterations
    checkpoint: dict  # files written and the tensor bytes they would hold
    seconds: float
    param_count: int
    device_ops: dict  # DeviceOpCounter.summary(): launches and host syncs per iteration


def dry_run_config(config: MegazeroConfig, opts: DryRunOptions, save_dir: str):
    """The job's config adapted to a dry run: synthetic tokens of the job's vocabulary,
    ``--dry-run-iters`` iterations, no evaluation, one save at the end into ``save_dir``."""
    d = config.to_dict()
    d["parallel"]["world_size"] = opts.world_size
    data = d["data"]
    if not data["mock_data"]:
        data.update(mock_data=True, data_path=[], tokenizer_type=None,
                    vocab_size=data["vocab_size"] or config.model.vocab_size or 50257)
    d["train"].update(train_iters=opts.iters, train_samples=None, eval_iters=0,
                      log_interval=opts.iters, save=save_dir, save_interval=opts.iters,
                      load=None, exit_interval=None, exit_duration_in_mins=None,
                      tensorboard_dir=None, pipeline_trace=None, skip_train=False)
    return MegazeroConfig.from_dict(d)


@contextlib.contextmanager
def _fake_cuda_runtime(device: str):
    """Python-side CUDA queries torch.distributed makes for CUDA tensors (broadcast asks the
    compute capability), answered for an H100/H200 (sm_90) while a cuda dry run runs."""
    if device != "cuda" or torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


def measured_pretrain(cfg: MegazeroConfig, ps: ParallelState, providers,
                      tracker: MemoryTracker, counter: DeviceOpCounter | None = None) -> dict:
    """``pretrain`` under ``tracker`` (and ``counter``, already entered): model states tagged
    once built, the training iterations' peak noted before the save, each iteration's device
    ops counted. Runs the same on fake and on real tensors (a gloo run measured the same way
    is what the dry run is checked against)."""
    datasets_provider, model_provider, forward_step_func, unit_policy = providers
    seen = {}
    if counter is not None:
        forward_step_func = counter.forward_step(forward_step_func)

    def on_ready(trainer):
        seen["optimizer"] = trainer.optimizer
        if counter is not None:
            instrument(trainer, counter)
        trainer.optimizer.build_states()  # allocated at the first step otherwise
        tracker.tag(trainer.optimizer.state_tensors())
        tracker.training = True
        tracker.reset_peak()
        save = trainer.save

        def save_and_note():
            seen.setdefault("train_peak", {d: tracker.peak(d) for d in tracker.peaks})
            tracker.training = False
            save()
        trainer.save = save_and_note

    result = pretrain(datasets_provider, model_provider, tracker.forward_step(forward_step_func),
                      cfg, ps=ps, zero3_unit_policy=unit_policy, on_ready=on_ready)
    dev = ps.device.type
    states = {c: tracker.live_bytes(dev, c) for c in STATE_CATEGORIES}
    if dev != "cpu":
        states.update({f"host_{c}": tracker.live_bytes("cpu", c) for c in STATE_CATEGORIES
                       if tracker.live_bytes("cpu", c)})
    return {"states": states, "memory_report": seen["optimizer"].memory_report(),
            "train_peak": seen.get("train_peak") or {d: tracker.peak(d)
                                                    for d in tracker.peaks},
            # local shapes: ZeRO-3 has released the parameters' storage by now
            "param_count": sum(math.prod(meta_of(p).local_shape)
                               for c in result.model for p in c.parameters())}


def run_rank(config: MegazeroConfig, opts: DryRunOptions, rank: int, providers) -> RankRun:
    """Dry-run global ``rank`` (see the module docstring)."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="megazero-dryrun-") as save_dir:
        cfg = dry_run_config(config, opts, save_dir)
        dist.init_process_group("fake", store=FakeStore(), rank=rank,
                                world_size=opts.world_size)
        tracker = MemoryTracker()
        counter = DeviceOpCounter(opts.device, root=os.getcwd())
        try:
            with _fake_cuda_runtime(opts.device), \
                    FakeTensorMode(allow_non_fake_inputs=True), tracker, counter:
                device = torch.device("cuda", 0) if opts.device == "cuda" \
                    else torch.device("cpu")
                ps = ParallelState.from_config(
                    cfg.parallel, device=device,
                    comm_backend=MAPPED_BACKEND if opts.device == "cuda" else "gloo")
                ps.comm.recording = True
                measured = measured_pretrain(cfg, ps, providers, tracker, counter)
                checkpoint = _checkpoint_files(save_dir)
        finally:
            dist.destroy_process_group()
    return RankRun(rank, ps, tracker, list(ps.comm.records), measured["states"],
                   measured["memory_report"], measured["train_peak"], checkpoint,
                   time.time() - start, measured["param_count"], counter.summary())


def _checkpoint_files(root: str) -> dict:
    """The files a save wrote under ``root`` (meta tensors: structure without data) and the
    bytes their tensors would hold."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if not name.endswith(".pt"):
                continue
            path = os.path.join(folder, name)
            state = torch.load(path, weights_only=True, map_location="meta")
            files[os.path.relpath(path, root)] = _tensor_bytes(state)
    return files


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def peer_ranks(rank: int, config: MegazeroConfig, world: int) -> dict[str, int]:
    """One other rank of each of ``rank``'s groups (tp, dp, pp) that has more than one."""
    tp = config.parallel.tensor_model_parallel_size
    pp = config.parallel.pipeline_model_parallel_size
    dp = world // (tp * pp)
    t, d, p = coords_of(rank, tp, dp)
    peers = {}
    if tp > 1:
        peers["tp"] = rank - t + (t + 1) % tp
    if dp > 1:
        peers["dp"] = rank + tp * (((d + 1) % dp) - d)
    if pp > 1:
        peers["pp"] = rank + tp * dp * (((p + 1) % pp) - p)
    return peers


def dry_run(config: MegazeroConfig, opts: DryRunOptions, *, datasets_provider, model_provider,
            forward_step_func, zero3_unit_policy=None) -> dict:
    """Dry-run ``opts.rank`` (and a peer per group), return the report (and write it as JSON
    to ``opts.report``)."""
    if opts.device == "cuda" and not fake_cuda.active():
        raise RuntimeError("a cuda dry run needs the fake CUDA runtime loaded before torch: "
                           "run it through pretrain_gpt2.py (which re-executes itself with "
                           "it), or start Python with megazero.dryrun.fake_cuda.preload_env()")
    providers = (datasets_provider, model_provider, forward_step_func, zero3_unit_policy)
    main = run_rank(config, opts, opts.rank, providers)
    checks = {"device": "every collective's tensor device matched its group's backend",
              "peers": {}}
    if opts.check_peers:
        for kind, peer in peer_ranks(opts.rank, config, opts.world_size).items():
            other = run_rank(config, opts, peer, providers)
            result = compare_sequences(main, other, kind)
            if kind == "pp":
                result["p2p"] = compare_p2p(main, other)
            checks["peers"][kind] = result
    report = build_report(config, opts, main, checks)
    if opts.report:
        report.write_json(opts.report)
    return report
