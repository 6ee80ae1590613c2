"""Pipeline parallelism over the pp group: p2p exchanges and the micro-batch schedules.

``schedules.get_forward_backward_func(pp_size, virtual_pp_size)`` picks no pipelining, 1F1B
(``one_f_one_b``) or the interleaved schedule (``interleaved``); each runs
``microbatch.forward_step`` / ``backward_step`` on this stage's model chunks and exchanges
activations and gradients with the neighbouring stages through ``p2p``. ``trace`` records
when each forward and backward ran (``--pipeline-trace``). Imports ``distributed`` only,
never the model.
"""

from megazero.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
