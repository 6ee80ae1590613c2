"""``--compile``: ``torch.compile`` on each transformer layer's forward (torchtitan's regional
compile), local to each rank (it changes no collective, shard or group).

``LayerCompile.for_config(config)`` says how ``GPTModel`` builds and runs its layers. With
``ModelConfig.compile`` the layers are built with megazero's fused-op switches off
(``layer_config``): those ops are autograd Functions calling pybind kernels with raw pointers,
which dynamo cannot trace, and inductor fuses the plain formulas' elementwise chains itself
(bias-GELU, bias-dropout-add, the norms, RoPE, SwiGLU: one generated kernel per chain). Outside
the layers (embedding, final norm, loss) the fused ops stay as configured.

What runs inside the compiled region, and what stays out:

- The layer's *forward function* is compiled, not the module call: ``layer.forward`` becomes
  a ``_CompiledForward`` and ``nn.Module.__call__`` still runs the hooks around it. ZeRO-3's
  unit gathers (forward and backward pre-hooks on the layer, ``gpt_zero3_units``) and its
  saved-tensor hooks therefore stay eager, outside the graph; a hook on a module *inside* a
  compiled layer (a unit policy other than the GPT one) is refused with an error, since dynamo
  would trace it.
- tp = 1 (any pp, dp, ZeRO stage): the whole layer is one graph, no graph break. The
  tensor-parallel mappings are the identity on a group of one, and the tracker's ``fork``
  (which swaps the host's generator states, untraceable) is not used: a one-rank group has no
  other rank whose dropout must differ, so the layer is built without the tracker and dropout
  draws from the default stream.
- tp > 1: a documented boundary. The tensor-parallel linears (their matmul and megazero's
  collective through ``distributed.comm``) run eagerly, and the layer's local stretches
  between them (norm; split, RoPE and attention core; bias-dropout-add and norm; bias-GELU or
  SwiGLU; bias-dropout-add) are the compiled regions. torch 2.13's functional collectives
  do compile on gloo (tested), but they would bypass ``comm``: its byte accounting, device
  checks, the dry run's records and cross-rank comparison, the shared-memory ring that carries
  large gloo collectives, the order checks; and they have no autograd of Megatron's f/g pairs,
  so a second, traceable copy of ``tensor_parallel.mappings`` would be needed. On CPU gloo
  collectives block anyway (nothing to overlap), and no elementwise chain spans a collective
  (each sits next to a matmul), so the boundary costs no fusion. Where dropout swaps RNG
  streams (the attention core with ``--attention-dropout`` > 0, bias-dropout-add under
  sequence parallelism) that piece runs eagerly too, inside the tracker's ``fork``, so it
  draws from the stream it draws from without ``--compile``.
- ``--recompute-granularity full``: megazero's ``checkpoint`` calls the layers (compiled)
  without grad in forward and again with grad in backward, with the RNG states restored
  (one graph each). ``selective``: the checkpointed attention core runs eagerly (megazero's
  ``checkpoint``, RNG replay included) between compiled regions; recomputing the core inside
  a graph while its forward ran in another would draw different dropout masks.
- Dropout inside a compiled region uses inductor's RNG (Philox, seeded from the default
  generator at each graph call): other masks than eager's for the same seed, the same
  distribution. Recompute stays consistent: the restored generator gives the same seeds.
- Decoding with a KV cache (``kv_cache``) runs the layer eagerly (its cache bookkeeping
  mutates Python state every step).
- Cost: the first iteration compiles (inductor's C++ build on CPU, cached on disk for later
  runs); each further mode (evaluation, a forward without grad) compiles once more. All
  layers share their graphs. torch._dynamo and inductor are imported only with ``--compile``.
- The dry run (an active ``FakeTensorMode``: fake tensors cannot be compiled, and a CPU-only
  torch has no GPU code generator) builds and runs the layers eagerly with the configured
  fused ops, and ``compile_note`` says so for its report.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from megazero.config import ModelConfig
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# What the dry-run report says when the job asked for --compile.
DRY_RUN_NOTE = ("--compile: the transformer layers ran eagerly with megazero's fused ops "
                "(fake tensors cannot be compiled, and a CPU-only torch generates no GPU "
                "code); a compiled layer launches one kernel per elementwise chain")

# The fused-op switches a compiled layer turns off (inductor fuses the plain formulas).
_FUSION_FIELDS = ("bias_gelu_fusion", "bias_dropout_fusion", "fused_layernorm",
                  "bias_swiglu_fusion", "apply_rope_fusion")


def _fake_mode_active() -> bool:
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


@dataclasses.dataclass(frozen=True)
class LayerCompile:
    """How a model's transformer layers are built and run: compiled or eager.

    ``compiled``: each layer's forward goes through ``torch.compile``; ``note``: why
    ``--compile`` was asked for and not applied (the dry run), for reports."""

    compiled: bool = False
    note: str | None = None

    @classmethod
    def for_config(cls, config: ModelConfig) -> LayerCompile:
        """Compiled when ``config.compile``, except under the dry run's fake tensors."""
        if not config.compile:
            return cls()
        if _fake_mode_active():
            return cls(note=DRY_RUN_NOTE)
        return cls(compiled=True)

    def layer_config(self, config: ModelConfig) -> ModelConfig:
        """The config the layers are built with: fused ops off when compiled."""
        if not self.compiled:
            return config
        return dataclasses.replace(config, **{name: False for name in _FUSION_FIELDS})

    def layer_tracker(self, tracker, tp_size: int):
        """The RNG tracker the layers get: none when compiled at tp = 1 (see the module
        docstring: dropout then draws from the default stream, inside the graph)."""
        return None if self.compiled and tp_size == 1 else tracker

    def apply(self, layer: nn.Module, tp_size: int) -> None:
        """Compile ``layer``'s forward (a ``TransformerLayer``), with the tp > 1 boundary."""
        if not self.compiled:
            return
        if tp_size > 1:
            # NOTE: the boundary. The tp linears (matmul + collective) and the pieces that
            # fork the RNG tracker run eagerly; dynamo compiles what lies between them.
            for mod in layer.modules():
                if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                    mod.forward = _Eager(mod, type(mod).forward)
            attention = layer.attention
            if attention.tracker is not None and attention.dropout_p > 0:
                attention._dropout_core = _Eager(attention, type(attention)._dropout_core)
            if layer.sequence_parallel and layer.tracker is not None:
                layer._residual_dropout = _Eager(layer, type(layer)._residual_dropout)
        if layer.attention.selective_recompute:
            attention = layer.attention
            attention._recomputed_core = _Eager(attention, type(attention)._recomputed_core)
        layer.forward = _CompiledForward(layer)


