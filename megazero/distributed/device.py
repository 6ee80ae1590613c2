"""Which device a rank's collectives need, and reading device values on the host.

A rank keeps its model, gradients and every hot-path collective on ``ParallelState.device``:
``cuda:<local rank>`` under NCCL, ``cpu`` under gloo. With CUDA present the default process
group is device-mapped (``cpu:gloo,cuda:nccl``, see ``init``): CUDA tensors travel over NCCL,
and the gloo half keeps a route for host-side traffic (``all_gather_object``, checkpoint
metadata). ``expected_device_type(backend)`` says which device a group's hot-path collectives
take; ``distributed.comm`` checks every tensor against it.

Values the host must see (the loss for the log line, the gradient norm, an exit flag) are read
with ``host_values``: one device-to-host copy per call. In the dry run (``megazero.dryrun``)
tensors are fake (shapes, dtypes and devices without data): they read as zeros, so the loop
takes its common path (finite norm, no overflow, no early exit). ``synchronize`` waits for a
real CUDA device only.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

# The default process group's backend when CUDA is present: NCCL for CUDA tensors, gloo for
# CPU tensors (object collectives, host-side metadata).
MAPPED_BACKEND = "cpu:gloo,cuda:nccl"


def is_fake(t) -> bool:
    """True for a fake tensor (``FakeTensorMode``: the dry run), which holds no values."""
    return isinstance(t, FakeTensor)


def _dispatch_modes():
    """The torch dispatch modes active on this thread (a counter of host syncs among them)."""
    return _get_current_dispatch_mode_stack()


HOST_READ_MARK = "megazero::host_read"


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened on the host: one device-to-host copy for a device tensor (an op a
    dispatch mode sees, fake tensors included); a host tensor's read is announced to the
    active modes that count host reads (``note_host_read``: ``dryrun.launches``) and marked
    in torch.profiler's record when it is on (``HOST_READ_MARK``)."""
    t = t.detach().reshape(-1)
    if t.device.type != "cpu":
        return t.to("cpu")
    if torch.autograd.profiler._is_profiler_enabled:
        # no op is dispatched for it: a mark in torch.profiler's record (tests/test_launches)
        with torch.profiler.record_function(HOST_READ_MARK):
            pass
    for mode in _dispatch_modes():
        note = getattr(mode, "note_host_read", None)
        if note is not None:
            note(t, "host read")
    return t


def host_values(t: torch.Tensor) -> list[float]:
    """The elements of ``t`` as Python floats (one copy to the host); zeros for a fake tensor."""
    host = _on_host(t)
    if is_fake(host):
        return [0.0] * host.numel()
    return [float(v) for v in host.tolist()]


def host_float(t: torch.Tensor) -> float:
    """The single element of ``t`` as a Python float; 0.0 for a fake tensor."""
    if t.numel() != 1:
        raise ValueError(f"host_float needs a one-element tensor, got shape {tuple(t.shape)}")
    return host_values(t)[0]


def host_all(t: torch.Tensor) -> bool:
    """``bool(t.all())`` read on the host; True for a fake tensor."""
    host = _on_host(t.all())
    return True if is_fake(host) else bool(host.tolist()[0])


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` (a real CUDA device only; announced to the
    modes that count host syncs, fake CUDA included)."""
    if device.type == "cpu":
        return
    for mode in _dispatch_modes():
        note = getattr(mode, "note_host_sync", None)
        if note is not None:
            note("synchronize")
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


def parse_backend(backend: str | None) -> dict[str, str]:
    """{device type: backend} of a backend string: "gloo" -> {"cpu": "gloo"}, "nccl" ->
    {"cuda": "nccl"}, "cpu:gloo,cuda:nccl" -> both; {} for others (fake, mpi, unknown)."""
    if not backend:
        return {}
    backend = backend.lower()
    if ":" in backend:
        pairs = (part.split(":", 1) for part in backend.split(","))
        return {dev.strip(): name.strip() for dev, name in pairs}
    return {"gloo": {"cpu": "gloo"}, "nccl": {"cuda": "nccl"}}.get(backend, {})


def expected_device_type(backend: str | None) -> str | None:
    """The device type the hot-path collectives of a group with ``backend`` must use: the
    accelerator half of a device-mapped backend, the only device of a plain one; None when
    the backend is unknown (no check)."""
    devices = parse_backend(backend)
    if not devices:
        return None
    accelerators = [d for d in devices if d != "cpu"]
    return accelerators[0] if accelerators else "cpu"


def host_device_type(backend: str | None) -> str | None:
    """The device type for host-side collectives (objects, metadata): CPU when the backend
    has a CPU route, else the accelerator (plain NCCL), None when unknown."""
    devices = parse_backend(backend)
    if not devices:
        return None
    return "cpu" if "cpu" in devices else next(iter(devices))


def fake_to_meta(obj):
    """``obj`` (nested dicts, lists, tuples) with every fake tensor replaced by a meta tensor
    of its shape and dtype: what ``torch.save`` can write for a dry run (no data, the real
    structure). Other values are returned as they are."""
    if is_fake(obj):
        with unset_fake_temporarily():
            return torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        items = {k: fake_to_meta(v) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj  # nothing fake inside: the object itself, not a copy
        out = copy.copy(obj)
        out.update(items)
        return out
    if isinstance(obj, (list, tuple)):
        items = [fake_to_meta(v) for v in obj]
        if all(x is v for x, v in zip(items, obj)):
            return obj
        return type(obj)(items)
    return obj


def host_side():
    """A context for host-side work that needs real values (data loading, key drawing) even
    inside the dry run's fake-tensor mode; does nothing outside it."""
    return unset_fake_temporarily()
