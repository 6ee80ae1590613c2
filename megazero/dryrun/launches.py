"""What one rank asks of its device per training iteration: kernel launches and host syncs.

``DeviceOpCounter`` is a ``TorchDispatchMode`` (it runs under the dry run's fake tensors as
over real ones) that classifies every op the rank's code dispatches:

* a **launch** is an op that computes on the device: one kernel (or memcpy) per op, except
  the multi-tensor ops (``_foreach_*``, ``_fused_adam(w)_``), which ATen's CUDA
  ``multi_tensor_apply`` splits into launches of at most 2,240 blocks of 65,536 elements and
  ``DEPTH_MAX_TENSORS`` tensors each (its 32 KB kernel-argument limits, sm_70 and newer), and
  the few ATen CUDA ops that launch more than one kernel (``MULTI_KERNEL``). Views, aliases,
  allocations without a fill (``empty``), ``detach`` and other metadata count zero. On a CPU
  job every computing op counts one (what torch.profiler records there, the test's truth);
* a **host sync** is a point where the host waits for the device: a value read
  (``.item()``, ``bool(t)``, ``float(t)``: ``_local_scalar_dense``), an op whose output
  shape depends on values (``nonzero``, ``masked_select``, ``unique``...), a copy from the
  device to the host, a blocking copy from pageable host memory to the device, and an
  explicit ``synchronize`` (``note_host_sync``). Each is kept with the source line that
  caused it (the first frame outside torch and this package's host-read helpers). On a CPU
  job the host reads the values it would wait for on a GPU are counted the same way.

Ops are attributed to a phase: ``forward`` (inside the forward step), ``backward`` (on the
autograd engine), ``communication`` (collectives: one NCCL kernel each), and the phases the
caller opens with ``phase(name)`` (``optimizer``, ``logging``), else ``other`` (data, the
loss reduction). Forward launches are also split by the innermost module class, backward ones
by the autograd node that ran them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ATen's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh), 32 KB kernel
# arguments (CUDA >= 12.1, sm_70+): tensors per launch by depth (number of tensor lists), with
# a scalar list, and blocks per launch; one block per 65,536-element chunk.
DEPTH_MAX_TENSORS = {1: 770, 2: 448, 3: 336, 4: 252, 5: 210}
DEPTH_MAX_TENSORS_SCALARLIST = {1: 672, 2: 448, 3: 336, 4: 252, 5: 210}
MAX_BLOCKS = 2240
CHUNK = 65536

# ATen CUDA ops known to launch more than one kernel (counted on a cuda job only): LayerNorm's
# backward (input gradient, then weight/bias gradients), flash attention's backward (dot(dO, O),
# the main kernel, dQ's conversion), the norm of a tensor list (per-launch partials, then the
# cleanup kernel: added to its multi_tensor_apply launches).
MULTI_KERNEL = {
    "aten.native_layer_norm_backward.default": 2,
    "aten._scaled_dot_product_flash_attention_backward.default": 3,
    # megazero's CUDA custom op wrapping ATen's RMSNorm backward (input and weight gradients);
    # megazero.ops.cuda_ops.KERNELS_PER_CALL lists it too (tests/test_launches.py holds them equal)
    "megazero.rms_norm_backward.default": 2,
}
FOREACH_NORM_EXTRA = 1

# Ops whose result the host must wait for (values, or an output shape that depends on them).
SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
    "aten._unique.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.equal.default", "aten.is_nonzero.default",
    "aten.repeat_interleave.Tensor", "aten.item.default",
})
# Ops that allocate or describe memory without computing (besides ``func.is_view``).
NO_KERNEL = frozenset({
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.detach.default",
    "aten._unsafe_view.default", "aten.set_.source_Storage_storage_offset",
    "aten.set_.source_Storage", "aten.set_.source_Tensor", "aten.set_.default",
    "aten.resize_.default", "aten.lift_fresh.default", "aten.alias.default",
    "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
    "aten.sym_storage_offset.default", "aten.is_same_size.default", "aten.record_stream.default",
})
_SKIP_NAMESPACES = ("profiler", "prim")
_COPY_OPS = ("aten._to_copy.default", "aten.copy_.default")
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HOST_READ_HELPERS = (os.path.join(os.path.dirname(_HERE), "distributed", "device.py"),)


def profiler_name(op: str) -> str:
    """torch.profiler's name of a dispatched op: ``aten.add_.Tensor`` -> ``aten::add_``."""
    ns, name = op.split(".")[:2]
    return f"{ns}::{name}"


