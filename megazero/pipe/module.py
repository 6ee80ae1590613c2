"""``PipelineModule``: any sequential model split over the pipeline-parallel group (DeepSpeed's
``deepspeed.pipe.PipelineModule``), for the engine's ``train_batch``.

``layers`` is a list of ``LayerSpec``/``TiedLayerSpec``, built modules, or parameter-free
callables, run in order: ``x = layer(x)``. The list is cut into ``num_stages * virtual_stages``
contiguous parts (``partition_method``, see ``partition``); pipeline rank r holds parts
r, r + P, ... as its model chunks (``PipelineStage``), so ``virtual_stages > 1`` runs
megazero's interleaved 1F1B. Only those layers are built on this rank.

Initialisation is layout-invariant: layer i is built under ``torch.manual_seed(base_seed + i)``
(a tied module under that of its first use), whatever rank builds it, so the tp layers inside
(which draw their keys from torch's generator) and plain torch layers get the same full
weights at every tp x pp x dp split. Parameter names are DeepSpeed's (``<layer index>.<name>``,
``tied_modules.<key>.<name>``), the same on every layout, which keeps checkpoints layout-free.

Tied modules (``TiedLayerSpec``) used on the first and the last pipeline stage are tied like
Megatron's word embedding: both stages hold a copy, their ``tied_weight_attr`` gradients are
all-reduced over ``ps.embedding_group`` and counted once in the gradient norm. Ties between
other stages are refused with the stages named.

Between stages travels one floating tensor per micro-batch (the first stage's input and the
last stage's output may be anything). Its shape is learnt on the first batch and fixed after,
when all stages sent one shape; ``dynamic_shapes=True`` sends a shape message before every
tensor instead, for activations that change shape from batch to batch. With
``activation_checkpoint_interval = k`` every k consecutive layers of a chunk are recomputed in
backward (``tensor_parallel.random.checkpoint``: the CPU/CUDA RNG states and those of
``rng_tracker``, megazero's tp dropout streams, restored: bit-identical).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megazero.distributed.parallel_state import ParallelState
from megazero.pipe.partition import partition
from megazero.pipe.spec import LayerSpec, TiedLayerSpec
from megazero.tensor_parallel.meta import update_meta
from megazero.tensor_parallel.random import checkpoint as recompute


class TiedUse(nn.Module):
    """A use of a tied module through ``forward_fn(module, x)``: a module of its own, without
    parameters, so ZeRO can gather the tied module's parameters before it runs."""

    def __init__(self, key: str, module: nn.Module, forward_fn: Callable):
        super().__init__()
        self.key, self.forward_fn = key, forward_fn
        self._tied = (module,)  # not registered: the parameters are tied_modules.<key>'s

    def forward(self, x):
        return self.forward_fn(self._tied[0], x)


class PipelineStage(nn.Module):
    """One model chunk: the layers of one pipeline part, run in order. ``set_input_tensor``
    gives it the activation received from the previous stage; ``post_process`` marks the
    part holding the model's last layer (the schedule computes the loss there)."""

    def __init__(self, part: int, first: bool, last: bool, checkpoint_interval: int,
                 tracker=None):
        super().__init__()
        self.part, self.pre_process, self.post_process = part, first, last
        self.tracker = tracker
        self.checkpoint_interval = checkpoint_interval
        self.tied_modules = nn.ModuleDict()
        self.direct_tied: set[str] = set()  # keys used as module(x) in this chunk
        self.tied_uses: list[TiedUse] = []  # and those used through forward_fn
        self._steps: list[tuple[int, Callable]] = []  # (layer index, fn(x) -> x)
        self.input_tensor = None

    def add(self, index: int, layer) -> None:
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
        self._steps.append((index, layer))

    def add_tied(self, index: int, key: str, module: nn.Module, forward_fn) -> None:
        if key not in self.tied_modules:
            self.tied_modules[key] = module
        if forward_fn is None:
            self.direct_tied.add(key)
            self._steps.append((index, module))
        else:
            self.tied_uses.append(TiedUse(key, module, forward_fn))
            self._steps.append((index, self.tied_uses[-1]))

    @property
    def layer_indices(self) -> list[int]:
        return [i for i, _ in self._steps]

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def _run(self, start: int, stop: int, x):
        for _, fn in self._steps[start:stop]:
            x = fn(x)
        return x

    def forward(self, x=None):
        if not self.pre_process:
            x = self.input_tensor
        k, n = self.checkpoint_interval, len(self._steps)
        if k <= 0 or not self.training or not torch.is_grad_enabled():
            return self._run(0, n, x)
        for start in range(0, n, k):
            stop = min(start + k, n)
            if torch.is_tensor(x) and x.is_floating_point():
                x = recompute(lambda t, a=start, b=stop: self._run(a, b, t), x,
                              tracker=self.tracker)
            else:  # the first layers may take non-tensor inputs: run them plainly
                x = self._run(start, stop, x)
        return x


