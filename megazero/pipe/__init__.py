"""DeepSpeed's ``deepspeed.pipe`` for megazero: ``PipelineModule`` splits a sequential model
built from ``LayerSpec``/``TiedLayerSpec`` over the pipeline-parallel group; the engine's
``train_batch``/``eval_batch`` run it with megazero's 1F1B or interleaved schedule, ZeRO over
the dp group and any tensor-parallel layers inside the user's modules."""

from megazero.pipe.module import PipelineModule, PipelineStage, pipeline_units
from megazero.pipe.partition import partition_balanced, partition_uniform
from megazero.pipe.spec import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "PipelineStage", "TiedLayerSpec",
           "partition_balanced", "partition_uniform", "pipeline_units"]
