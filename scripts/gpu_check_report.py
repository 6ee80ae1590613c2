"""Rows of scripts/gpu_check.sh's summary table, from the logs of ``pretrain_gpt2.py``.

Pure Python (no torch), so the arithmetic is unit-tested on CPU (tests/test_gpu_check.py).
Each command prints one row, ``STATUS<TAB>detail`` (STATUS: PASS or FAIL; SKIP for bench),
and exits 0; a log that cannot be read gives a FAIL row, not a traceback.

  throughput LOG --num-layers L --hidden-size H --seq-length S [--vocab-size V] [--gpus N]
             [--device-name NAME] [--warmup-lines K] [--expect-iters N] [--require-loss-drop]
      tokens/s, achieved TFLOP/s and MFU from the Megatron log lines
      `` iteration N/ M | ... | elapsed time per iteration (ms): X | global batch size: B |
      lm loss: Y | ...``. The first K lines (default 1 when there are more) are warm-up and left
      out. Model FLOPs per iteration are Megatron's, activation recompute off (Narayanan et
      al., 2021): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)); V is the padded vocabulary the run
      printed (``padded to V`` / ``new size: V``) unless --vocab-size is given. MFU = FLOP/s /
      (N x peak dense bf16 FLOP/s): PEAK_TFLOPS (env) when set, else 989 for H100/H200, 312
      for A100, else n/a.
  parity BASE_LOG LOG [--rtol 1e-4]
      the ``lm loss`` of every iteration of LOG against BASE_LOG, within rtol (relative).
  bench JSON
      the row of benchmarks/bench_gpu_step.py's JSON: megazero's (eager) tokens/s and MFU at
      each size, and the fastest other contender at each. FAIL when a megazero or plain-gpt2
      job failed or megazero measured nothing while another contender did; SKIP (this row
      only) when nothing was measured (no CUDA device, budget spent).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

# Dense bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

_ITER = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_FIELDS = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\):\s*([-+0-9.eE]+)"),
    "global_batch": re.compile(r"global batch size:\s*(\d+)"),
    "lm_loss": re.compile(r"lm loss:\s*([-+0-9.eEnaNinf]+)\s*\|"),
    "tokens_per_s": re.compile(r"tokens per second:\s*([-+0-9.eE]+)"),
    "tflops_per_rank": re.compile(r"TFLOP/s per rank:\s*([-+0-9.eE]+)"),
}
_VOCAB = re.compile(r"padded to (\d+)|new size: (\d+)")


def parse_log(text: str) -> list[dict]:
    """The Megatron training log lines of ``text``, in order, as dicts of their numbers."""
    rows = []
    for line in text.splitlines():
        match = _ITER.search(line)
        if not match or "lm loss:" not in line:
            continue
        row = {"iteration": int(match.group(1)), "train_iters": int(match.group(2))}
        for key, pattern in _FIELDS.items():
            found = pattern.search(line)
            if found:
                value = float(found.group(1))
                row[key] = int(value) if key == "global_batch" else value
        rows.append(row)
    return rows


def padded_vocab_size(text: str) -> int | None:
    """The padded vocabulary size the run printed, or None."""
    for match in _VOCAB.finditer(text):
        return int(match.group(1) or match.group(2))
    return None


def lm_losses(text: str) -> dict[int, float]:
    """``lm loss`` by iteration (a line printed by several ranks counts once)."""
    return {r["iteration"]: r["lm_loss"] for r in parse_log(text) if "lm_loss" in r}


def flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs of one iteration (forward + backward, no recompute)."""
    return (72 * batch * seq * layers * hidden**2
            * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden)))


def peak_flops(device_name: str | None, env=None) -> float | None:
    """Peak dense bf16 FLOP/s of one GPU: $PEAK_TFLOPS x 1e12 when set, else by name, else
    None."""
    env = os.environ if env is None else env
    if env.get("PEAK_TFLOPS"):
        return float(env["PEAK_TFLOPS"]) * 1e12
    for key, value in PEAK_BF16_FLOPS.items():
        if key in (device_name or "").upper():
            return value
    return None


