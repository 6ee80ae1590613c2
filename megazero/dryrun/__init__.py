"""The dry run: one rank of a job this machine cannot run, executed here on fake tensors.

``python pretrain_gpt2.py <the job's flags> --dry-run-rank R --dry-run-world-size N
[--dry-run-device cuda] [--dry-run-iters K] [--dry-run-report report.json]`` builds rank R's
model, optimizer and schedule exactly as the job would, runs K training iterations and a
checkpoint save on fake ``cuda`` tensors over torch's fake process group, and prints what
the rank would hold (memory by category, measured from its allocations) and do (every
collective per group, the pipeline's p2p pattern), with the checks of ``run``. Nothing of the
model is materialised: a GPT-3 175B rank runs in seconds on a laptop.

``run`` executes, ``memory`` measures, ``report`` formats, ``fake_cuda`` makes CUDA tensors
usable by autograd on a CPU-only torch.
"""

from __future__ import annotations

import logging

from megazero.dryrun import fake_cuda
from megazero.dryrun.run import DryRunOptions, dry_run

__all__ = ["DryRunOptions", "dry_run", "main"]


def main(config, options: dict, *, datasets_provider, model_provider, forward_step_func,
         zero3_unit_policy=None):
    """The entry points' dry run: returns the report (``report.table()`` to print,
    ``report.ok``), written as JSON when asked. A cuda dry run on a CPU-only torch
    re-executes the process with the fake CUDA runtime preloaded first."""
    opts = DryRunOptions(**options)
    if opts.device == "cuda" and not fake_cuda.active():
        fake_cuda.reexec_with_fake_cuda()
    logging.getLogger("megazero").setLevel(logging.WARNING)
    report = dry_run(config, opts, datasets_provider=datasets_provider,
                     model_provider=model_provider, forward_step_func=forward_step_func,
                     zero3_unit_policy=zero3_unit_policy)
    return report
