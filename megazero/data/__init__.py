"""GPT-2 pretraining data: Megatron-compatible indexed datasets, samples, blends and samplers.

- ``indexed_dataset``: ``.bin/.idx`` (MMIDIDX) writer, memory-mapped reader, and the check
  of a dataset at setup (integer ids below the vocabulary; cached beside the index).
- ``preprocess``: jsonl -> ``.bin/.idx`` (``python -m megazero.data.preprocess``).
- ``gpt_indices`` / ``gpt_dataset``: Megatron's doc/sample/shuffle indices, train/valid/test
  splits, ``get_ltor_batch``; ``blended_dataset``: weighted blends.
- ``samplers``: the dp-sharded pretraining sampler resumed from ``consumed_samples``.
- ``helpers``: compiled index builders (``csrc/data/helpers.cpp``) with numpy references.
- ``default_corpus``: the cached standard-library corpus used when no ``--data-path`` is given.

Submodules are imported on use (this package imports nothing), so preprocessing workers stay
light. Data knows dp rank and dp size only as integers.
"""
