"""ZeRO stages 0-3: measured per-rank memory and communication against the ZeRO paper.

For each configuration (dp size N, ZeRO stage, bf16 or fp32) a fresh set of N gloo processes
(one thread each) trains a GPT-2 with ``megazero.training.pretrain`` (mock data, one
micro-batch per step, so stages 2 and 3 reduce once per step), and every rank reports:

* model states: ``optimizer.memory_report()`` (parameters + gradients + fp32 main parameters +
  optimizer states) against the ZeRO paper (Rajbhandari et al., 2020), Psi = this rank's
  parameter count (the tied embedding once), K = 12 (fp32 main copy, Adam m and v):
  bf16: stage 0 (2+2+K) Psi, 1: 4 Psi + K Psi/N, 2: 2 Psi + (2+K) Psi/N, 3: (2+2+K) Psi/N.
  fp32 (no separate main copy; params 4 Psi, grads 4 Psi, Adam states 8 Psi): stage 0 16 Psi,
  1: 8 Psi + 8 Psi/N, 2: 4 Psi + 12 Psi/N, 3: 16 Psi/N.
  For stage 3 the peak of gathered (full, transient) parameters is shown apart.
* communication: bytes this rank sends in one step, from the ``ParallelState``'s
  ``comm.stats`` (reset at the start
  of the measured step, the last one), against 2 Psi (stages 0-2: all-reduce, or
  reduce-scatter + all-gather) and 3 Psi (stage 3: all-gather forward, all-gather backward,
  reduce-scatter) elements in the model dtype, times the ring factor (N-1)/N:
  formula bytes = {2, 3} * Psi * bytes_per_element * (N-1)/N. ``comm`` counts every
  collective with the ring algorithm's bytes; "explained" is what the layout must move
  (buckets padded to N*16 elements, and ZeRO-3's second forward gather of a unit used by two
  modules: the tied embedding, used again by the output layer); "residual" = sent - explained
  (the loss and grad-norm all-reduces, ZeRO-3's order-check messages). The "ring wire" column
  is an independent count of the bytes megazero's ring collectives actually handed to
  ``isend`` in that step (zero where gloo's native collective ran: all-reduce, buffers under
  ``comm.RING_MIN_BYTES``, or when ``comm``'s one-time measurement picked native).
* RSS per rank (``/proc/self/status``; includes torch, gloo, data, activations): after
  imports, peak by the end of setup, peak of the whole run (``VmHWM`` of the fresh process),
  and the peak within the measured step alone (``VmHWM`` reset through
  ``/proc/self/clear_refs`` at its start). For stage 3 also the bytes of gathered full-unit
  buffers that autograd's saved tensors still reference at the end of forward (every unit is
  released by then) next to what the optimizer accounts as gathered.
* step time: median over the steps after the first, slowest rank.

Targets of issue 6: model states within 5% of the formula, communication within 5% of
2 Psi / 3 Psi. Memory and byte counts are exact; step times are noisy on a shared machine.

    python benchmarks/bench_zero.py [--dp 2 4 8] [--stages 0 1 2 3] [--fp32-dp 2] \
        [--layers 8 --hidden 512 --vocab 16384 --seq 64 --iters 3] [--small-model-dp 8] \
        [--no-order-check] [--ring auto|ring|native] [--verbose] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402

# bytes per parameter element: (replicated part, part divided by N) for stages 0-3
FORMULAS = {
    "bf16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
}
COMM_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def _model_argv(args, dp, stage, precision, model):
    layers, hidden = model
    argv = (f"--mock-data --vocab-size {args.vocab} --make-vocab-size-divisible-by 128 "
            f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {args.heads} "
            f"--seq-length {args.seq} --micro-batch-size 1 --global-batch-size {dp} "
            f"--train-iters {args.iters} --log-interval {args.iters} --eval-iters 0 "
            f"--lr 1e-4 --lr-decay-style constant --attention-dropout 0 --hidden-dropout 0 "
            f"--zero-stage {stage}")
    if precision == "bf16":
        argv += " --bf16"
    if args.no_order_check and stage == 3:  # the check exists at ZeRO-3 only
        argv += " --no-zero3-order-check"
    if args.ring is not None:
        argv += f" --ring-collectives {args.ring}"
    return argv.split()


def _held_gathered_bytes(output: torch.Tensor, model) -> tuple[int, int] | None:
    """ZeRO-3, at the end of forward: (bytes of gathered buffers still alive, measured with
    weak references to every buffer the optimizer allocated, bytes the optimizer accounts as
    gathered). Reading autograd's saved tensors instead would unpack them, i.e. gather the
    parameters again. None for stages 0-2."""
    from megazero.tensor_parallel.meta import meta_of

    ref = next((meta_of(p).partitioned_by for p in model.parameters()), None)
    opt = None if ref is None else ref()  # a weak reference to the ZeRO-3 optimizer
    if opt is None:
        return None
    import gc

    gc.collect()
    return opt.held_bytes(), opt.live_bytes


def _rank(argv, verbose):
    """One rank of one training run (``harness.spawn``): what it measured."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if not verbose:  # pretrain's log lines; errors come back through harness.spawn
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    import pretrain_gpt2
    from megazero.arguments import parse_args
    from megazero.data_parallel.layout import param_numel
    from megazero.data_parallel.params import collect_named_params
    from megazero.training import pretrain

    rank, world = dist.get_rank(), dist.get_world_size()
    rss_start = harness.status_kib("VmRSS") * 1024
    # Independent count of the bytes the ring collectives put on the wire.
    wire = [0]
    batch_isend_irecv = dist.batch_isend_irecv

    def counted_batch(ops):
        for op in ops:
            if getattr(op.op, "__name__", "") == "isend":
                wire[0] += op.tensor.numel() * op.tensor.element_size()
        return batch_isend_irecv(ops)

    dist.batch_isend_irecv = counted_batch
    marks, rss = [], {}
    config = parse_args(argv, world_size=world)
    iters = config.train.train_iters

    def forward_step(data_iterator, model):
        # one micro-batch per step: each call starts a step; the last step is measured
        marks.append(time.perf_counter())
        if len(marks) == 1:
            rss["setup_peak"] = harness.status_kib("VmHWM") * 1024
        if len(marks) == iters:  # peak of the measured step alone
            rss["run_peak_before"] = harness.status_kib("VmHWM") * 1024
            rss["before_step"] = harness.status_kib("VmRSS") * 1024
            rss["step_reset"] = harness.reset_peak_rss()
        model.ps.comm.stats.reset()
        wire[0] = 0
        output, loss_func = pretrain_gpt2.forward_step(data_iterator, model)
        if len(marks) < iters:
            return output, loss_func

        def measured_loss_func(output_tensor):  # called right after the forward
            t0 = time.perf_counter()
            rss["held_gathered"] = _held_gathered_bytes(output_tensor, model)
            rss["probe_s"] = time.perf_counter() - t0  # not counted in the step time
            return loss_func(output_tensor)

        return output, measured_loss_func

    history = pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                       pretrain_gpt2.model_provider, forward_step, config,
                       zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)
    marks.append(time.perf_counter())
    hwm = harness.status_kib("VmHWM") * 1024
    comm_stats = history.parallel_state.comm.stats
    stats = comm_stats.snapshot()
    sent, wire_sent = comm_stats.total_sent(), wire[0]
    optimizer, model = history.optimizer, history.model
    psi = sum(param_numel(p) for _, p in collect_named_params(model))
    steps = [b - a for a, b in zip(marks, marks[1:])]
    steps[-1] -= rss.get("probe_s", 0.0)
    result = {"rank": rank, "psi": psi, "memory": optimizer.memory_report(),
              "sent": sent, "stats": stats, "wire_sent": wire_sent,
              "rss_start": rss_start, "rss_setup": rss["setup_peak"],
              "rss_peak": max(hwm, rss["run_peak_before"]),
              "rss_step": hwm if rss["step_reset"] else None,
              "rss_before_step": rss["before_step"],
              "held_gathered": rss.get("held_gathered"),
              "padded_numel": optimizer.layout.numel,
              "step_s": statistics.median(steps[1:] or steps),
              "decisions": history.parallel_state.comm.ring_decisions(),
              "loss": history.history["lm loss"]}
    return result


