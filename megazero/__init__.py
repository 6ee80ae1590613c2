"""megazero: Megatron-style 3D parallelism (tensor, pipeline, ZeRO data) for GPT-2 pretraining."""

__version__ = "0.1.0"


def __getattr__(name):
    # ``megazero.initialize(model, ...)`` (the engine) without importing torch at package
    # import: the submodule is callable and loaded on first use.
    if name == "initialize":
        import importlib

        return importlib.import_module("megazero.initialize")
    raise AttributeError(f"module 'megazero' has no attribute {name!r}")
