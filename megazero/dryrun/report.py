"""The dry run's report: what one rank would hold and do, as a table and as JSON.

JSON keys (bytes are per rank, on the job's device unless prefixed ``host_``):
``rank``, ``world_size``, ``device``, ``layout`` (tp, pp, dp, virtual, coordinates),
``param_count``, ``param_bytes``, ``grad_bytes``, ``main_param_bytes``,
``optimizer_state_bytes``, ``activation_bytes`` (the most bytes the forward passes in flight
hold at once), ``temporary_bytes`` (other training allocations alive at the peak),
``peak_bytes`` (the training iterations' peak of live tensor bytes; ``peak_breakdown``),
``checkpoint_bytes`` (what one save writes from this rank), ``kernel_launches`` and
``host_syncs`` (per training iteration: the last one that did not log; ``launches.py`` says
what counts), ``device_ops`` (the same per iteration, split by phase, module and op, every
sync with its source line), ``collectives`` (a list of
{group, ranks, op, calls, bytes, dtype}: bytes this rank sends), ``p2p`` (the schedule's
point-to-point pattern: {op, peer, shape, dtype, calls, bytes}), ``checks`` and ``notes``;
with ``--compile``, ``compile`` ({requested, layers: "eager", note}: fake tensors are not
compiled, so the counts are the eager layers').

``compare_sequences`` and ``compare_p2p`` match two ranks' recorded collectives.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from megazero.distributed.parallel_state import coords_of
from megazero.model.compile import DRY_RUN_NOTE


def _shared_groups(a, b, kind: str) -> list[str]:
    """Names of the groups ranks ``a`` and ``b`` (RankRuns) both belong to."""
    names = {"tp": "tp_ranks", "dp": "dp_ranks", "pp": "pp_ranks", "mp": "mp_ranks",
             "embedding": "embedding_ranks"}
    shared = [kind, "world"]
    for name in ("mp", "embedding"):
        if name != kind and getattr(a.ps, names[name]) == getattr(b.ps, names[name]) \
                and getattr(a.ps, names[name]):
            shared.append(name)
    return shared


def _sequence(run, group: str) -> list[tuple]:
    """(op, shape, dtype) of each collective on ``group``; host-side object gathers carry
    payloads whose sizes depend on values (agreed at run time), so only their op counts."""
    return [(r.op, () if r.host else r.shape, r.dtype) for r in run.records
            if r.group == group and r.peer is None]


def compare_sequences(a, b, kind: str) -> dict:
    """First divergence between the collectives ranks ``a`` and ``b`` issue on the groups
    they share; ``{"ok": True, ...}`` when every sequence matches."""
    result = {"peer": b.rank, "groups": {}, "ok": True}
    for group in _shared_groups(a, b, kind):
        mine, theirs = _sequence(a, group), _sequence(b, group)
        entry = {"collectives": len(mine), "ok": mine == theirs}
        if mine != theirs:
            i = next((k for k, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                     min(len(mine), len(theirs)))
            entry["first_divergence"] = {
                "index": i,
                f"rank {a.rank}": _describe(mine[i]) if i < len(mine) else "nothing more",
                f"rank {b.rank}": _describe(theirs[i]) if i < len(theirs) else "nothing more"}
            result["ok"] = False
        result["groups"][group] = entry
    return result


def _describe(entry) -> str:
    op, shape, dtype = entry
    return f"{op} {list(shape)} {dtype}"


def compare_p2p(a, b) -> dict:
    """Whether what ``a`` sends ``b`` is what ``b`` receives from ``a`` (and back), message
    by message (shape and dtype)."""
    def msgs(run, op, peer):
        return [(r.shape, r.dtype) for r in run.records if r.op == op and r.peer == peer]

    out = {}
    for src, dst in ((a, b), (b, a)):
        sent, received = msgs(src, "send", dst.rank), msgs(dst, "recv", src.rank)
        out[f"{src.rank}->{dst.rank}"] = {"messages": len(sent), "ok": sent == received}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def _aggregate_collectives(run) -> list[dict]:
    rows: OrderedDict = OrderedDict()
    ranks = {"tp": run.ps.tp_ranks, "dp": run.ps.dp_ranks, "pp": run.ps.pp_ranks,
             "mp": run.ps.mp_ranks, "embedding": run.ps.embedding_ranks}
    for r in run.records:
        if r.peer is not None:
            continue
        key = (r.group, r.op, r.dtype, r.host)
        row = rows.setdefault(key, {"group": r.group, "ranks": _span(ranks.get(r.group)),
                                    "op": r.op, "calls": 0, "bytes": 0, "dtype": r.dtype,
                                    "device": r.device, "route": "host" if r.host
                                    else "device"})
        row["calls"] += 1
        row["bytes"] += r.bytes
    return list(rows.values())


def _span(ranks) -> str:
    if not ranks:
        return "all"
    if len(ranks) > 4:
        step = ranks[1] - ranks[0]
        uniform = all(b - a == step for a, b in zip(ranks, ranks[1:]))
        return f"{ranks[0]},{ranks[1]},..,{ranks[-1]} ({len(ranks)} ranks" \
            + (f", stride {step})" if uniform else ")")
    return ",".join(str(r) for r in ranks)


def _aggregate_p2p(run) -> list[dict]:
    rows: OrderedDict = OrderedDict()
    for r in run.records:
        if r.peer is None:
            continue
        key = (r.op, r.peer, r.shape, r.dtype)
        row = rows.setdefault(key, {"op": r.op, "peer": r.peer, "shape": list(r.shape),
                                    "dtype": r.dtype, "calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += r.bytes
    return list(rows.values())


class Report(dict):
    """The report as a dict (JSON-ready) with a printable table."""

    @property
    def ok(self) -> bool:
        """Every peer issued the same collectives and p2p messages."""
        return all(r["ok"] for r in self["checks"]["peers"].values())

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=2)
        os.replace(tmp, path)

    def _device_ops_lines(self) -> list[str]:
        """Launches and host syncs per iteration, the steady one's breakdown and syncs."""
        ops = self["device_ops"]
        lines = ["", "device work per training iteration (kernel launches, host syncs)"]
        for it in ops:
            lines.append(f"  iteration {it['iteration']}{' (logs)' if it['logged'] else '':7}"
                         f"{it['kernel_launches']:>9,} launches {it['host_syncs']:>5} syncs  "
                         + ", ".join(f"{k} {v:,}" for k, v in it["launches_by_phase"].items()))
        steady = next((it for it in ops if it["iteration"] == self["counted_iteration"]), None)
        if steady is None:
            return lines
        lines.append("  most launches (iteration "
                     f"{steady['iteration']}): " + ", ".join(
                         f"{k} {v:,}" for k, v in list(steady["launches_by_module"].items())[:8]))
        for it in ops:
            for s in it["syncs"]:
                lines.append(f"  sync (iteration {it['iteration']}, {s['phase']}): "
                             f"{s['kind']} x{s['count']} at {s['where']}")
        return lines

    def table(self) -> str:
        gib = lambda b: f"{b / 2**30:10.3f} GiB"  # noqa: E731
        lay = self["layout"]
        lines = [f"dry run of rank {self['rank']} of {self['world_size']} on "
                 f"{self['device']}: tp {lay['tp_rank']}/{lay['tp']}, dp {lay['dp_rank']}/"
                 f"{lay['dp']}, pp {lay['pp_rank']}/{lay['pp']}"
                 + (f", {lay['virtual']} virtual stages" if lay["virtual"] else "")
                 + f"; {self['param_count']:,} parameters on this rank; "
                   f"{self['iterations']} iterations in {self['seconds']:.1f} s",
                 "", "memory (measured from the rank's allocations)"]
        for key, label in (("param_bytes", "parameters"), ("grad_bytes", "gradients"),
                           ("main_param_bytes", "main parameters (fp32)"),
                           ("optimizer_state_bytes", "optimizer states"),
                           ("activation_bytes", "activations (most in flight)"),
                           ("temporary_bytes", "temporaries at the peak"),
                           ("peak_bytes", "peak (training iterations)")):
            lines.append(f"  {label:<28}{gib(self[key])}")
        for key in sorted(k for k in self if k.startswith("host_") and k != "host_syncs"):
            lines.append(f"  {key.replace('_', ' '):<28}{gib(self[key])}")
        lines.append(f"  {'checkpoint (one save)':<28}{gib(self['checkpoint_bytes'])}")
        lines += self._device_ops_lines()
        lines += ["", f"collectives of the {self['iterations']} iterations and the save (bytes "
                      "this rank sends; host: object gathers on the CPU route)",
                  f"  {'group':<10}{'op':<16}{'dtype':<10}{'device':<8}{'calls':>7}"
                  f"{'bytes':>16}  ranks"]
        for c in self["collectives"]:
            where = "host" if c["route"] == "host" else c["device"]
            lines.append(f"  {c['group']:<10}{c['op']:<16}{c['dtype']:<10}{where:<8}"
                         f"{c['calls']:>7}{c['bytes']:>16,}  {c['ranks']}")
        lines += ["", "pipeline p2p"]
        if not self["p2p"]:
            lines.append("  none (one pipeline stage)")
        for p in self["p2p"]:
            lines.append(f"  {p['op']:<5} {'to' if p['op'] == 'send' else 'from'} rank "
                         f"{p['peer']:<6} {str(p['shape']):<20} {p['dtype']:<10}"
                         f"{p['calls']:>5} x  {p['bytes']:,} bytes")
        lines += ["", "checks"]
        lines.append(f"  device: {self['checks']['device']}")
        for kind, res in self["checks"]["peers"].items():
            verdict = "same collectives" if res["ok"] else "DIVERGE"
            lines.append(f"  {kind} peer rank {res['peer']}: {verdict} on "
                         + ", ".join(f"{g} ({e['collectives']})"
                                     for g, e in res["groups"].items()))
            for g, e in res["groups"].items():
                if not e["ok"]:
                    lines.append(f"    first divergence on {g}: {e['first_divergence']}")
            if "p2p" in res:
                lines.append("    p2p " + ", ".join(
                    f"{k}: {v['messages']} messages {'match' if v['ok'] else 'DO NOT match'}"
                    for k, v in res["p2p"].items() if k != "ok"))
        lines += [""] + [f"note: {n}" for n in self["notes"]]
        return "\n".join(lines)