def mta_launches(numels: list[int], depth: int, scalar_list: bool = False) -> int:
    """Kernels ATen's ``multi_tensor_apply`` launches over tensors of these sizes."""
    max_tensors = (DEPTH_MAX_TENSORS_SCALARLIST if scalar_list else DEPTH_MAX_TENSORS)[
        min(max(depth, 1), 5)]
    launches = blocks = tensors = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // CHUNK)
        for c in range(chunks):
            blocks += 1
            tensors_full = tensors == max_tensors and c == chunks - 1
            if tensors_full or blocks == MAX_BLOCKS:
                launches += 1
                blocks = 0
                tensors = 0 if c == chunks - 1 else 1
    return launches + (1 if blocks else 0)


def _tensor_lists(args) -> list[list[torch.Tensor]]:
    return [list(a) for a in args
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]


def _fast_path(lists: list[list[torch.Tensor]], cross_dtype: bool) -> bool:
    """Whether a foreach op takes the multi-tensor kernel: one device, one dtype per list (the
    same dtype across lists unless ``cross_dtype``: ``_foreach_copy_`` converts), dense
    tensors, equal sizes across lists (else ATen loops over the tensors)."""
    first = lists[0]
    dev, dtype = first[0].device, first[0].dtype
    for lst in lists:
        if len(lst) != len(first):
            return False
        want = lst[0].dtype if cross_dtype else dtype
        for t, ref in zip(lst, first):
            if t.device != dev or t.dtype != want or t.numel() != ref.numel() \
                    or not t.is_contiguous():
                return False
    return True


def device_kernels(func, args, device_type: str) -> int:
    """Launches one dispatched op makes on ``device_type`` (see the module docstring)."""
    name = str(func)
    if device_type != "cuda":
        return 1
    fused_adam = name.startswith("aten._fused_adam")
    if name.startswith("aten._foreach_") or fused_adam:
        lists = _tensor_lists(args)
        if fused_adam:
            lists = lists[:-1]  # the per-tensor step counts ride as scalars, not a list
        if not lists:
            return 1
        if not _fast_path(lists, cross_dtype=name.startswith("aten._foreach_copy")):
            return len(lists[0])
        scalar_list = any(isinstance(a, (list, tuple)) and a and not isinstance(
            a[0], torch.Tensor) for a in args)
        n = mta_launches([t.numel() for t in lists[0]], len(lists), scalar_list)
        return n + (FOREACH_NORM_EXTRA if name.startswith("aten._foreach_norm") else 0)
    return MULTI_KERNEL.get(name, 1)


@dataclasses.dataclass
class IterationCounts:
    """Launches and syncs of one training iteration (or of everything outside them)."""

    iteration: int | None
    logged: bool = False
    kernel_launches: int = 0
    host_syncs: int = 0
    launches_by_phase: Counter = dataclasses.field(default_factory=Counter)
    launches_by_module: Counter = dataclasses.field(default_factory=Counter)
    launches_by_op: Counter = dataclasses.field(default_factory=Counter)
    syncs_by_phase: Counter = dataclasses.field(default_factory=Counter)
    syncs: Counter = dataclasses.field(default_factory=Counter)  # (kind, where, phase) -> n

    def as_dict(self, top: int = 25) -> dict:
        return {
            "iteration": self.iteration, "logged": self.logged,
            "kernel_launches": self.kernel_launches, "host_syncs": self.host_syncs,
            "launches_by_phase": dict(self.launches_by_phase.most_common()),
            "syncs_by_phase": dict(self.syncs_by_phase.most_common()),
            "launches_by_module": dict(self.launches_by_module.most_common(top)),
            "launches_by_op": dict(self.launches_by_op.most_common(top)),
            "syncs": [{"kind": k, "where": w, "phase": p, "count": n}
                      for (k, w, p), n in self.syncs.most_common()]}


