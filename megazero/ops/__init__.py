"""Python faces of megazero's compiled kernels, each with a PyTorch reference path.

Kernels live in ``csrc/<name>/`` and are built by setup.py as ``megazero.ops._<name>``;
``megazero.ops._loader.load_extension`` returns the module or ``None`` (then the reference path
runs). ``python -m megazero.ops`` reports what is built.
"""

from megazero.ops._loader import load_extension

__all__ = ["load_extension"]
