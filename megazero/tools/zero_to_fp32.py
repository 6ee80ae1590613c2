"""Consolidate a (ZeRO-sharded, tensor/pipeline-parallel) checkpoint into one fp32 state dict.

    python -m megazero.tools.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--iteration N]

Like DeepSpeed's ``zero_to_fp32.py``: reads every dp shard's fp32 main fragments (or, when the
checkpoint was saved without optimizer state, the model values), reassembles each parameter
across dp, tp and pp, removes padding, and writes ``{name: full fp32 tensor}`` with
``torch.save`` (atomically). Runs in one process without torch.distributed.
"""

from __future__ import annotations

import argparse
import sys

from megazero.checkpoint.paths import CheckpointError, atomic_save
from megazero.tools.consolidate import consolidate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="the --save folder (with the tracker file)")
    parser.add_argument("output", help="file to write (torch.save of a state dict)")
    parser.add_argument("--iteration", default=None,
                        help="iteration to read (default: latest_checkpointed_iteration.txt)")
    args = parser.parse_args(argv)
    iteration = args.iteration
    if iteration is not None and iteration != "release":
        if not (iteration.isascii() and iteration.isdigit()):
            parser.error(f"--iteration must be an integer >= 0 or 'release', got {iteration!r}")
        iteration = int(iteration)
    try:
        state = consolidate(args.checkpoint, iteration)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    atomic_save(state, args.output)
    total = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors, {total:,} parameters (fp32) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
