"""GPT-3 175B, one rank at a time: the dry run's measured model-state bytes against the ZeRO and
Megatron formulas, its peak and activations, and how long the dry run takes here.

Each row dry-runs one rank (``pretrain_gpt2.py ... --dry-run-rank R --dry-run-world-size N
--dry-run-device cuda --no-dry-run-check-peers``, one iteration and a save, in a fresh
process) of GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocabulary 50257 padded
to 51200, micro-batch 1, global batch 1536, bf16) at Megatron's published layout tp 8, pp 8
(dp 16 at 1024 GPUs) for ZeRO stages 1-3, and at tp 8, pp 16, dp 32 (4096 GPUs). Rank 0 is
the first pipeline stage (word and position embeddings), the last rank the last stage (final
LayerNorm and the tied output embedding's copy).

The formula column is the ZeRO paper's mixed-precision Adam accounting (Rajbhandari et al.
2020, section 3.1) applied to the rank's parameter count P (the dry run's, which is Megatron's
per-stage count: 12h^2/tp + 13h-ish per layer, plus the embedding shard): bf16 parameters
2P, bf16 gradients 2P, fp32 main parameters and two Adam moments 12P, of which stage 1 shards
the 12P over dp, stage 2 also the gradients, stage 3 everything: 2P + 2P + 12P/dp, 2P +
14P/dp, 16P/dp. The measured bytes differ from it only by the padding that makes each flat
bucket divisible by dp. The baseline (no ZeRO, Megatron without the distributed optimizer)
is 16P.

    python benchmarks/bench_dryrun.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megazero.dryrun import fake_cuda  # noqa: E402

GPT3 = ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 --bf16 "
        "--mock-data --vocab-size 50257 --train-iters 10 --sequence-parallel "
        "--recompute-granularity full")
GIB = 2**30


def dry_run(flags: str, rank: int, world: int) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "pretrain_gpt2.py", *GPT3.split(), *flags.split(),
               "--dry-run-rank", str(rank), "--dry-run-world-size", str(world),
               "--dry-run-device", "cuda", "--no-dry-run-check-peers",
               "--dry-run-report", path]
        start = time.time()
        done = subprocess.run(cmd, cwd=ROOT, env=fake_cuda.preload_env(),
                              capture_output=True, text=True)
        seconds = time.time() - start
        if done.returncode != 0:
            raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
        with open(path) as f:
            return json.load(f), seconds


def formula(p: int, dp: int, stage: int) -> int:
    """ZeRO's bytes of model states per rank for P parameters (bf16 + fp32 Adam)."""
    if stage == 1:
        return 2 * p + 2 * p + 12 * p // dp
    if stage == 2:
        return 2 * p + 14 * p // dp
    return 16 * p // dp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tp8 pp8 ZeRO-1 only")
    args = parser.parse_args()
    runs = [("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8", 1024, s)
            for s in ((1,) if args.quick else (1, 2, 3))]
    if not args.quick:
        runs.append(("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16",
                     4096, 1))
    print(f"{'layout':<22}{'zero':>5}{'rank':>6}{'params/rank':>15}{'measured GiB':>14}"
          f"{'formula GiB':>13}{'ratio':>7}{'no-ZeRO GiB':>13}{'act GiB':>9}{'peak GiB':>10}"
          f"{'dry run s':>11}")
    for flags, world, stage in runs:
        tp, pp = (int(x) for x in flags.split()[1::2])
        dp = world // (tp * pp)
        for rank in (0, world - 1):
            report, seconds = dry_run(f"{flags} --zero-stage {stage}", rank, world)
            p = report["param_count"]
            measured = (report["param_bytes"] + report["grad_bytes"]
                        + report["main_param_bytes"] + report["optimizer_state_bytes"])
            f = formula(p, dp, stage)
            print(f"{f'tp{tp} pp{pp} dp{dp}':<22}{stage:>5}{rank:>6}{p:>15,}"
                  f"{measured / GIB:>14.3f}{f / GIB:>13.3f}{measured / f:>7.4f}"
                  f"{16 * p / GIB:>13.3f}{report['activation_bytes'] / GIB:>9.3f}"
                  f"{report['peak_bytes'] / GIB:>10.3f}{seconds:>11.1f}")


if __name__ == "__main__":
    main()
