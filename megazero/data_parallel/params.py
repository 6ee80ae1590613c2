"""Which parameters are what, for the data-parallel optimizers (no process group of its own).

Weight-decay exclusions, counting each gradient element once in the global norm across the
model-parallel group, the word embedding tied across pipeline stages, the model's trainable
parameters in a stable order, and two small helpers shared by ZeRO stages 0-3.
"""

from __future__ import annotations

import torch

from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel.meta import meta_of


def no_weight_decay(name: str, param) -> bool:
    """Megatron's exclusions: biases and 1-D parameters (LayerNorm weights)."""
    return name.endswith(".bias") or len(meta_of(param).local_shape) == 1


def counted_in_norm(param, ps: ParallelState) -> bool:
    """Count each gradient element once across the model-parallel group."""
    meta = meta_of(param)
    if meta.shared_embedding:
        return False  # the last stage's copy of the tied word embedding
    if not meta.tensor_parallel and ps.tp_rank != 0:
        return False  # replicated across tp: counted on tp rank 0 only
    return True


def tied_across_stages(param, ps: ParallelState) -> bool:
    return ps.pp_size > 1 and meta_of(param).tied_embedding


def collect_named_params(model_chunks) -> list[tuple[str, torch.nn.Parameter]]:
    seen, out = set(), []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def model_dtype(named) -> torch.dtype:
    """The one dtype of the trainable parameters (the flat buffers hold one dtype)."""
    dtypes = sorted({p.dtype for _, p in named}, key=str)
    if len(dtypes) != 1:
        raise ValueError(f"all trainable parameters must share one dtype, got {dtypes}")
    return dtypes[0]


def find_fragment(frags, seg):
    """The saved optimizer fragment covering exactly ``seg`` (a layout segment)."""
    for entry in frags.get(seg.name, []):
        if entry["param_start"] == seg.param_start and entry["param_end"] == seg.param_end:
            return entry
    raise KeyError(f"optimizer checkpoint has no fragment [{seg.param_start}, "
                   f"{seg.param_end}) of {seg.name}")


def all_reduce_list(tensors, group):
    """All-reduce several small tensors with one collective (flatten, reduce, copy back)."""
    if not tensors or comm.group_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
