"""GPT-2 built directly from tensor-parallel layers; stages for the pipeline schedules."""

from __future__ import annotations

from megazero.config import ModelConfig
from megazero.distributed.parallel_state import ParallelState
from megazero.model.gpt2 import GPTModel, gpt_zero3_units, stage_layer_numbers
from megazero.model.kv_cache import KVCache


def build_gpt_model_chunks(config: ModelConfig, ps: ParallelState, *, tracker=None,
                           seed: int | None = None, sequence_parallel: bool = False,
                           device=None) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving).

    Chunk c of pipeline rank r is pre-processing (embedding) iff r and c are the first, and
    post-processing (head and loss) iff they are the last. With ``seed`` the parameters are
    initialised from (seed, global parameter name): the same full model for any layout.
    """
    v = ps.virtual_pp_size or 1
    chunks = []
    for c in range(v):
        chunks.append(GPTModel(
            config, ps, tracker=tracker,
            pre_process=ps.is_first_stage and c == 0,
            post_process=ps.is_last_stage and c == v - 1,
            layer_numbers=stage_layer_numbers(config.num_layers, ps.pp_size, ps.pp_rank,
                                              ps.virtual_pp_size, c),
            sequence_parallel=sequence_parallel, seed=seed, device=device))
    return chunks


__all__ = ["GPTModel", "KVCache", "build_gpt_model_chunks", "gpt_zero3_units",
           "stage_layer_numbers"]
