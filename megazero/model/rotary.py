"""Rotary position embeddings (RoPE, Su et al. 2021), as Megatron and HF Llama apply them.

Local to each rank (no communication): the cos/sin tables are computed from the token
positions once per forward (``rotary_tables``) and every attention layer rotates its own query
and key heads (``apply_rotary``). The first ``rot`` dimensions of each head are rotated in the
"rotate half" convention: dimension i pairs with i + rot/2 at frequency
``base ** (-2 i / rot)``; the remaining ``head_dim - rot`` dimensions (``--rotary-percent``
below 1) pass through unchanged.
"""

from __future__ import annotations

import torch

from megazero import ops


def rotary_tables(position_ids: torch.Tensor, rot: int, base: float, dtype: torch.dtype):
    """(cos, sin), each ``[b, 1, s, rot]``, for positions ``[b, s]`` (fp32 angles)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32,
                                            device=position_ids.device) / rot))  # [rot/2]
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [b, s, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [b, 1, s, rot]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 fused: bool = True) -> torch.Tensor:
    """RoPE on t ``[b, heads, s, hn]`` (cos, sin ``[b, 1, s, rot]``)."""
    if fused:
        return ops.fused_rope(t, cos, sin)
    return ops.rope_reference(t, cos, sin)
