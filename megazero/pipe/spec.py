"""Layer specifications of a ``PipelineModule`` (DeepSpeed's ``LayerSpec``/``TiedLayerSpec``).

A spec records a layer's class and constructor arguments without building it, so each
pipeline rank builds only the layers of its own stages. ``build()`` constructs the module.

``TiedLayerSpec(key, ...)`` layers share one module per key: every use of the key on a stage
runs that stage's single instance (``forward_fn(module, x)`` when given, e.g. an embedding used
again as the output projection). When the uses fall on different pipeline stages, each stage
holds a copy, drawn identically, whose ``tied_weight_attr`` parameters have their gradients
all-reduced between the stages (``PipelineModule``); the copies stay equal.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


class LayerSpec:
    """``LayerSpec(typename, *args, **kwargs)``: ``typename(*args, **kwargs)``, built later."""

    def __init__(self, typename: type, *module_args, **module_kwargs):
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, not {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every spec with the same ``key``."""

    def __init__(self, key: str, typename: type, *module_args,
                 forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"TiedLayerSpec key {key!r} must be an identifier (it names "
                             "the module: tied_modules.<key>)")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) \
            else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


__all__ = ["LayerSpec", "TiedLayerSpec"]