def throughput(text: str, *, layers: int, hidden: int, seq: int, vocab: int | None = None,
               gpus: int = 1, device_name: str | None = None, warmup_lines: int | None = None,
               env=None) -> dict:
    """Steady-state numbers of a training log: mean ms/iteration over the lines after the
    warm-up ones, tokens/s, model FLOP/s, MFU (None without a known peak), first/last loss."""
    rows = [r for r in parse_log(text) if "elapsed_ms" in r and "global_batch" in r]
    if not rows:
        raise ValueError("no ' iteration ... | elapsed time per iteration (ms) ... | lm loss' "
                         "line in the log")
    vocab = vocab or padded_vocab_size(text)
    if not vocab:
        raise ValueError("padded vocabulary size not found in the log; pass --vocab-size")
    if warmup_lines is None:
        warmup_lines = 1 if len(rows) > 1 else 0
    kept = rows[min(warmup_lines, len(rows) - 1):]
    elapsed_s = sum(r["elapsed_ms"] for r in kept) / len(kept) / 1000.0
    batch = kept[-1]["global_batch"]
    flops = flops_per_iteration(batch, seq, layers, hidden, vocab)
    peak = peak_flops(device_name, env)
    achieved = flops / elapsed_s
    return {
        "iterations": rows[-1]["iteration"], "train_iters": rows[-1]["train_iters"],
        "lines_used": len(kept), "elapsed_ms": elapsed_s * 1000.0, "global_batch": batch,
        "vocab": vocab, "flops_per_iteration": flops,
        "tokens_per_s": batch * seq / elapsed_s, "tflops": achieved / 1e12,
        "peak_tflops": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else achieved / (gpus * peak),
        "first_loss": rows[0].get("lm_loss", math.nan),
        "last_loss": rows[-1].get("lm_loss", math.nan),
        "losses": [r.get("lm_loss", math.nan) for r in rows],
    }


def throughput_row(text: str, *, expect_iters: int | None = None,
                   require_loss_drop: bool = False, **kwargs) -> tuple[str, str]:
    """(PASS|FAIL, detail) of a training log."""
    try:
        t = throughput(text, **kwargs)
    except ValueError as exc:
        return "FAIL", str(exc)
    mfu = "MFU n/a (set PEAK_TFLOPS)" if t["mfu"] is None else \
        f"MFU {100 * t['mfu']:.3g}% of {t['peak_tflops']:.0f} TF"
    detail = (f"{t['tokens_per_s']:,.0f} tok/s, {t['elapsed_ms']:.1f} ms/it, "
              f"{t['tflops']:.3g} TFLOP/s, {mfu}, "
              f"loss {t['first_loss']:.3f}->{t['last_loss']:.3f}")
    problems = []
    if expect_iters is not None and t["iterations"] != expect_iters:
        problems.append(f"last logged iteration {t['iterations']}, expected {expect_iters}")
    if not all(math.isfinite(x) for x in t["losses"]):
        problems.append("non-finite lm loss")
    elif require_loss_drop and not t["last_loss"] < t["first_loss"]:
        problems.append("lm loss did not fall")
    return ("FAIL", "; ".join(problems) + "; " + detail) if problems else ("PASS", detail)


def parity_row(base_text: str, text: str, rtol: float = 1e-4) -> tuple[str, str]:
    """(PASS|FAIL, detail): every iteration's lm loss of ``text`` within rtol of the base."""
    base, got = lm_losses(base_text), lm_losses(text)
    if not base:
        return "FAIL", "no lm loss lines in the 1-GPU log"
    if sorted(got) != sorted(base):
        return "FAIL", f"iterations {sorted(got)[:3]}... logged, 1-GPU run has {len(base)}"
    rel = {it: abs(got[it] - loss) / max(abs(loss), 1e-30) for it, loss in base.items()}
    rel = {it: r if math.isfinite(r) else math.inf for it, r in rel.items()}
    worst_it = max(rel, key=rel.get)
    worst = rel[worst_it]
    detail = (f"{len(base)} iterations, max rel diff {worst:.2e} at iteration {worst_it} "
              f"(rtol {rtol:.0e})")
    return ("PASS" if worst <= rtol else "FAIL"), detail


