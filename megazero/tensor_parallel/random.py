"""RNG streams for tensor-parallel regions, and activation recompute that replays them.

``RNGStatesTracker`` keeps named generator states (CPU, and CUDA when present). Inside
``tracker.fork()`` the default generators run from the model-parallel stream, seeded
``seed + 2718 + tp_rank`` as in Megatron, so dropout on tensor-parallel activations (attention
heads, ffn shards) differs across tp ranks, while dropout outside those regions uses the
default stream, identical on all tp ranks (seeded ``seed``).

``checkpoint(fn, *args)`` runs ``fn`` without keeping its activations and re-runs it in backward
with the CPU, CUDA and tracker states of the first run, so the recomputed forward is
bit-identical (same dropout masks). With ``partition_group`` the saved input is split across
that (tp) group and all-gathered before recompute: Megatron's distribute-checkpointed-
activations, DeepSpeed's partition_activations. One tracker object per process, passed in.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from megazero.distributed import comm
from megazero.distributed.device import host_side
from megazero.distributed.parallel_state import ParallelState

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_states() -> dict:
    with host_side():  # generator states are host bytes, real also in the dry run
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_states(states: dict) -> None:
    with host_side():
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named RNG streams swapped into torch's default generators by ``fork``."""

    def __init__(self):
        self.states: dict[str, dict] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds.add(seed)
        saved = _get_states()
        torch.manual_seed(seed)  # seeds CPU and all CUDA devices
        self.states[name] = _get_states()
        _set_states(saved)

    def get_states(self) -> dict:
        with host_side():
            return {name: {k: v.clone() for k, v in st.items()}
                    for name, st in self.states.items()}

    def set_states(self, states: dict) -> None:
        with host_side():
            self.states = {name: {k: v.clone() for k, v in st.items()}
                           for name, st in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with stream ``name``; its advanced state is kept for the next fork."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was not added to the tracker")
        saved = _get_states()
        _set_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_states()
            _set_states(saved)


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    return seed + 2718 + tp_rank


def model_parallel_manual_seed(seed: int, tp_rank: int,
                               tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Seed the default stream with ``seed`` and the tracker's model-parallel stream with
    ``seed + 2718 + tp_rank`` (Megatron's ``model_parallel_cuda_manual_seed``)."""
    tracker = tracker or RNGStatesTracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(seed, tp_rank))
    return tracker


def set_random_seed(seed: int, state: ParallelState,
                    tracker: RNGStatesTracker | None = None) -> RNGStatesTracker:
    """Seed python, numpy and torch (CPU and CUDA) and the tracker's model-parallel stream.

    As in Megatron, each pipeline stage offsets the seed by ``100 * pp_rank`` (its layers'
    dropout differs from other stages'); tp ranks share the default stream and get
    ``seed + 2718 + tp_rank`` in the model-parallel stream. Parameter initialisation does not
    use these streams (it is keyed by name, see ``tensor_parallel.initializers``).
    """
    stage_seed = seed + 100 * state.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    return model_parallel_manual_seed(stage_seed, state.tp_rank, tracker)


def _split_for_partition(t: torch.Tensor, group):
    """Keep this rank's 1/n of ``t``'s flat data (padded), to save memory while stored."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    flat = t.detach().reshape(-1)
    chunk = (flat.numel() + n - 1) // n
    if chunk * n != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, chunk * n - flat.numel()))
    return flat[rank * chunk:(rank + 1) * chunk].clone()


def _gather_partition(part: torch.Tensor, shape, group) -> torch.Tensor:
    n = comm.group_size(group)
    full = torch.empty(part.numel() * n, dtype=part.dtype, device=part.device)
    comm.all_gather_into(full, part, group)
    numel = 1
    for s in shape:
        numel *= s
    return full[:numel].view(shape)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tracker, partition_group, offload, *args):
        ctx.fn, ctx.tracker, ctx.partition_group = fn, tracker, partition_group
        ctx.rng = _get_states()
        ctx.tracker_states = tracker.get_states() if tracker is not None else None
        with torch.no_grad():
            outputs = fn(*args)
        tensors, ctx.layout = [], []
        for i, a in enumerate(args):
            if torch.is_tensor(a):
                ctx.layout.append(("t", len(tensors), a.requires_grad))
                if i == 0 and partition_group is not None and comm.group_size(partition_group) > 1:
                    ctx.part_shape = a.shape
                    tensors.append(_split_for_partition(a, partition_group))
                    ctx.layout[-1] = ("p", len(tensors) - 1, a.requires_grad)
                else:
                    tensors.append(a)
            else:
                ctx.layout.append(("o", a, False))
        # offload: the saved inputs wait in host memory (DeepSpeed's cpu_checkpointing)
        ctx.devices = [t.device for t in tensors]
        if offload:
            tensors = [t.to("cpu") if t.device.type != "cpu" else t for t in tensors]
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = []
        for kind, ref, req in ctx.layout:
            if kind == "o":
                inputs.append(ref)
                continue
            t = saved[ref]
            if t.device != ctx.devices[ref]:  # offloaded: back to the device
                t = t.to(ctx.devices[ref])
            if kind == "p":
                t = _gather_partition(t, ctx.part_shape, ctx.partition_group)
            t = t.detach()
            t.requires_grad_(req)
            inputs.append(t)
        current = _get_states()
        current_tracker = ctx.tracker.get_states() if ctx.tracker is not None else None
        _set_states(ctx.rng)
        if ctx.tracker is not None:
            ctx.tracker.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)
        finally:
            _set_states(current)
            if ctx.tracker is not None:
                ctx.tracker.set_states(current_tracker)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(t.grad if torch.is_tensor(t) and t.requires_grad else None
                            for t in inputs)
        return (None, None, None, None, *input_grads)


def checkpoint(fn, *args, tracker: RNGStatesTracker | None = None, partition_group=None,
               offload: bool = False):
    """Recompute ``fn(*args)`` in backward instead of storing its activations.

    Forward: run ``fn`` without autograd, remember the RNG states (CPU, CUDA, ``tracker``).
    Backward: restore those states, re-run ``fn`` with autograd, back-propagate, and put the
    RNG states back. With ``partition_group``, ``args[0]`` is stored split across the group;
    with ``offload``, the stored tensors wait in host memory until the backward.
    """
    return _CheckpointFunction.apply(fn, tracker, partition_group, offload, *args)
