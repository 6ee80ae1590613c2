"""megazero: Megatron-style 3D parallelism (tensor, pipeline, ZeRO data) for GPT-2 pretraining.

``megazero.initialize(model, optimizer_config, parallel_state)`` builds the engine around any
model (DeepSpeed's name; see ``megazero.engine``). The parts live in one folder each
(``distributed``, ``tensor_parallel``, ``pipeline_parallel``, ``data_parallel``, ``optim``,
``model``, ``checkpoint``, ``data``, ``tokenizer``, ``training``, ``inference``, ``ops``,
``tools``); docs/ARCHITECTURE.md says what each may import.

Modules that moved keep their old import paths (``_MOVED``): importing one returns the new
module itself (one object, so state is shared) with a ``DeprecationWarning``. The package
imports nothing heavy itself (no torch at ``import megazero``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

# old module path -> new module path
_MOVED = {
    "megazero.comm": "megazero.distributed.comm",
    "megazero.ring": "megazero.distributed.ring",
    "megazero.parallel_state": "megazero.distributed.parallel_state",
    "megazero.generate": "megazero.inference.generate",
    "megazero.timers": "megazero.training.timers",
    "megazero.optimizer": "megazero.data_parallel",
    "megazero.optimizer.zero": "megazero.data_parallel.zero",
    "megazero.optimizer.zero3": "megazero.data_parallel.zero3",
    "megazero.optimizer.update": "megazero.optim.rules",
    "megazero.optimizer.grad_scaler": "megazero.optim.grad_scaler",
    "megazero.optimizer.lr_scheduler": "megazero.optim.lr_scheduler",
}


class _Initialize:
    """``megazero.initialize``: called, the engine constructor
    (``megazero.engine.initialize(model, optimizer_config, parallel_state, ...)``); its
    attributes are those of ``megazero.distributed.init`` plus ``set_random_seed``, which the
    old ``megazero.initialize`` module held (``megazero.initialize.init_distributed``,
    ``from megazero.initialize import init_distributed`` keep working)."""

    __name__ = "megazero.initialize"

    def __call__(self, *args, **kwargs):
        from megazero.engine import initialize

        return initialize(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "set_random_seed":
            from megazero.tensor_parallel.random import set_random_seed

            return set_random_seed
        return getattr(importlib.import_module("megazero.distributed.init"), name)

    def __repr__(self) -> str:
        return "<megazero.initialize: the engine constructor; distributed init attributes>"


initialize = _Initialize()


class _MovedLoader(importlib.abc.Loader):
    """Loads an old path by importing the new module and putting it in ``sys.modules`` under
    the old name too (the import system returns what ``exec_module`` left there)."""

    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__spec__.name
        if self.target is initialize:
            sys.modules[name] = initialize
            return
        warnings.warn(f"{name} moved to {self.target}; import it from there",
                      DeprecationWarning, stacklevel=2)
        sys.modules[name] = importlib.import_module(self.target)

    def get_code(self, fullname):  # ``python -m <old path>`` runs the new module's code
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "megazero.initialize":
            return importlib.machinery.ModuleSpec(fullname, _MovedLoader(initialize))
        new = _MOVED.get(fullname)
        if new is None:
            return None
        is_package = fullname == "megazero.optimizer"
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new),
                                              is_package=is_package)


# DeepSpeed's top-level names (``import megazero as deepspeed``), imported on first use
_DEEPSPEED_NAMES = {"add_config_arguments": "megazero.arguments",
                    "init_distributed": "megazero.engine",
                    "PipelineModule": "megazero.pipe", "LayerSpec": "megazero.pipe",
                    "TiedLayerSpec": "megazero.pipe"}
_SUBPACKAGES = {"pipe", "zero"}


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        target = "megazero.data_parallel" if name == "zero" else f"megazero.{name}"
        return importlib.import_module(target)
    if name in _DEEPSPEED_NAMES:
        return getattr(importlib.import_module(_DEEPSPEED_NAMES[name]), name)
    raise AttributeError(f"module 'megazero' has no attribute {name!r}")


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