def run_config(argv, world, timeout, verbose=False):
    """Per-rank results of one training run on ``world`` fresh gloo processes."""
    return harness.spawn(_rank, world, argv, verbose, timeout=timeout)


def summarize(results, dp, stage, precision):
    """One table row: the worst rank of each measurement against its formula."""
    psi = results[0]["psi"]
    assert all(r["psi"] == psi for r in results)
    rep = [r["memory"] for r in results]
    states = max(m["params"] + m["grads"] + m["main_params"] + m["optimizer_states"]
                 for m in rep)
    whole, divided = FORMULAS[precision][stage]
    d, ring = DTYPE_BYTES[precision], (dp - 1) / dp
    # what the collectives must move given the layout: padded buckets, and ZeRO-3's second
    # forward gather of the tied embedding's unit
    explained = max((COMM_FACTOR[stage] * r["padded_numel"]) * d * ring
                    for r in results)
    pick = lambda key: max(r[key] for r in results)  # noqa: E731
    return {"dp": dp, "stage": stage, "precision": precision, "psi": psi,
            "states": states, "mem_formula": (whole + divided / dp) * psi,
            "breakdown": {k: rep[0][k] for k in ("params", "grads", "main_params",
                                                 "optimizer_states")},
            "gathered_peak": max(m.get("gathered_peak", 0) for m in rep),
            "sent": pick("sent"), "comm_formula": COMM_FACTOR[stage] * psi * d * ring,
            "explained": explained, "wire": pick("wire_sent"), "stats": results[0]["stats"],
            "rss_start": pick("rss_start"), "rss_setup": pick("rss_setup"),
            "rss_peak": pick("rss_peak"),
            "rss_step": None if any(r["rss_step"] is None for r in results)
            else pick("rss_step"),
            "rss_before_step": pick("rss_before_step"),
            "held_gathered": None if results[0]["held_gathered"] is None
            else tuple(max(r["held_gathered"][i] for r in results) for i in (0, 1)),
            "step_s": pick("step_s"), "decisions": results[0]["decisions"],
            "loss": results[-1]["loss"]}