_CUDA_KERNELS_NOTE = (
    "CUDA kernels assumed built: on fake CUDA the fused chains (bias-GELU, bias-dropout-add, "
    "bias-SwiGLU, RoPE, causal softmax, vocab-parallel cross entropy) are counted as "
    "megazero's CUDA custom ops (megazero::*), one launch per call, as on a GPU host where "
    "`pip install -e .` built megazero.ops._fused_cuda (check with `python -m megazero.ops`); "
    "without that extension a real GPU run takes the eager PyTorch formulas and launches more. "
    "RMSNorm is counted as ATen's fused kernel, which needs no extension. A backward that "
    "computes a bias gradient adds one launch (megazero::column_sum); "
    "megazero::rms_norm_backward is ATen's and launches 2 kernels")
_CUDA_OPTIMIZER_NOTE = (
    "the Adam step on CUDA is torch's fused Adam(W) kernel over the fp32 main parameters, with "
    "the step count, loss scale and clip factor kept on the device (no host sync); its "
    "launches are counted under optimizer")
_CPU_KERNELS_NOTE = (
    "megazero's CPU kernels (the fused model ops, the fused Adam/ZeRO step) are called "
    "shape-only on fake tensors: their outputs and saved tensors are allocated as around the "
    "real call, and the call itself is skipped (and not counted as a launch)")