def pipeline_units(chunk: PipelineStage) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO's unit policy for a chunk: each module holding parameters directly is a unit,
    used by itself; a tied module's units are used by the tied module where this chunk calls
    it and by each ``TiedUse`` of its key."""
    units = []
    for path, mod in chunk.named_modules():
        if not any(True for _ in mod.parameters(recurse=False)):
            continue
        users = [mod]
        if path.startswith("tied_modules."):
            key = path.split(".")[1]
            users = ([mod] if key in chunk.direct_tied else []) \
                + [u for u in chunk.tied_uses if u.key == key]
        units.append((path, users))
    return units


class PipelineModule(nn.Module):
    """See the module docstring. ``parallel_state`` (its ``pp_size`` is ``num_stages``) is
    built as ``ParallelState.build(pp_size=num_stages)`` when not given (tp 1)."""

    def __init__(self, layers, num_stages: int | None = None, *, loss_fn=None,
                 partition_method="parameters", parallel_state: ParallelState | None = None,
                 topology=None, virtual_stages: int = 1, activation_checkpoint_interval: int = 0,
                 base_seed: int = 1234, seed_layers: bool = True, partition_device="meta",
                 rng_tracker=None, dynamic_shapes: bool = False):
        super().__init__()
        ps = parallel_state if parallel_state is not None else topology
        if ps is not None and not isinstance(ps, ParallelState):
            raise TypeError(f"PipelineModule topology/parallel_state must be a megazero "
                            f"ParallelState (ParallelState.build(tp_size, pp_size)), not "
                            f"{type(ps).__name__}")
        if ps is None:
            ps = ParallelState.build(pp_size=num_stages or 1)
        if num_stages is not None and num_stages != ps.pp_size:
            raise ValueError(f"PipelineModule num_stages={num_stages} but the parallel state "
                             f"has pp_size={ps.pp_size}")
        if not seed_layers:
            raise ValueError("PipelineModule always seeds each layer from base_seed + its "
                             "index (layout-invariant initialisation); seed_layers=False is "
                             "not offered")
        if virtual_stages < 1 or (virtual_stages > 1 and ps.pp_size == 1):
            raise ValueError(f"virtual_stages={virtual_stages} needs >= 1 and, above 1, "
                             "num_stages > 1 (the interleaved schedule)")
        self.ps, self.loss_fn = ps, loss_fn
        self.num_stages, self.virtual_stages = ps.pp_size, virtual_stages
        self.base_seed = base_seed
        self.specs = list(layers)
        if not self.specs:
            raise ValueError("PipelineModule needs at least one layer")
        for i, spec in enumerate(self.specs):
            if not (isinstance(spec, (LayerSpec, nn.Module)) or callable(spec)):
                raise TypeError(f"PipelineModule layer {i} ({spec!r}) is not a LayerSpec, "
                                "a module or a callable")
        parts = ps.pp_size * virtual_stages
        classes, counts = self._describe(partition_device)
        self.parts = partition(partition_method, classes, counts, parts)
        self.layer_classes = classes
        self.tied_stages = self._tied_stages()
        self._tied_local: dict[str, nn.Module] = {}  # one copy per rank, shared by its chunks
        self.rng_tracker = rng_tracker  # restored with the CPU/CUDA RNG when recomputing
        # activations between stages: one shape learnt on the first batch (None: not yet),
        # or with dynamic_shapes a shape message before every exchange
        self.dynamic_shapes, self.activation_shape = dynamic_shapes, None
        self.chunks = nn.ModuleList([self._build_chunk(ps.pp_rank + c * ps.pp_size,
                                                       activation_checkpoint_interval)
                                     for c in range(virtual_stages)])
        self.specs = None  # drop other stages' prebuilt modules (their memory)

    # ---- planning ------------------------------------------------------------------------
    def _describe(self, device) -> tuple[list[str], list[int]]:
        """Class name and trainable parameter count of each layer (specs built on the meta
        device, a tied module counted at its first use)."""
        classes, counts, seen = [], [], set()
        for spec in self.specs:
            if isinstance(spec, LayerSpec):
                classes.append(spec.typename.__name__)
                key = spec.key if isinstance(spec, TiedLayerSpec) else None
                if key is not None and key in seen:
                    counts.append(0)
                    continue
                seen.add(key)
                try:  # cheap: no storage
                    with torch.device(device):
                        module = spec.build()
                except Exception:  # noqa: BLE001 - a constructor that needs real data
                    module = spec.build()
            else:
                module = spec
                classes.append(type(spec).__name__)
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
                          if isinstance(module, nn.Module) else 0)
        return classes, counts

    def part_of(self, index: int) -> int:
        return next(p for p in range(len(self.parts) - 1)
                    if self.parts[p] <= index < self.parts[p + 1])

    def _tied_stages(self) -> dict[str, list[int]]:
        """key -> the pipeline ranks using it; refuses ties outside {first, last} stage."""
        out: dict[str, list[int]] = {}
        for i, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                rank = self.part_of(i) % self.num_stages
                out.setdefault(spec.key, [])
                if rank not in out[spec.key]:
                    out[spec.key].append(rank)
        last = self.num_stages - 1
        for key, ranks in out.items():
            if len(ranks) > 1 and sorted(ranks) != [0, last]:
                raise ValueError(
                    f"TiedLayerSpec {key!r} is used on pipeline stages {sorted(ranks)}: "
                    f"megazero ties modules between the first and last stage only (0 and "
                    f"{last}, its embedding group); change partition_method so the uses "
                    "fall there or on one stage")
        return out

    # ---- building this rank's chunks ------------------------------------------------------
    def _build(self, seed_index: int, spec: LayerSpec) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.base_seed + seed_index)
            module = spec.build()
        return module.to(self.ps.device) if self.ps.device is not None else module

    def _build_chunk(self, part: int, interval: int) -> PipelineStage:
        n_parts = len(self.parts) - 1
        stage = PipelineStage(part, first=part == 0, last=part == n_parts - 1,
                              checkpoint_interval=interval, tracker=self.rng_tracker)
        first_use: dict[str, int] = {}
        for i, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                first_use.setdefault(spec.key, i)
        for i in range(self.parts[part], self.parts[part + 1]):
            spec = self.specs[i]
            if isinstance(spec, TiedLayerSpec):
                module = self._tied_local.get(spec.key)
                if module is None:  # built (and seeded) as at its first use, on every rank
                    first = first_use[spec.key]
                    module = self._tied_local[spec.key] = self._shared(self.specs[first],
                                                                       first)
                stage.add_tied(i, spec.key, module, spec.forward_fn)
            elif isinstance(spec, LayerSpec):
                stage.add(i, self._build(i, spec))
            else:
                stage.add(i, spec)
        return stage

    def _shared(self, spec: TiedLayerSpec, first_index: int) -> nn.Module:
        """This rank's copy of a tied module; across stages, its tied weights are marked for
        the embedding group's gradient all-reduce (the last stage's copy not in the norm)."""
        module = self._build(first_index, spec)
        ranks = self.tied_stages[spec.key]
        if len(ranks) > 1:
            for attr in spec.tied_weight_attr:
                try:
                    param = module.get_parameter(attr)
                except AttributeError:
                    raise ValueError(f"TiedLayerSpec {spec.key!r}: tied_weight_attr {attr!r} "
                                     f"(of its first use) is not a parameter of "
                                     f"{spec.typename.__name__}") from None
                update_meta(param, tied_embedding=True,
                            shared_embedding=self.ps.pp_rank != 0)
        return module

    # ---- running ---------------------------------------------------------------------------
    def forward(self, x):
        """The whole model in one call: only where this rank holds every layer (pp 1)."""
        if self.num_stages > 1:
            raise RuntimeError("a PipelineModule over several stages runs through "
                               "engine.train_batch/eval_batch, not module(x)")
        for chunk in self.chunks:
            x = chunk(x)
        return x


__all__ = ["PipelineModule", "PipelineStage", "TiedUse", "pipeline_units"]
