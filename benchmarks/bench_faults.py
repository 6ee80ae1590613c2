"""Effective training time under injected failures, against the Young/Daly checkpoint interval.

A dp2 GPT-2 job runs under torchrun with ``--max-restarts`` (as
``scripts/pretrain_gpt2_distributed.sh``), ``--load`` = ``--save``, for ``--iters``
iterations. A killer kills a random worker with SIGKILL at exponentially distributed times
(mean ``--mtbf`` seconds, seeded); torchrun restarts the group, which resumes from the last
checkpoint. For each ``--save-interval`` the table gives the wall time, the failures, the
iterations redone, and the efficiency: the fault-free time without checkpoints over the wall
time (useful work over wall time).

Calibration (fault-free runs, same machine, same run): ``t`` seconds per iteration without
saves, ``delta`` seconds per checkpoint (from a run saving every iteration), ``R`` seconds to
restart (from kill to the first iteration after the resume, averaged over the faulty runs).
The model column is Daly's first-order expected efficiency for an interval of ``tau = k t``
seconds: ``1 / (1 + delta/tau + (tau/2 + delta + R)/M)`` (waste of writing checkpoints, plus
per failure half an interval redone, the save in flight and the restart), and Young/Daly's
optimum interval is ``sqrt(2 delta M)``.

    python benchmarks/bench_faults.py [--mtbf 12] [--iters 600] [--intervals 5 10 20 40 80]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--mock-data --vocab-size 512 --num-layers 4 --hidden-size 128 --num-attention-heads 4 "
         "--seq-length 128 --micro-batch-size 4 --global-batch-size 8 --log-interval 1 "
         "--eval-iters 0 --lr 1e-3 --attention-dropout 0 --hidden-dropout 0 "
         "--distributed-timeout-minutes 0.5")
ITER = re.compile(r" iteration\s+(\d+)/")
LOADED = re.compile(r"loaded checkpoint from .* at iteration (\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def run(iters: int, save_interval: int | None, mtbf: float | None, seed: int) -> dict:
    """One job; returns wall time, failures, redone iterations, restart delays."""
    folder = tempfile.mkdtemp(prefix="megazero-faults-")
    save = ["--save", folder, "--load", folder, "--save-interval", str(save_interval)] \
        if save_interval else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "100", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "pretrain_gpt2.py", *MODEL.split(), "--train-iters", str(iters),
           *save]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: events.extend(
        (time.time(), line) for line in proc.stdout), daemon=True)
    reader.start()
    kills: list[float] = []
    rng = random.Random(seed)
    if mtbf:
        next_kill = start + rng.expovariate(1.0 / mtbf)
        while proc.poll() is None:
            time.sleep(0.05)
            if time.time() >= next_kill:
                victims = workers_of(proc.pid)
                if victims:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                    kills.append(time.time())
                next_kill = time.time() + rng.expovariate(1.0 / mtbf)
    proc.wait()
    wall = time.time() - start
    reader.join(timeout=10)
    shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError("".join(line for _, line in events)[-4000:])
    last, printed, redone, delays, k, resumed = 0, 0, 0, [], 0, False
    for t, line in events:
        if (m := ITER.search(line)) and " lm loss: " in line:
            printed += 1
            last = int(m.group(1))
            if resumed:  # the first iteration after a restart: kill -> work again
                delays.append(t - kills[k])
                k, resumed = k + 1, False
        elif (m := LOADED.search(line)) and k < len(kills) and t > kills[k]:
            redone += max(0, last - int(m.group(1)))
            while k + 1 < len(kills) and kills[k + 1] < t:  # kills during the same restart
                k += 1
            resumed = True
    per_iter = sorted(float(m.group(1)) for _, line in events
                      if (m := re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line)))
    return {"wall": wall, "failures": len(kills), "redone": redone, "delays": delays,
            "printed": printed,
            "iter_s": per_iter[len(per_iter) // 2] / 1000 if per_iter else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtbf", type=float, default=12.0, help="mean seconds between kills")
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--intervals", type=int, nargs="+", default=[5, 10, 20, 40, 80])
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    clean = run(args.iters, None, None, args.seed)
    every = run(args.iters, 1, None, args.seed)
    t = clean["iter_s"] or clean["wall"] / args.iters
    delta = max(0.0, (every["wall"] - clean["wall"]) / args.iters)
    print(f"fault-free: {clean['wall']:.1f} s for {args.iters} iterations (t = {t * 1000:.0f} "
          f"ms per iteration, median of the log lines; the rest is startup); saving every "
          f"iteration: {every['wall']:.1f} s (delta = {delta * 1000:.0f} ms per checkpoint)")
    rows, all_delays = [], []
    for k in args.intervals:
        r = run(args.iters, k, args.mtbf, args.seed + k)
        all_delays += r["delays"]
        rows.append((k, r))
    restart = sum(all_delays) / len(all_delays) if all_delays else 0.0
    tau_opt = math.sqrt(2 * delta * args.mtbf)
    print(f"MTBF {args.mtbf:.0f} s; restart R = {restart:.1f} s (kill to first iteration "
          f"after the resume, mean of {len(all_delays)}); Young/Daly optimum interval "
          f"sqrt(2 delta M) = {tau_opt:.2f} s = {tau_opt / t:.1f} iterations")
    print(f"{'save every':>10} {'wall s':>8} {'failures':>9} {'redone':>7} "
          f"{'efficiency':>11} {'model':>7}")
    for k, r in rows:
        tau = k * t
        model = 1.0 / (1.0 + delta / tau + (tau / 2 + delta + restart) / args.mtbf)
        print(f"{k:>10} {r['wall']:>8.1f} {r['failures']:>9} {r['redone']:>7} "
              f"{clean['wall'] / r['wall']:>11.3f} {model:>7.3f}")


if __name__ == "__main__":
    main()
