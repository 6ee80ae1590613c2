"""Inference: text generation from a checkpoint saved at any layout (KV cache, tp sharded).

``python -m megazero.inference.generate --load CKPT --prompt ...``; see ``generate``.
"""
