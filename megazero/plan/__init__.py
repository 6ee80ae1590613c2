"""The planner: which layout trains a model on a cluster fastest without running out of
memory (``python -m megazero.plan``).

It enumerates megazero's layouts (tp, pp, virtual stages, dp, ZeRO stage, micro-batch,
sequence parallelism, recompute, CPU offload) for a model (``models``) on a system
(``system``: SYSTEM.json), takes each layout's memory from megazero's own partition
arithmetic and dry-run-calibrated activations (``memory``, ``activations``), its step time
from a cost model validated on published Megatron runs and on measured CPU runs (``cost``,
``published``, ``calibrate``), and ranks them (``search``); ``layout`` writes the launch
line. A tool: it imports the runtime's parts, nothing in megazero imports it.
"""

from megazero.plan.layout import Job, Layout
from megazero.plan.search import plan
from megazero.plan.system import PlanInputError, load_system

__all__ = ["Job", "Layout", "PlanInputError", "load_system", "plan"]
