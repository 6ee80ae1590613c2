"""Where a ``PipelineModule``'s layers go: contiguous parts, one per (virtual) pipeline stage.

``partition_method`` as in DeepSpeed:

* ``"parameters"``: balance the trainable parameter count of the parts;
* ``"uniform"``: balance the number of layers;
* ``"type:<regex>"``: balance the number of layers whose class name matches ``<regex>``
  (case-insensitive), e.g. ``"type:TransformerBlock"``;
* a list of ``parts + 1`` boundaries (``[0, 3, 6]``: layers 0-2 and 3-5), megazero's.

Balancing minimises the heaviest part (the pipeline's bottleneck) over contiguous splits;
ties go to the split that puts the boundaries earliest, so every rank computes the same one.
Returned boundaries ``b`` give part ``i`` the layers ``b[i]:b[i + 1]``.
"""

from __future__ import annotations

import re


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving each part ``num_items // num_parts`` items, the first ones one more."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for i in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _parts_needed(weights: list[int], cap: int) -> list[int] | None:
    """Greedy boundaries with every part's weight <= cap (None if an item exceeds it)."""
    bounds, total = [0], 0
    for i, w in enumerate(weights):
        if w > cap:
            return None
        if total + w > cap:
            bounds.append(i)
            total = 0
        total += w
    bounds.append(len(weights))
    return bounds


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest of ``num_parts`` parts, each part
    holding at least one item."""
    n = len(weights)
    if n < num_parts:
        raise ValueError(f"cannot split {n} layers into {num_parts} pipeline parts")
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:  # the smallest cap a greedy split fits into num_parts parts
        mid = (lo + hi) // 2
        b = _parts_needed(weights, mid)
        if b is not None and len(b) - 1 <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    bounds = _parts_needed(weights, lo)
    # Too few parts (light items): split the largest parts further, one item at a time off
    # their ends, until every part exists; the bottleneck never grows.
    while len(bounds) - 1 < num_parts:
        sizes = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        size, i = max(sizes, key=lambda t: (t[0], -t[1]))
        bounds.insert(i + 1, bounds[i + 1] - 1 if size > 1 else bounds[i + 1])
    return bounds


def partition(method, layer_classes: list[str], param_counts: list[int],
              num_parts: int) -> list[int]:
    """Boundaries for ``method`` (see the module docstring)."""
    n = len(layer_classes)
    if n < num_parts:
        raise ValueError(f"PipelineModule has {n} layers, fewer than its {num_parts} "
                         "pipeline parts (num_stages x virtual stages)")
    if isinstance(method, (list, tuple)):
        bounds = [int(b) for b in method]
        if len(bounds) != num_parts + 1 or bounds[0] != 0 or bounds[-1] != n \
                or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"partition_method boundaries {list(method)} must be "
                             f"{num_parts + 1} increasing numbers from 0 to {n}")
        return bounds
    if not isinstance(method, str):
        raise ValueError(f"partition_method {method!r}: use 'parameters', 'uniform', "
                         "'type:<regex>' or a list of boundaries")
    kind = method.lower()
    if kind == "uniform":
        return partition_uniform(n, num_parts)
    if kind == "parameters":
        return partition_balanced(param_counts, num_parts)
    if kind.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [1 if pattern.search(c) else 0 for c in layer_classes]
        if not any(weights):
            raise ValueError(f"partition_method {method!r} matches no layer (classes: "
                             f"{sorted(set(layer_classes))})")
        return partition_balanced(weights, num_parts)
    raise ValueError(f"partition_method {method!r}: use 'parameters', 'uniform', "
                     "'type:<regex>' or a list of boundaries")


__all__ = ["partition", "partition_balanced", "partition_uniform"]
