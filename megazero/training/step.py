"""One training iteration and evaluation, over the pp group's schedule and the dp group's
optimizer: forward/backward over the micro-batches, gradient sync, optimizer step. The losses
are averaged over micro-batches and reduced over dp on the device; nothing here reads a value
on the host during training (``evaluate`` reads its totals once per evaluation iteration).
"""

from __future__ import annotations

import torch

from megazero.distributed import comm
from megazero.distributed.device import host_values
from megazero.distributed.parallel_state import ParallelState
from megazero.pipeline_parallel.schedules import get_forward_backward_func


def train_step(forward_step_func, data_iterator, model, optimizer, config, ps, timers,
               trace=None, num_microbatches: int | None = None):
    """One iteration: forward/backward over the micro-batches (``num_microbatches``, default
    the config's), grad sync, optimizer step."""
    fwd_bwd = get_forward_backward_func(ps.pp_size, ps.virtual_pp_size)
    optimizer.zero_grad()
    timers("forward-backward").start()
    losses = fwd_bwd(forward_step_func=forward_step_func, data_iterator=data_iterator,
                     model=model, num_microbatches=num_microbatches or config.num_microbatches,
                     ps=ps, loss_scale=optimizer.loss_scale, no_sync=optimizer.no_sync,
                     tensor_shape=_tensor_shape(config, ps),
                     dtype=config.model.torch_dtype, trace=trace,
                     overlap_p2p_comm=config.parallel.overlap_p2p_comm)
    timers("forward-backward").stop()
    timers("optimizer").start()
    optimizer.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    timers("optimizer").stop()
    return _reduce_losses(losses, ps), ok, grad_norm


def _tensor_shape(config, ps):
    s = config.model.seq_length
    if config.parallel.sequence_parallel and ps.tp_size > 1:
        s //= ps.tp_size
    return (s, config.train.micro_batch_size, config.model.hidden_size)


def _reduce_losses(losses: list[dict], ps: ParallelState) -> dict:
    """Mean over micro-batches and data-parallel ranks: {name: float64 0-dim device tensor}
    on the last stage ({} elsewhere); nothing is read on the host."""
    if not ps.is_last_stage or not losses:
        return {}
    keys = sorted(losses[0])
    # [micro-batches, losses] on the device: one all-reduce
    local = torch.stack([torch.stack([torch.as_tensor(d[k], dtype=torch.float64,
                                                      device=ps.device).reshape(())
                                      for k in keys]) for d in losses]).mean(0)
    comm.all_reduce(local, ps.dp_group)
    local /= ps.dp_size
    return dict(zip(keys, local.unbind()))


@torch.no_grad()
def evaluate(forward_step_func, data_iterator, model, config, ps) -> dict:
    for chunk in model:
        chunk.eval()
    fwd_bwd = get_forward_backward_func(ps.pp_size, ps.virtual_pp_size)
    totals: dict[str, float] = {}
    for _ in range(config.train.eval_iters):
        losses = fwd_bwd(forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=model, num_microbatches=config.num_microbatches, ps=ps,
                         forward_only=True, tensor_shape=_tensor_shape(config, ps),
                         dtype=config.model.torch_dtype,
                         overlap_p2p_comm=config.parallel.overlap_p2p_comm)
        reduced = _reduce_losses(losses, ps)
        values = host_values(torch.stack(list(reduced.values()))) if reduced else []
        for k, v in zip(reduced, values):
            totals[k] = totals.get(k, 0.0) + v / config.train.eval_iters
    return totals
