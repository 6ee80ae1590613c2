"""One batch of a ``PipelineModule`` through megazero's schedules (the engine's ``train_batch``
and ``eval_batch``), over the pp group, with the loss averaged over the dp group.

Between stages, the first batch sends a shape message before each tensor; if all the tensors
the stages sent had one shape, later batches run at that fixed shape (a tensor of another
shape then fails naming both, unless ``PipelineModule(dynamic_shapes=True)``).

Each ``next(data_iter)`` is one micro-batch ``(inputs, labels)`` as in DeepSpeed: the rank of
the first stage feeds ``inputs`` to the first layer, the rank of the last stage gives the last
layer's output and ``labels`` to ``loss_fn`` (without one, the output is the loss). Other
ranks do not read the iterator (it may be None there). The schedule is the one for the
module's layout: no pipelining, 1F1B, or interleaved 1F1B with virtual stages.
"""

from __future__ import annotations

from functools import partial

import torch

from megazero.distributed import comm
from megazero.pipe.module import PipelineModule
from megazero.pipeline_parallel.schedules import get_forward_backward_func


def _split_batch(batch):
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(f"a PipelineModule's data iterator yields (inputs, labels) pairs, got "
                    f"{type(batch).__name__}"
                    + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))


def _loss(loss_fn, labels, output):
    loss = output if loss_fn is None else loss_fn(output, labels)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError("the PipelineModule's loss (loss_fn(output, labels), or the last "
                         f"layer's output without loss_fn) must be a scalar tensor, got "
                         f"{type(loss).__name__}"
                         + (f" of shape {tuple(loss.shape)}" if torch.is_tensor(loss) else ""))
    return loss.reshape(()), {"loss": loss.detach().reshape(())}


def _to(x, dtype):
    """Floating tensors of ``x`` (a tensor, or a tuple/list of them) in ``dtype``."""
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (tuple, list)):
        return type(x)(_to(t, dtype) for t in x)
    return x


def _forward_step(loss_fn, dtype, data_iterator, chunk):
    inputs = labels = None
    if chunk.pre_process or chunk.post_process:
        if data_iterator is None:
            raise ValueError("train_batch/eval_batch: the first and last pipeline stages "
                             "need a data iterator")
        inputs, labels = _split_batch(next(data_iterator))
        inputs = _to(inputs, dtype)  # fp16/bf16 models take their floating inputs so
    output = chunk(inputs)
    if not chunk.post_process and not (torch.is_tensor(output)
                                       and output.is_floating_point()):
        raise TypeError(f"pipeline part {chunk.part} (layers {chunk.layer_indices}) returns "
                        f"{type(output).__name__}: between stages megazero passes one "
                        "floating-point tensor per micro-batch")
    return output, partial(_loss, loss_fn, labels)


def activation_dtype(module: PipelineModule) -> torch.dtype:
    """The dtype activations travel in between stages: that of the model's parameters."""
    for chunk in module.chunks:
        for p in chunk.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32


def _learn_shape(module: PipelineModule, sent: set) -> None:
    """After the first batch: if every stage sent tensors of one shape, later batches run at
    that fixed shape, without a shape message before each exchange (DeepSpeed likewise sends
    its pipeline's shapes once); otherwise they keep sending shapes."""
    shapes = set()
    for s in comm.all_gather_object(sorted(sent), module.ps.pp_group):
        shapes.update(tuple(x) for x in s)
    module.activation_shape = shapes.pop() if len(shapes) == 1 else None
    module.dynamic_shapes = module.activation_shape is None


def run_batch(module: PipelineModule, data_iter, *, num_microbatches: int, loss_scale=1.0,
              no_sync=None, forward_only: bool = False) -> torch.Tensor:
    """Forward (and backward) ``num_microbatches`` micro-batches; returns the mean loss,
    averaged over dp, on every rank (fp32 scalar on ``ps.device``)."""
    ps = module.ps
    schedule = get_forward_backward_func(ps.pp_size, module.virtual_stages)
    dtype = activation_dtype(module)
    shape = module.activation_shape if ps.pp_size > 1 and not module.dynamic_shapes else None
    learn = ps.pp_size > 1 and not module.dynamic_shapes and shape is None
    sent: set | None = set() if learn else None
    losses = schedule(forward_step_func=partial(_forward_step, module.loss_fn, dtype),
                      data_iterator=[data_iter] * len(module.chunks)
                      if len(module.chunks) > 1 else data_iter, model=list(module.chunks),
                      num_microbatches=num_microbatches, ps=ps, forward_only=forward_only,
                      loss_scale=loss_scale, no_sync=no_sync, tensor_shape=shape,
                      dtype=dtype, sent_shapes=sent)
    if learn:
        _learn_shape(module, sent)
    loss = torch.zeros((), dtype=torch.float32, device=ps.device)
    if ps.is_last_stage:
        loss += torch.stack([d["loss"].float() for d in losses]).mean()
        comm.all_reduce(loss, ps.dp_group)
        loss /= ps.dp_size
    if ps.pp_size > 1:
        comm.broadcast(loss, ps.pp_ranks[-1], ps.pp_group)
    return loss


__all__ = ["activation_dtype", "run_batch"]
