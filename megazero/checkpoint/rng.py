"""RNG states in checkpoints: python, numpy, torch (CPU and CUDA) and the RNG tracker.

Each dp rank's states are saved (gathered into its cell's model file) so a resume at the same
tp x pp x dp grid continues every stream exactly. At another grid there is no saved state
for the new ranks: ``rederive_rng`` seeds fresh, deterministic streams from (``--seed``,
iteration, pp rank), like a new run, so with dropout off the run continues exactly.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megazero.tensor_parallel.random import model_parallel_manual_seed


def get_rng_state(tracker) -> dict:
    np_state = np.random.get_state()
    state = {"random": random.getstate(),
             "np_random": (np_state[0], torch.from_numpy(np_state[1].copy()), int(np_state[2]),
                           int(np_state[3]), float(np_state[4])),
             "torch": torch.get_rng_state(),
             "tracker": tracker.get_states() if tracker is not None else {}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, tracker) -> None:
    random.setstate(_tupleize(state["random"]))
    name, keys, pos, has_gauss, gauss = state["np_random"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and state.get("tracker"):
        tracker.set_states(state["tracker"])


def _tupleize(x):
    return tuple(_tupleize(v) for v in x) if isinstance(x, (list, tuple)) else x


def rederive_rng(seed: int, iteration: int, ps, tracker) -> None:
    """Fresh, deterministic RNG streams for a layout the checkpoint has no states for:
    seeded from (``seed``, iteration, pp rank), like a new run (model-parallel stream
    ``+ 2718 + tp_rank``)."""
    seed = seed + 1_000_003 * (iteration + 1) + 100 * ps.pp_rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    model_parallel_manual_seed(seed, ps.tp_rank, tracker)
