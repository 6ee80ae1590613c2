"""Forward/backward schedules over micro-batches, across the pipeline-parallel group.

``get_forward_backward_func(pp_size, virtual_pp_size)`` returns one of:

* ``forward_backward_no_pipelining``: one stage; gradient accumulation over micro-batches
  (all but the last inside the optimizer's ``no_sync``).
* ``forward_backward_pipelining_without_interleaving``: 1F1B. Warmup of ``pp - rank - 1``
  forwards, a steady phase alternating one forward and one backward, a cooldown of backwards.
* ``forward_backward_pipelining_with_interleaving``: each rank holds ``v`` model chunks
  (virtual stages); the same three phases over ``v * m`` chunk-micro-batches, with the
  p2p exchanges optionally overlapped with compute (``overlap_p2p_comm``).

Every schedule takes the same keyword arguments and returns, on the last stage, the list of
per-micro-batch loss dicts (empty elsewhere). ``forward_step_func(data_iterator, model)``
returns ``(output, loss_func)`` as in Megatron; ``loss_func(output)`` returns
``(loss, {"lm loss": detached loss})``. Losses are divided by the number of micro-batches and
multiplied by ``loss_scale`` before backward.
"""

from __future__ import annotations

from megazero.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving
from megazero.pipeline_parallel.microbatch import forward_backward_no_pipelining
from megazero.pipeline_parallel.one_f_one_b import (
    forward_backward_pipelining_without_interleaving,
)


def get_forward_backward_func(pp_size: int, virtual_pp_size: int | None = None):
    """The schedule for ``pp_size`` stages (interleaved when ``virtual_pp_size`` > 1)."""
    if pp_size == 1:
        return forward_backward_no_pipelining
    if virtual_pp_size is not None and virtual_pp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


__all__ = ["forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
           "forward_backward_pipelining_without_interleaving", "get_forward_backward_func"]