def _mb(x):
    return f"{x / 1e6:.1f}"


def _met(ratio):
    return "yes" if abs(ratio - 1) <= 0.05 else "**no**"


def _choice(decisions) -> str:
    if not decisions:
        return "-"
    (d,) = decisions.values()
    return "/".join("ring" if d[k] else "native" for k in ("reduce_scatter", "all_gather"))


def print_tables(rows, models):
    print("\nModel states per rank (MB = 1e6 bytes) vs the ZeRO paper; worst rank")
    lines = []
    for r in rows:
        ratio = r["states"] / r["mem_formula"]
        b = r["breakdown"]
        peak = _mb(r["gathered_peak"]) if r["stage"] == 3 else ""
        lines.append([r["dp"], r["stage"], r["precision"], f"{r['psi'] / 1e6:.2f}M",
                      _mb(b["params"]), _mb(b["grads"]), _mb(b["main_params"]),
                      _mb(b["optimizer_states"]), _mb(r["states"]), _mb(r["mem_formula"]),
                      f"{ratio:.4f}", _met(ratio), peak])
    print(harness.markdown_table(
        ["N", "stage", "dtype", "Psi", "params", "grads", "main", "opt states", "total MB",
         "formula MB", "ratio", "within 5%", "ZeRO-3 gathered peak MB"], lines,
        align="rrlrrrrrrrrlr"))
    print("\nBytes sent per rank in the measured step vs formula = {2,3} Psi x dtype bytes x "
          "(N-1)/N; 'explained' uses the padded parameter count (bucket padding); "
          "residual = sent - explained")
    lines = []
    for r in rows:
        ratio = r["sent"] / r["comm_formula"]
        calls = "/".join(str(r["stats"].get(k, {}).get("calls", 0))
                         for k in ("all_gather", "reduce_scatter", "all_reduce"))
        lines.append([r["dp"], r["stage"], r["precision"], _mb(r["sent"]),
                      _mb(r["comm_formula"]), f"{ratio:.4f}", _met(ratio), _mb(r["explained"]),
                      f"{r['sent'] - r['explained']:.0f}", _mb(r["wire"]),
                      _choice(r["decisions"]), calls])
    print(harness.markdown_table(
        ["N", "stage", "dtype", "sent MB", "formula MB", "ratio", "within 5%", "explained MB",
         "residual B", "ring wire MB", "RS/AG path", "calls AG/RS/AR"], lines,
        align="rrlrrrlrrrll"))
    print("\nRSS per rank (MB, worst rank): after imports, peak by the end of setup, peak of "
          "the whole run, RSS before the measured step and its peak within it; ZeRO-3: "
          "gathered buffers autograd still holds at the end of forward vs the optimizer's "
          "accounting; step time (s, median of the steps after the first, slowest rank)")
    lines = []
    for r in rows:
        step_peak = "n/a" if r["rss_step"] is None else _mb(r["rss_step"])
        held = "" if r["held_gathered"] is None else \
            f"{_mb(r['held_gathered'][0])} / {_mb(r['held_gathered'][1])}"
        lines.append([r["dp"], r["stage"], r["precision"], _mb(r["states"]),
                      _mb(r["rss_start"]), _mb(r["rss_setup"]), _mb(r["rss_peak"]),
                      _mb(r["rss_before_step"]), step_peak, held, f"{r['step_s']:.2f}"])
    print(harness.markdown_table(
        ["N", "stage", "dtype", "model states", "RSS start", "setup peak", "run peak",
         "before step", "step peak", "ZeRO-3 held after fwd / accounted", "step s"], lines,
        align="rrlrrrrrrrr"))
    for (dp, precision), model in sorted(models.items()):
        print(f"model for N={dp} {precision}: {model[0]} layers, hidden {model[1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--fp32-dp", type=int, nargs="*", default=[2],
                        help="dp sizes also run in fp32 (bf16 runs for every --dp)")
    parser.add_argument("--no-bf16", action="store_true", help="only the fp32 runs")
    harness.add_gpt_args(parser, layers=8, hidden=512, heads=8, seq=64, vocab=16384)
    parser.add_argument("--iters", type=int, default=3,
                        help="steps per run; the last is measured, step time is the median "
                             "of all but the first")
    parser.add_argument("--small-model-dp", type=int, default=None,
                        help="use --small-layers/--small-hidden for this dp size and above")
    parser.add_argument("--small-layers", type=int, default=4)
    parser.add_argument("--small-hidden", type=int, default=512)
    parser.add_argument("--no-order-check", action="store_true",
                        help="--no-zero3-order-check: no ZeRO-3 order-check messages")
    parser.add_argument("--ring", choices=["auto", "ring", "native"], default=None,
                        help="--ring-collectives for gloo's reduce-scatter/all-gather "
                             "(default: auto)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--verbose", action="store_true", help="show pretrain's log lines")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the rows, the arguments and the host here")
    args = parser.parse_args()
    if args.iters < 2:
        parser.error("--iters must be at least 2 (the first step is warm-up)")
    t_start = time.perf_counter()
    configs = []
    if not args.no_bf16:
        configs += [(dp, s, "bf16") for dp in args.dp for s in args.stages]
    configs += [(dp, s, "fp32") for dp in args.fp32_dp for s in args.stages]
    rows, models = [], {}
    print(f"GPT-2 vocab {args.vocab}, seq {args.seq}, heads {args.heads}, micro-batch 1, "
          f"{args.iters} steps per run; torch {torch.__version__}, gloo, 1 thread per rank, "
          f"ring {args.ring or 'auto'}")
    for dp, stage, precision in configs:
        small = args.small_model_dp is not None and dp >= args.small_model_dp
        model = (args.small_layers, args.small_hidden) if small else (args.layers, args.hidden)
        models[(dp, precision)] = model
        t0 = time.perf_counter()
        results = run_config(_model_argv(args, dp, stage, precision, model), dp, args.timeout,
                             args.verbose)
        row = summarize(results, dp, stage, precision)
        rows.append(row)
        print(f"N={dp} stage {stage} {precision}: {time.perf_counter() - t0:.0f} s, "
              f"states {row['states'] / row['mem_formula']:.4f} x formula, sent "
              f"{row['sent'] / row['comm_formula']:.4f} x formula, RS/AG path "
              f"{_choice(row['decisions'])}, lm loss {[round(x, 4) for x in row['loss']]}",
              flush=True)
    print_tables(rows, models)
    print(f"total time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        harness.write_json(args.json, {
            "benchmark": "bench_zero", "args": vars(args), "rows": rows,
            "models": [{"dp": dp, "precision": p, "layers": m[0], "hidden": m[1]}
                       for (dp, p), m in sorted(models.items())]})


if __name__ == "__main__":
    main()