def _size(model: str) -> str:
    return model.split("-", 1)[-1]  # gpt2-345m -> 345m


def bench_row(doc: dict) -> tuple[str, str]:
    """(PASS|FAIL|SKIP, detail) of bench_gpu_step.py's results."""
    rows = doc.get("results") or []
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        why = sorted({r.get("status", "?") for r in rows})
        return "SKIP", "nothing measured: " + ("; ".join(why)[:200] or "no rows")
    parts = []
    for r in rows:
        if r["contender"] == "megazero" and r["variant"] == "eager":
            size = _size(r["model"])
            if r["status"] != "ok":
                parts.append(f"megazero {size}: {r['status'][:60]}")
                continue
            mfu = "MFU n/a" if r["mfu"] is None else f"MFU {100 * r['mfu']:.3g}%"
            parts.append(f"megazero {size} (mb {r['micro_batch_size']}): "
                         f"{r['tokens_per_s']:,.0f} tok/s, {mfu}")
    for model in dict.fromkeys(r["model"] for r in ok):
        peers = [r for r in ok if r["model"] == model and r["contender"] != "megazero"]
        if peers:
            best = max(peers, key=lambda r: r["tokens_per_s"])
            parts.append(f"best peer {_size(model)}: {best['contender']}:{best['variant']} "
                         f"{best['tokens_per_s']:,.0f} tok/s")
    failed = [f"{r['contender']}:{r['variant']} {_size(r['model'])}" for r in rows
              if r.get("status", "").startswith("failed")
              and r["contender"] in ("megazero", "plain-gpt2")]
    mz_ok = any(r["contender"] == "megazero" for r in ok)
    detail = "; ".join(parts)
    if failed or not mz_ok:
        problems = (["failed: " + ", ".join(failed)] if failed else []) \
            + ([] if mz_ok else ["megazero measured nothing"])
        return "FAIL", "; ".join(problems) + "; " + detail
    return "PASS", detail


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tp = sub.add_parser("throughput")
    tp.add_argument("log")
    tp.add_argument("--num-layers", type=int, required=True)
    tp.add_argument("--hidden-size", type=int, required=True)
    tp.add_argument("--seq-length", type=int, required=True)
    tp.add_argument("--vocab-size", type=int)
    tp.add_argument("--gpus", type=int, default=1)
    tp.add_argument("--device-name")
    tp.add_argument("--warmup-lines", type=int)
    tp.add_argument("--expect-iters", type=int)
    tp.add_argument("--require-loss-drop", action="store_true")
    pp = sub.add_parser("parity")
    pp.add_argument("base_log")
    pp.add_argument("log")
    pp.add_argument("--rtol", type=float, default=1e-4)
    bp = sub.add_parser("bench")
    bp.add_argument("json")
    args = parser.parse_args(argv)
    try:
        if args.command == "throughput":
            status, detail = throughput_row(
                _read(args.log), layers=args.num_layers, hidden=args.hidden_size,
                seq=args.seq_length, vocab=args.vocab_size, gpus=args.gpus,
                device_name=args.device_name, warmup_lines=args.warmup_lines,
                expect_iters=args.expect_iters, require_loss_drop=args.require_loss_drop)
        elif args.command == "bench":
            status, detail = bench_row(json.loads(_read(args.json)))
        else:
            status, detail = parity_row(_read(args.base_log), _read(args.log), args.rtol)
    except OSError as exc:
        status, detail = "FAIL", f"cannot read log: {exc}"
    except (ValueError, KeyError, TypeError) as exc:  # a malformed JSON
        status, detail = "FAIL", f"cannot read {getattr(args, 'json', 'log')}: {exc!r}"
    print(f"{status}\t{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