def compile_note(model_chunks) -> str | None:
    """What a report should say about ``--compile`` for these chunks (None: nothing)."""
    notes = {getattr(c, "layer_compile", LayerCompile()).note for c in model_chunks}
    notes.discard(None)
    return notes.pop() if notes else None


class _Eager:
    """``fn(module, ...)`` run eagerly, never traced (dynamo leaves the graph around the
    call). Holds the module weakly: stored on the module, it makes no reference cycle."""

    def __init__(self, module: nn.Module, fn):
        self.module = weakref.ref(module)
        self.fn = torch.compiler.disable(fn)

    def __call__(self, *args, **kwargs):
        return self.fn(self.module(), *args, **kwargs)


class _CompiledForward:
    """A ``TransformerLayer``'s forward through ``torch.compile`` (one compiled function for
    every layer of the class: dynamo treats the module's parameters as graph inputs, so the
    layers share their graphs). Holds the layer weakly (no reference cycle)."""

    def __init__(self, layer: nn.Module):
        self.layer = weakref.ref(layer)
        self.eager = type(layer).forward
        self.compiled = torch.compile(self.eager)
        self.checked = False

    def __call__(self, x, attention_mask=None, kv_cache=None, rotary=None):
        layer = self.layer()
        if kv_cache is not None:  # decoding: the cache's bookkeeping is Python state
            return self.eager(layer, x, attention_mask, kv_cache=kv_cache, rotary=rotary)
        if not self.checked:
            _check_no_inner_hooks(layer)
            self.checked = True
        return self.compiled(layer, x, attention_mask, rotary=rotary)


def _check_no_inner_hooks(layer: nn.Module) -> None:
    """Refuse hooks on modules inside a compiled layer: dynamo would trace them into the
    graph (a ZeRO-3 unit policy whose units are smaller than a layer)."""
    for name, mod in layer.named_modules():
        if name and (mod._forward_pre_hooks or mod._forward_hooks
                     or mod._backward_pre_hooks or mod._backward_hooks):
            raise RuntimeError(
                f"--compile: module {name!r} inside a compiled transformer layer has hooks; "
                "only the layer's own module call may carry them (ZeRO-3 needs the GPT unit "
                "policy, megazero.model.gpt_zero3_units, whose units are whole layers)")