def _notes(config, device: str) -> list[str]:
    notes = ["tensors are fake (shapes without memory) and groups are torch's fake process "
             "group: values read on the host (loss, grad norm) are zeros"]
    notes += [_CUDA_KERNELS_NOTE, _CUDA_OPTIMIZER_NOTE] if device == "cuda" else [
        _CPU_KERNELS_NOTE]
    if config.model.compile:
        notes.append(DRY_RUN_NOTE)
    return notes + ["data are synthetic tokens of the job's shapes (--mock-data)"]


def build_report(config, opts, run, checks: dict) -> Report:
    ps, dev = run.ps, opts.device
    peak = run.train_peak.get(dev) or run.tracker.peak(dev)
    t, d, p = coords_of(run.rank, ps.tp_size, ps.dp_size)
    report = Report(
        rank=run.rank, world_size=opts.world_size, device=dev, iterations=opts.iters,
        seconds=round(run.seconds, 2),
        layout={"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size,
                "virtual": ps.virtual_pp_size, "tp_rank": t, "dp_rank": d, "pp_rank": p,
                "zero_stage": config.optimizer.zero_stage,
                "sequence_parallel": config.parallel.sequence_parallel,
                "recompute": config.model.recompute_activations,
                "dtype": config.optimizer.params_dtype},
        param_count=run.param_count,
        param_bytes=run.states["params"], grad_bytes=run.states["grads"],
        main_param_bytes=run.states["main_params"],
        optimizer_state_bytes=run.states["optimizer_states"],
        activation_bytes=peak["max_activations"], temporary_bytes=peak["temporaries"],
        peak_bytes=peak["peak_bytes"], peak_breakdown=peak,
        checkpoint_bytes=sum(run.checkpoint.values()), checkpoint_files=run.checkpoint,
        memory_report=run.memory_report,
        kernel_launches=run.device_ops["kernel_launches"],
        host_syncs=run.device_ops["host_syncs"],
        counted_iteration=run.device_ops["counted_iteration"],
        logging_iteration=run.device_ops["logging_iteration"],
        device_ops=run.device_ops["device_ops"],
        collectives=_aggregate_collectives(run), p2p=_aggregate_p2p(run), checks=checks,
        notes=_notes(config, dev))
    if config.model.compile:
        # the layers ran eagerly (fake tensors are not compiled): say so rather than count
        # eager launches as if they were a compiled layer's
        report["compile"] = {"requested": True, "layers": "eager", "note": DRY_RUN_NOTE}
    report.update({k: v for k, v in run.states.items() if k.startswith("host_")})
    return report
