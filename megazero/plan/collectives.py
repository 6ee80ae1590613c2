"""The collectives one rank issues in a training iteration, predicted from megazero's rules.

``predicted_collectives(job, layout, stage)``: for the first rank (tp 0, dp 0) of pipeline
stage ``stage``, per group and operation, the calls and the bytes the rank sends in one
training iteration (schedule, gradient sync, step) as ``comm.Communicator`` counts them,
which the dry run records: an all-reduce of B bytes over n ranks sends ``int(2 (n-1)/n B)``,
an all-gather or reduce-scatter ``(n-1)`` x its shard's bytes, a p2p message its bytes.
Groups of one rank issue nothing. Per micro-batch (b, s, h, t: micro-batch, sequence,
hidden, tp; activations in the model dtype):

* ``tp``: per layer 2 all-reduces of ``[s, b, h]`` forward (row-parallel outputs) and 2
  backward (column-parallel inputs); with sequence parallelism (sp) an all-gather and a
  reduce-scatter of ``[s/t, b, h]`` shards for each; full recompute repeats the forward's.
  First stage: the embedding's 1 forward (sp: a reduce-scatter, an all-gather backward).
  Last stage: the output layer's 1 backward (sp: an all-gather, a reduce-scatter backward)
  and the vocab-parallel loss's 2 fp32 forward all-reduces (the max ``[s, b]``, then target
  logit and sum of exponentials ``[2, s, b]``). Once per step with sp: this rank's owned
  gradients of the parameters replicated over tp (norms, row biases, positions).
* ``pp``: ``send``/``recv`` of ``[s, b, h]`` (``[s/t, b, h]`` with sp) as the rank's
  schedule posts them (1F1B; interleaved, overlapped or blocking), and ``exchange``: the
  exchanges posted, each waited as one blocking call (bytes 0).
* ``dp``: the buckets of ``zero.bucketed_layout`` (``default_bucket_size``): ZeRO-0
  all-reduces each once, ZeRO-1 reduce-scatters and all-gathers each once; ZeRO-2
  reduce-scatters a bucket whenever a backward task completes it or ends holding part of it
  (each micro-batch, each interleaved chunk, each recomputed layer of a stage whose first
  gradient arrives inside the recompute), all-gathers once; ZeRO-3 (``zero3.unit_layout``,
  ``gpt_zero3_units``) gathers as ``UnitGatherer`` (pre-hooks forward and backward, the next
  unit prefetched, release after the users or the reduction), reduce-scatters as ZeRO-2,
  each after an order check (an int64 ``[3]`` all-gather) unless the ring carries it. The
  loss average (last stage) and, when sharded, the gradient norm: float64 ``[1]``.
* ``mp`` (tp x pp): the gradient norm's float64 ``[1]``. ``embedding`` (first and last
  stage): this rank's owned slice of the tied word embedding's gradient, once.
"""

from __future__ import annotations

import dataclasses
import functools

from megazero.config import ModelConfig, OptimizerConfig
from megazero.data_parallel.params import collect_named_params, tied_across_stages
from megazero.data_parallel.zero import bucketed_layout
from megazero.data_parallel.zero3 import unit_layout
from megazero.data_parallel.zero3_units import plan_units
from megazero.model import build_gpt_model_chunks, gpt_zero3_units
from megazero.plan.layout import Job, Layout
from megazero.tensor_parallel.meta import ensure_meta, meta_of
from megazero.tools.offline import offline_parallel_state

F32, F64 = 4, 8  # the loss's and the norm's element bytes
CHECK_BYTES = 3 * 8  # a ZeRO-3 order check: int64 (kind, bucket, sequence number)


