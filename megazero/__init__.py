"""megazero: Megatron-style 3D parallelism (tensor, pipeline, ZeRO data) for GPT-2 pretraining."""

__version__ = "0.1.0"

from megazero import initialize  # noqa: E402,F401  - callable: megazero.initialize(model, ...)
