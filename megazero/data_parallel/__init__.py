"""Data parallelism over the dp group: ZeRO stages 0-3 on flat buffers, with mixed precision.

``build_optimizer`` picks the implementation from ``--zero-stage``: stages 0-2 share the flat
buffers of ``zero.py``; stage 3 partitions the parameters themselves (``zero3.py``).
``--optimizer onebitadam`` is 1-bit Adam at stage 0 (``onebit.py``), ``zerooneadam`` 0/1 Adam
(``zeroone.py``); ``--offload-optimizer nvme`` keeps the optimizer states in files
(``nvme.py``), ``--offload-param nvme`` stage 3's parameters too (``nvme_params.py``).
"""

from __future__ import annotations

from megazero.data_parallel.nvme import NvmeZeroOptimizer
from megazero.data_parallel.nvme_params import NvmeZero3Optimizer, swapped_params
from megazero.data_parallel.onebit import OneBitAdamOptimizer
from megazero.data_parallel.zero import ZeroOptimizer
from megazero.data_parallel.zero3 import GatheredParameters, Zero3Optimizer, ZeroOrderError
from megazero.data_parallel.zeroone import ZeroOneAdamOptimizer


def build_optimizer(model_chunks, opt_config, ps, lr_scheduler=None, seed: int = 0,
                    unit_policy=None):
    """The optimizer of ``--zero-stage``. ZeRO-3 only: ``seed`` initialises parameters built
    on the meta device (by name). ``unit_policy(chunk)`` says which modules use which
    parameters: ZeRO-3 gathers them together (default: each module with direct parameters;
    see ``zero3_units``), stages 1-2 wait for their all-gathers before those modules run
    (default: before the chunk's forward; see ``param_sync``)."""
    if opt_config.optimizer == "zerooneadam":
        return ZeroOneAdamOptimizer(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                                    unit_policy=unit_policy)
    if opt_config.optimizer == "onebitadam":
        return OneBitAdamOptimizer(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                                   unit_policy=unit_policy)
    if opt_config.zero_stage == 3:
        cls = NvmeZero3Optimizer if opt_config.offload_optimizer == "nvme" else Zero3Optimizer
        storage = swapped_params(opt_config, ps) if opt_config.offload_param == "nvme" \
            else None
        return cls(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler, seed=seed,
                   unit_policy=unit_policy, storage_factory=storage)
    if opt_config.offload_optimizer == "nvme":
        return NvmeZeroOptimizer(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                                 unit_policy=unit_policy)
    return ZeroOptimizer(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         unit_policy=unit_policy)


__all__ = ["GatheredParameters", "Zero3Optimizer", "ZeroOptimizer", "ZeroOrderError",
           "build_optimizer"]