def ring_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one of ``n`` ranks sends (``comm``'s accounting): ``nbytes`` is the buffer of an
    all-reduce, the shard of an all-gather or reduce-scatter."""
    return int(2 * (n - 1) / n * nbytes) if op == "all_reduce" else (n - 1) * nbytes


def layer_tp_ops(lay: Layout) -> dict:
    """The tp collectives of one transformer layer and micro-batch, by phase (``fwd``,
    ``bwd``, ``recompute``), each of a ``[s, b, h]`` activation (its gathered side)."""
    if lay.tp == 1:
        return {"fwd": [], "bwd": [], "recompute": []}
    fwd = ["all_gather", "reduce_scatter"] * 2 if lay.sp else ["all_reduce"] * 2
    bwd = ["reduce_scatter", "all_gather"] * 2 if lay.sp else ["all_reduce"] * 2
    return {"fwd": fwd, "bwd": bwd, "recompute": fwd if lay.recompute == "full" else []}


def allreduce_equivalents(ops: list[str]) -> int:
    """All-reduces moving what ``ops`` move (an all-gather plus a reduce-scatter: one)."""
    return sum(2 if op == "all_reduce" else 1 for op in ops) // 2


class Tally(dict):
    """{group: {op: {"calls", "bytes"}}}."""

    def add(self, group: str, op: str, nbytes: int, calls: int = 1) -> None:
        if calls:
            row = self.setdefault(group, {}).setdefault(op, {"calls": 0, "bytes": 0})
            row["calls"] += calls
            row["bytes"] += calls * nbytes


@functools.lru_cache(maxsize=256)
def _stage(key: tuple, tp: int, pp: int, virtual: int, dp: int, sp: bool, stage: int):
    """(ps, chunks, named parameters) of (tp 0, ``stage``, dp 0), built on meta as the run
    builds them (``key``: the ``ModelConfig``'s fields)."""
    ps = offline_parallel_state(tp, 0, pp, stage, dp, 0, virtual if virtual > 1 else None)
    chunks = build_gpt_model_chunks(ModelConfig(**dict(key)), ps, device="meta",
                                    sequence_parallel=sp)
    named = collect_named_params(chunks)  # the optimizer's order
    for _, p in named:
        ensure_meta(p)
    return ps, chunks, named


# ---- the pipeline schedule: compute order and exchanges -----------------------------------
def schedule(p: int, r: int, v: int, m: int, overlapped: bool = True):
    """(compute order ``[("F" | "B", chunk)]``, exchanges ``[(sends, receives)]``) of
    pipeline rank ``r``, as ``one_f_one_b`` and ``interleaved`` run them (empty posts left
    out)."""
    first, last = r == 0, r == p - 1
    order, posts = [], []

    def post(sn=False, sp=False, rp=False, rn=False):  # send next/prev, receive prev/next
        if sn or sp or rp or rn:
            posts.append((int(sn) + int(sp), int(rp) + int(rn)))
    if p == 1:
        return [("F", 0), ("B", 0)] * m, posts
    if v == 1:
        w = min(p - r - 1, m)
        for _ in range(w):
            post(rp=not first)
            order.append(("F", 0))
            post(sn=not last)
        post(rp=not first and m > w)
        for i in range(m - w):
            order.append(("F", 0))
            post(sn=not last, rn=not last)  # send_forward_recv_backward
            order.append(("B", 0))
            post(sp=not first, rp=not first and i < m - w - 1)
        for _ in range(w):
            post(rn=not last)
            order.append(("B", 0))
            post(sp=not first)
        return order, posts
    total = m * v

    def chunk(k, fwd):
        c = (k % (p * v)) // p
        return c if fwd else v - c - 1
    all_warmup = m == p
    warm = total if all_warmup else min((p - r - 1) * 2 + (v - 1) * p, total)
    steady = total - warm

    def fwd(k):
        c = chunk(k, True)
        order.append(("F", c))
        return not (last and c == v - 1)

    def bwd(k):
        c = chunk(k, False)
        order.append(("B", c))
        return not (first and c == 0)

    post(rp=not first)
    for k in range(warm):
        out = fwd(k)
        rp = not (first and chunk(k + 1, True) == 0) and k != total - 1
        rn = k == warm - 1 and not all_warmup and not last  # warmup ends: the first gradient
        if overlapped:
            post(sn=out, rp=rp)
            post(rn=rn)
        else:
            post(sn=out, rp=rp, rn=rn)
    for i in range(steady):
        out = fwd(i + warm)  # first and last stage: whether the next chunk is theirs
        rp = (not first or chunk(i + warm - (p - 1), True) != v - 1) and i != steady - 1
        rn = not last or chunk(i - (p - 1), False) != 0
        if overlapped:
            post(sn=out, rp=rp)
            post(sp=bwd(i), rn=rn)
        else:
            post(sn=out, sp=bwd(i), rp=rp, rn=rn)
    post(rn=all_warmup and not last)
    for k in range(steady, total):
        post(sp=bwd(k), rn=not (last and chunk(k + 1, False) == v - 1) and k != total - 1)
    return order, posts


# ---- ZeRO 2-3: the bucket reducer and the unit gatherer, event by event -------------------
class _Sim:
    """``BucketReducer`` (stages 2-3) and ``UnitGatherer`` (stage 3) over the compute order,
    counting all-gathers (``gathers``) and reduce-scatters (``reduces``) per bucket."""

    def __init__(self, layout, units):
        self.layout, self.units = layout, units  # units: [] below stage 3
        n = len(layout.buckets)
        self.size = [len(b.params) for b in layout.buckets]
        self.bucket_of = {name: pr.bucket for name, pr in layout.ranges.items()}
        self.unit_of = {b: u for u in units for b in u.buckets}
        self.gathers, self.reduces = [0] * n, [0] * n
        self.ready, self.done = [0] * n, [False] * n
        self.queued = None  # the backward task holding the reducer's end-of-backward callback
        self.gathered, self.inflight, self.uses, self.reduced = set(), set(), {}, {}

    # BucketReducer
    def grad_ready(self, name: str, task: int) -> None:
        b = self.bucket_of[name]
        if self.done[b]:
            return
        if self.queued is None:  # NOTE: queue_callback binds to the task running (nested or not)
            self.queued = task
        self.ready[b] += 1
        if self.ready[b] == self.size[b]:
            self.reduce(b)

    def reduce(self, b: int) -> None:
        self.done[b] = True
        self.reduces[b] += 1
        u = self.unit_of.get(b)
        if u is not None:  # after_reduce: the unit's gradients have left
            self.reduced.setdefault(u.index, set()).add(b)
            if len(self.reduced[u.index]) == len(u.buckets):
                self.reduced[u.index] = set()
                self.gathered.discard(u.index)

    def end_task(self, task: int) -> None:
        if self.queued != task:
            return
        self.queued = None
        for b in range(len(self.size)):
            if not self.done[b] and self.ready[b]:
                self.reduce(b)
        self.ready, self.done = [0] * len(self.size), [False] * len(self.size)
        # ZeRO-3's end_of_backward: prefetches drained, everything released
        self.inflight, self.gathered, self.uses, self.reduced = set(), set(), {}, {}

    # UnitGatherer
    def fetch(self, u, direction: int, prefetch: bool) -> None:
        if u.index in self.gathered:
            return
        for b in u.buckets:  # a prefetch in flight is taken, else gathered now
            self.gathers[b] += b not in self.inflight
            self.inflight.discard(b)
        self.gathered.add(u.index)
        self.uses[u.index] = 0
        nxt = u.index + direction
        if prefetch and 0 <= nxt < len(self.units) and self.units[nxt].chunk == u.chunk \
                and nxt not in self.gathered:
            for b in self.units[nxt].buckets:
                if b not in self.inflight:
                    self.inflight.add(b)
                    self.gathers[b] += 1

    def forward(self, u, first: bool) -> None:
        """A user of ``u`` runs forward: pre-hook, then (after its last user) release."""
        self.fetch(u, +1, first)
        self.uses[u.index] += 1
        if self.uses[u.index] >= len(u.users):
            self.gathered.discard(u.index)


def _modules(chunk, named) -> list:
    """(module, parameter names whose gradients it completes) in forward order."""
    by_id = {id(p): n for n, p in named}
    mods = ([chunk.embedding] if chunk.pre_process else []) + list(chunk.layers.values())
    mods += [chunk.final_layernorm, chunk.output_layer] if chunk.post_process else []
    out, seen = [], set()
    for mod in mods:
        uses = {by_id[id(p)] for p in mod.parameters() if id(p) in by_id}
        if mod is chunk.output_layer and chunk.tied:
            uses.add(by_id[id(chunk.word_embedding_weight)])
        out.append((mod, uses - seen))  # a gradient is complete at its first user's backward
        seen |= uses
    return out


def _simulate(sim: _Sim, chunks, named, order, full_recompute: bool) -> None:
    """Run ``order`` through ``sim``: a forward runs each unit user's hooks; a backward goes
    through the modules in reverse (a recomputed layer: its forward again, then its backward
    as a nested autograd task), each completing the gradients it is the first user of."""
    hooks = {id(mod): (u, i == 0) for u in sim.units if u.buckets
             for i, mod in enumerate(u.users)}
    seqs = [_modules(c, named) for c in chunks]
    tasks = iter(range(1 << 62))
    for kind, c in order:
        if kind == "F":
            for mod, _ in seqs[c]:
                if id(mod) in hooks:
                    sim.forward(*hooks[id(mod)])
            continue
        layers = {id(layer) for layer in chunks[c].layers.values()}
        outer = next(tasks)
        for mod, names in reversed(seqs[c]):
            hook, task = hooks.get(id(mod)), outer
            if full_recompute and id(mod) in layers:  # checkpoint: a backward of its own
                task = next(tasks)
                if hook:
                    sim.forward(*hook)
            if hook:
                sim.fetch(hook[0], -1, hook[1])
            for name in sorted(names):
                sim.grad_ready(name, task)
            if task != outer:
                sim.end_task(task)
        sim.end_task(outer)


# ---- one rank's iteration ------------------------------------------------------------------
def predicted_collectives(job: Job, lay: Layout, stage: int = 0, *, overlap_p2p: bool = True,
                          ring_min_bytes: int | None = None) -> Tally:
    """Collectives of one training iteration of the first rank of pipeline stage ``stage``
    (-1: the last): {group: {op: {"calls", "bytes"}}} (see the module docstring).
    ``ring_min_bytes``: ZeRO-3 collectives of at least this many bytes (the full buffer) run
    on megazero's ring, which carries their order check (None: no ring, as NCCL, the dry run
    and ``--ring-collectives native``)."""
    m_cfg = dataclasses.replace(job.model, params_dtype={
        "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[job.dtype])
    p, t, dp, v = lay.pp, lay.tp, lay.dp, lay.virtual
    stage = stage % p
    first, last = stage == 0, stage == p - 1
    m = lay.microbatches(job.global_batch)
    e = job.elem_bytes
    s, b, h = m_cfg.seq_length, lay.micro_batch, m_cfg.hidden_size
    sp = lay.sp and t > 1
    ps, chunks, named = _stage(tuple(sorted(dataclasses.asdict(m_cfg).items())), t, p, v, dp,
                               sp, stage)
    out = Tally()
    # tensor parallel, per micro-batch
    if t > 1:
        act = s * b * h * e  # [s, b, h]
        shard = act // t  # [s/t, b, h]
        per = {"all_reduce": ring_bytes("all_reduce", act, t),
               "all_gather": ring_bytes("all_gather", shard, t),
               "reduce_scatter": ring_bytes("reduce_scatter", shard, t)}
        layers = sum(len(c.layers) for c in chunks)
        ops = [op for phase in layer_tp_ops(lay).values() for op in phase] * layers
        if first:
            ops += ["reduce_scatter", "all_gather"] if sp else ["all_reduce"]
        if last:
            ops += ["all_gather", "reduce_scatter"] if sp else ["all_reduce"]
            out.add("tp", "all_reduce", ring_bytes("all_reduce", s * b * F32, t), m)
            out.add("tp", "all_reduce", ring_bytes("all_reduce", 2 * s * b * F32, t), m)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            out.add("tp", op, per[op], m * ops.count(op))
    # pipeline exchanges
    order, posts = schedule(p, stage, v, m, overlap_p2p)
    if p > 1:
        msg = (s // t if sp else s) * b * h * e
        out.add("pp", "send", msg, sum(x for x, _ in posts))
        out.add("pp", "recv", msg, sum(y for _, y in posts))
        out.add("pp", "exchange", 0, len(posts))
    # data parallel: gradients, parameters; then what the step reduces
    opt = OptimizerConfig(zero_stage=lay.zero, cpu_offload=lay.offload)
    if lay.zero == 3:
        units, persistent = plan_units(chunks, named, gpt_zero3_units,
                                       opt.zero_param_persistence_threshold)
        layout = unit_layout(named, units, persistent, ps)
        replicated = [layout.buckets[-1]] if persistent else []
    else:
        units = []
        layout = bucketed_layout(named, ps, opt, lay.zero > 0 and dp > 1)
        replicated = layout.buckets if layout.shard else []
    if dp > 1:
        reduces = [1] * len(layout.buckets)
        gathers = [0] * len(layout.buckets)
        if lay.zero >= 2:
            sim = _Sim(layout, units)
            _simulate(sim, chunks, named, order, lay.recompute == "full")
            reduces, gathers = sim.reduces, sim.gathers
        for bucket, n_red, n_gat in zip(layout.buckets, reduces, gathers):
            full = bucket.numel * e
            if not layout.shard:
                out.add("dp", "all_reduce", ring_bytes("all_reduce", full, dp), n_red)
                continue
            chunk_bytes = ring_bytes("reduce_scatter", full // dp, dp)
            out.add("dp", "reduce_scatter", chunk_bytes, n_red)
            out.add("dp", "all_gather", chunk_bytes, n_gat)
            if lay.zero == 3 and (ring_min_bytes is None or full < ring_min_bytes):
                out.add("dp", "all_gather", ring_bytes("all_gather", CHECK_BYTES, dp),
                        n_red + n_gat)
        for bucket in replicated:  # updated parameters, all-gathered after the step
            out.add("dp", "all_gather", ring_bytes("all_gather", bucket.numel * e // dp, dp))
        if last:
            out.add("dp", "all_reduce", ring_bytes("all_reduce", F64, dp))  # the loss
    # gradient finalisation and norm (once per step)
    segs = layout.segments
    sp_numel = sum(g.numel for g in segs if meta_of(g.param).sequence_parallel)
    if t > 1 and sp_numel:
        out.add("tp", "all_reduce", ring_bytes("all_reduce", sp_numel * e, t))
    tied = sum(g.numel for g in segs if tied_across_stages(g.param, ps))
    if p > 1 and tied:
        out.add("embedding", "all_reduce", ring_bytes("all_reduce", tied * e, 2))
    if t * p > 1:
        out.add("mp", "all_reduce", ring_bytes("all_reduce", F64, t * p))
    if layout.shard:
        out.add("dp", "all_reduce", ring_bytes("all_reduce", F64, dp))
    return out


def blocking_calls_of(job: Job, lay: Layout, ring_min_bytes: int | None = None) -> dict:
    """Calls per step by group size (``"p2p"``: pipeline exchanges) of the stage issuing the
    most (first, middle or last), from ``predicted_collectives``."""
    sizes = {"tp": lay.tp, "dp": lay.dp, "mp": lay.tp * lay.pp, "embedding": 2}
    best: dict = {}
    for stage in sorted({0, lay.pp // 2, lay.pp - 1}):
        calls: dict = {}
        for group, ops in predicted_collectives(job, lay, stage,
                                                ring_min_bytes=ring_min_bytes).items():
            for op, row in ops.items():
                key = ("p2p" if op == "exchange" else None) if group == "pp" else sizes[group]
                if key is not None:
                    calls[key] = calls.get(key, 0) + row["calls"]
        if not best or sum(calls.values()) > sum(best.values()):
            best = calls
    return best