class DeviceOpCounter(TorchDispatchMode):
    """Launches and host syncs per training iteration of a job on ``device_type``."""

    def __init__(self, device_type: str, root: str | None = None):
        super().__init__()
        self.device_type = device_type
        self.root = os.path.abspath(root) if root else os.getcwd()
        self.outside = IterationCounts(None)  # setup, save, evaluation
        self.iterations: list[IterationCounts] = []
        self._current = self.outside
        self._phases: list[str] = []
        self._modules: list[str] = []
        self._forward_depth = 0
        self._lock = threading.Lock()
        self._hooks = []

    # ---- structure: iterations, phases, modules ------------------------------------------
    def start_iteration(self, iteration: int) -> None:
        self._current = IterationCounts(iteration)
        self.iterations.append(self._current)

    def end_iteration(self) -> None:
        self._current = self.outside

    def mark_logged(self) -> None:
        self._current.logged = True

    @contextlib.contextmanager
    def phase(self, name: str):
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    def forward_step(self, forward_step_func):
        """``forward_step_func`` (and the loss function it returns) counted as forward."""
        def counted(fn):
            def run(*args, **kwargs):
                self._forward_depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._forward_depth -= 1
            return run

        def step(data_iterator, model):
            output, loss_func = counted(forward_step_func)(data_iterator, model)
            return output, counted(loss_func)
        return step

    def __enter__(self):
        hooks = torch.nn.modules.module
        self._hooks = [hooks.register_module_forward_pre_hook(self._enter_module),
                       hooks.register_module_forward_hook(self._exit_module)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def _enter_module(self, module, args):
        self._modules.append(type(module).__name__)

    def _exit_module(self, module, args, output):
        if self._modules:
            self._modules.pop()

    def _phase_now(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self._forward_depth > 0:
            return "forward"
        return self._phases[-1] if self._phases else "other"

    # ---- classification ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if func.namespace in _SKIP_NAMESPACES or func.is_view or name in NO_KERNEL:
            return out
        on_device = self._on_device(args, out)
        if name in SYNC_OPS:
            if on_device:
                self._sync(name.split(".")[1].lstrip("_"))
            return out
        if name in _COPY_OPS:
            kind = self._copy_sync(name, args, kwargs, out)
            if kind:
                self._sync(kind)
        phase = "communication" if func.namespace == "c10d" else self._phase_now()
        if not on_device and func.namespace != "c10d":
            return out  # host-side arithmetic of a device job
        n = device_kernels(func, args, self.device_type)
        with self._lock:
            c = self._current
            c.kernel_launches += n
            c.launches_by_phase[phase] += n
            c.launches_by_op[name] += n
            if phase == "forward":
                c.launches_by_module[self._modules[-1] if self._modules else "-"] += n
            elif phase == "backward":
                node = torch._C._current_autograd_node()
                c.launches_by_module[f"backward: {node.name() if node else '-'}"] += n
        return out

    def _on_device(self, args, out) -> bool:
        """Whether the op touches a tensor on the job's device."""
        for t in tree_flatten((args, out))[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                return True
        return False

    def _copy_sync(self, name, args, kwargs, out) -> str | None:
        """'copy to host' for device -> host, 'blocking copy to device' for a pageable (or
        blocking) host -> device copy; None otherwise."""
        if self.device_type == "cpu":
            return None
        if name == "aten._to_copy.default":
            src, dst = args[0], out
        else:
            dst, src = args[0], args[1]
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return None
        s, d = src.device.type, dst.device.type
        if s == self.device_type and d == "cpu":
            return "copy to host"
        non_blocking = kwargs.get("non_blocking", False) or (len(args) > 2 and args[2] is True)
        if s == "cpu" and d == self.device_type and not non_blocking:
            return "blocking copy to device"
        return None

    # ---- syncs -----------------------------------------------------------------------------
    def note_host_sync(self, kind: str) -> None:
        """An explicit wait for the device (``synchronize``)."""
        if self.device_type != "cpu":
            self._sync(kind)

    def note_host_read(self, t: torch.Tensor, kind: str) -> None:
        """The host read ``t``'s values without an op this mode sees (``tolist`` of a host
        tensor): a sync on a GPU, so counted on a CPU job."""
        if t.device.type == "cpu" and self.device_type == "cpu":
            self._sync(kind)

    def _sync(self, kind: str) -> None:
        where = self._caller()
        with self._lock:
            c = self._current
            phase = self._phase_now()
            c.host_syncs += 1
            c.syncs_by_phase[phase] += 1
            c.syncs[(kind, where, phase)] += 1

    def _caller(self) -> str:
        """file:line (function) of the first frame outside torch, this package and the
        host-read helpers."""
        frame = sys._getframe(2)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not (path.startswith(_TORCH) or path.startswith(_HERE)
                    or path in _HOST_READ_HELPERS or "/contextlib.py" in path):
                rel = os.path.relpath(path, self.root) if path.startswith(self.root) else path
                return f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return "?"

    # ---- results ---------------------------------------------------------------------------
    def steady(self) -> IterationCounts | None:
        """The last iteration that did not log (the steady state), else the last one."""
        quiet = [c for c in self.iterations if not c.logged]
        return quiet[-1] if quiet else (self.iterations[-1] if self.iterations else None)

    def summary(self) -> dict:
        """``kernel_launches`` and ``host_syncs`` of the steady iteration, the same of the
        last logging iteration, and every iteration's breakdown."""
        steady = self.steady()
        logged = [c for c in self.iterations if c.logged]
        return {
            "kernel_launches": steady.kernel_launches if steady else 0,
            "host_syncs": steady.host_syncs if steady else 0,
            "counted_iteration": steady.iteration if steady else None,
            "logging_iteration": {"iteration": logged[-1].iteration,
                                  "kernel_launches": logged[-1].kernel_launches,
                                  "host_syncs": logged[-1].host_syncs} if logged else None,
            "device_ops": [c.as_dict() for c in self.iterations]}


def instrument(trainer, counter: DeviceOpCounter) -> None:
    """Wire ``counter`` to a ``training.Trainer``: an iteration from one
    ``monitor.iteration_start`` to the next (or to a checkpoint save), the optimizer's
    methods as the ``optimizer`` phase, the log line as ``logging``."""
    monitor, optimizer = trainer.monitor, trainer.optimizer
    iteration_start, log, save = monitor.iteration_start, trainer.log, trainer.save

    def start(iteration):
        counter.start_iteration(iteration)
        iteration_start(iteration)

    def logged(*args, **kwargs):
        counter.mark_logged()
        with counter.phase("logging"):
            return log(*args, **kwargs)

    def saved(*args, **kwargs):
        counter.end_iteration()
        return save(*args, **kwargs)

    def in_phase(fn, name):
        def run(*args, **kwargs):
            with counter.phase(name):
                return fn(*args, **kwargs)
        return run

    monitor.iteration_start, trainer.log, trainer.save = start, logged, saved
    for method in ("zero_grad", "finish_grad_sync", "step"):
        setattr(optimizer, method, in_phase(getattr(optimizer, method), "optimizer"))
