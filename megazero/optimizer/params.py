"""Which parameters are what, for the data-parallel optimizers (no process group of its own).

Weight-decay exclusions, counting each gradient element once in the global norm across the
model-parallel group, the word embedding tied across pipeline stages, the model's trainable
parameters in a stable order, and two small helpers shared by ZeRO stages 0-3.
"""

from __future__ import annotations

import torch

from megazero import comm
from megazero.parallel_state import ParallelState


def no_weight_decay(name: str, param) -> bool:
    """Megatron's exclusions: biases and 1-D parameters (LayerNorm weights)."""
    shape = getattr(param, "mz_local_shape", param.shape)  # ZeRO-3 frees the storage
    return name.endswith(".bias") or len(shape) == 1


def counted_in_norm(param, ps: ParallelState) -> bool:
    """Count each gradient element once across the model-parallel group."""
    if getattr(param, "shared_embedding", False):
        return False  # the last stage's copy of the tied word embedding
    if not getattr(param, "tensor_model_parallel", False) and ps.tp_rank != 0:
        return False  # replicated across tp: counted on tp rank 0 only
    return True


def tied_across_stages(param, ps: ParallelState) -> bool:
    return ps.pp_size > 1 and getattr(param, "tied_embedding", False)


def collect_named_params(model_chunks) -> list[tuple[str, torch.nn.Parameter]]:
    seen, out = set(), []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((getattr(p, "mz_name", name), p))
    return out


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
