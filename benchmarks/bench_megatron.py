"""megazero's GPT-2 training step against Megatron-core's ``GPTModel``, side by side, on CPU/gloo.

One run, interleaved rounds: a run is a list of entries (contender, tp) for every contender and
every tensor-parallel size of ``--tp``; within a round every entry runs once, one after another
(the order rotated by one entry each round), over ``--rounds`` rounds. Each entry-round runs in
freshly spawned worker processes, world size = tp (no data or pipeline parallelism;
``harness.spawn``: ``torch.multiprocessing`` spawn, a ``TCPStore`` on a free port, gloo, one
thread per rank: ``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), so that the peak RSS of a
process is that contender's own. Both contenders build the same GPT-2 shape: ``--layers`` layers
of ``--hidden``, ``--heads`` heads, FFN 4h with GPT-2's (tanh) GELU, pre-LayerNorm (eps 1e-5),
biases on every linear layer, learned absolute position embeddings over ``--seq`` positions,
``--vocab`` tokens padded to a multiple of 128 x tp (Megatron's padding), the output layer tied
to the word embedding, vocab-parallel cross entropy, no dropout, fp32. The contenders:

* ``megazero``: ``megazero.model.build_gpt_model_chunks(cfg, ps, seed=..., device=ps.device)``
  with ``ParallelState.build(tp_size=tp)``, with its defaults: its compiled CPU kernels for
  bias+GELU, bias+dropout+add and LayerNorm where built (``python -m megazero.ops`` tells),
  attention by ``F.scaled_dot_product_attention(is_causal=True)``, padded vocabulary columns
  masked out of the loss;
* ``megatron-core``: ``megatron.core.models.gpt.GPTModel`` with the local layer spec
  (``get_gpt_layer_local_spec()``: no Transformer Engine; without Apex its norms are
  ``torch.nn.LayerNorm``), a ``TransformerConfig`` with ``bias_activation_fusion``,
  ``bias_dropout_fusion``, ``masked_softmax_fusion``, ``gradient_accumulation_fusion`` and
  ``persist_layer_norm`` off and ``use_cpu_initialization=True``, over
  ``megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)`` on
  the gloo default group. Its attention is ``DotProductAttention`` (baddbmm into the global
  memory buffer, the PyTorch masked softmax, bmm: the [b, heads/tp, s, s] scores are
  materialised). Megatron-core assumes CUDA in places; the CPU shims, installed only in its
  worker processes, are ``_megatron_cpu_shims`` below (each says what it replaces and why):
  ``torch.cuda.current_device`` returns the CPU device, the default causal mask is made on
  the CPU, and the CUDA RNG tracker and ``model_parallel_cuda_manual_seed`` are replaced by
  equivalents on torch's CPU generator. When ``import megatron.core`` fails its rows are SKIP
  with the reason.

Initial weights differ: both draw from the same distributions (normal, std 0.02; the two
projections into the residual stream std 0.02/sqrt(2 x layers)), but megazero draws every
element from (seed, parameter name, element index) and Megatron-core each full weight from
torch's CPU generator (seeded identically on every rank, so the tp shards of one model agree).
The losses are therefore only a sanity check: both start near ln(vocab), and each contender's
agree between tp sizes.
Both models train with the same ``torch.optim.AdamW`` (lr ``--lr``, betas 0.9/0.999, eps 1e-8,
weight decay 0, no clipping, constant lr) over all their parameters. Every rank gets the same
token batches (``--micro-batch`` sequences of ``--seq + 1`` random tokens per step, made before
timing; the same for both contenders); the loss is the mean per-token cross entropy. With tp
ranks only, no gradient needs reducing outside the models (the LayerNorm and bias gradients
of replicated parameters agree on every tp rank without sequence parallelism).

A step is ``opt.zero_grad(set_to_none=True); loss = model(tokens, positions, None,
labels=labels).mean(); loss.backward(); opt.step()``, entered by every rank after a barrier
(not counted). Each rank times the step and its phases (forward, backward, optimizer step); a
step's time and each phase's are those of the slowest rank. Per entry-round ``--warmup`` steps,
then ``--steps`` measured ones. Reported per entry:

* step ms: median over all measured steps of all rounds; round medians: the range of the
  per-round medians; ratio: its step time over megatron-core's at the same tp (below 1 =
  faster);
* fwd / bwd / opt ms: the median of each phase (slowest rank);
* params/rank: the parameters one rank holds (max over ranks), the check that the shapes agree;
* peak RSS MB/rank: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of each worker at the end of
  the entry-round, max over the ranks, median over the rounds (the whole process: Python,
  torch, the contender's package, data and activations included); before model: the resident
  bytes (``VmRSS``) after the imports and the process groups, before the model is
  built (the packages' own share of the peak), max over ranks, median over rounds;
* loss first -> after: the loss of the first (warm-up) step, and after the measured steps on
  a fixed batch (identical on all ranks), from the last round.

    python benchmarks/bench_megatron.py [--tp 1 2] [--layers 4 --hidden 512 --heads 8 \
        --seq 256 --vocab 8192 --micro-batch 4] [--warmup 1 --steps 3 --rounds 3] \
        [--contenders megazero megatron-core] [--json FILE]

megatron-core is not a dependency of megazero; it runs from a separate environment holding
both (CPU torch first, so that megatron-core's ``torch>=2.6`` requirement keeps it):

    python3 -m venv /work/venv-mcore && . /work/venv-mcore/bin/activate
    pip install torch==2.13.0 && pip install megatron-core==0.16.1
    echo "$PWD" > "$(python -c 'import site; print(site.getsitepackages()[0])')/megazero.pth"

(or ``pip install -e .`` in place of the last line, which also builds megazero's kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402
from benchmarks.harness import Skip  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
CONTENDERS = ("megazero", "megatron-core")
REFERENCE = "megatron-core"
SEED = 1234
BETAS, EPS = (0.9, 0.999), 1e-8
DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default (megazero's too)


def _padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's padding: the smallest multiple of 128 x tp holding the vocabulary."""
    multiple = DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def _batch(args, index: int):
    """Step ``index``'s batch: the same on every rank (tp ranks share their input)."""
    g = torch.Generator().manual_seed(SEED + index)
    t = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    pos = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1)
    return t[:, :-1].contiguous(), pos, t[:, 1:].contiguous()


def _gelu_tanh(x):
    """GPT-2's GELU (tanh approximation), as megazero's ``bias_gelu``."""
    return F.gelu(x, approximate="tanh")


def _build_megazero(args, tp):
    from megazero.config import ModelConfig
    from megazero.distributed.parallel_state import ParallelState
    from megazero.model import build_gpt_model_chunks

    ps = ParallelState.build(tp_size=tp)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.heads, seq_length=args.seq,
                      vocab_size=args.vocab, make_vocab_size_divisible_by=DIVISIBLE_BY,
                      attention_dropout=0.0, hidden_dropout=0.0)
    before = _resident()
    (model,) = build_gpt_model_chunks(cfg, ps, seed=SEED, device=ps.device)
    return model, before


def _megatron_cpu_shims():
    """The smallest changes that let Megatron-core's local-spec GPT train on a CPU build of
    torch; installed in the megatron-core worker processes only, before the model is built."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    # 1. torch.cuda.current_device: megatron-core allocates its working tensors with
    # ``device=torch.cuda.current_device()`` (the global memory buffer that DotProductAttention
    # computes the attention scores into; the tp all-gather outputs), which raises "Torch not
    # compiled with CUDA enabled" on a CPU build. On this machine they belong on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")

    # 2. get_default_causal_mask: the PyTorch (non-fused) masked softmax builds its causal mask
    # with ``torch.ones(sq, sq, device="cuda")`` when no mask is passed (megazero's call passes
    # none either). The same mask on the CPU, made per call as the original does; patched where
    # fused_softmax looks it up (it imported the name).
    def cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    fused_softmax.get_default_causal_mask = cpu_causal_mask

    # 3. The CUDA RNG tracker: DotProductAttention forks the "model-parallel-rng" state around
    # its attention dropout (p = 0 here, but the fork happens), and CudaRNGStatesTracker keeps
    # and swaps torch.cuda generator states. The same bookkeeping on torch's CPU generator.
    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _cpu_model_parallel_manual_seed(seed: int, tp_rank: int):
    """``model_parallel_cuda_manual_seed`` (and Megatron-LM's ``_set_random_seed``) on the CPU:
    the same seeds and offsets, torch.manual_seed in place of torch.cuda.manual_seed, the
    tracker of ``_megatron_cpu_shims``."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)  # the default generator: the CPU initialisation's master weights
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def _build_megatron(args, tp):
    # megatron-core's import- and build-time notices about what a GPU setup would use (Apex,
    # Transformer Engine, CUDA graphs, CUDA_DEVICE_MAX_CONNECTIONS): noise on a CPU
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        from megatron.core import parallel_state as mps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as e:  # noqa: BLE001
        raise Skip(f"megatron-core not importable ({type(e).__name__}: {e})") from None
    _megatron_cpu_shims()
    mps.initialize_model_parallel(tensor_model_parallel_size=tp)
    _cpu_model_parallel_manual_seed(SEED, mps.get_tensor_model_parallel_rank())
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, activation_func=_gelu_tanh, normalization="LayerNorm",
        layernorm_epsilon=1e-5, add_bias_linear=True, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, sequence_parallel=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=True)
    before = _resident()
    model = GPTModel(config, get_gpt_layer_local_spec(),
                     vocab_size=_padded_vocab(args.vocab, tp), max_sequence_length=args.seq,
                     parallel_output=True, share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    return model, before


def _loss(model, batch):
    tokens, pos, labels = batch
    return model(tokens, pos, None, labels=labels).mean()


def _run_contender(kind, args, tp):
    data = [_batch(args, i) for i in range(args.warmup + args.steps)]
    eval_batch = _batch(args, 10_000)
    model, before_model = (_build_megazero if kind == "megazero" else _build_megatron)(args, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS,
                            weight_decay=0.0)
    times, first = [], None
    for i, batch in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
        if first is None:
            first = float(loss.detach())
    with torch.no_grad():
        final = float(_loss(model, eval_batch))
    return {"times": times, "first": first, "loss": final, "before_model": before_model,
            "params": sum(p.numel() for p in model.parameters())}


def _resident() -> int:
    """Resident bytes of this process now (``VmRSS``)."""
    return harness.status_kib("VmRSS") * 1024


def _rank(kind, args, tp):
    """One rank of one entry-round (``harness.spawn``): its result and its peak RSS."""
    r = _run_contender(kind, args, tp)
    r["rss_kb"] = harness.peak_rss_kib()
    return r


def run(kind, args, world):
    """One entry-round in fresh processes: the per-rank results (raises ``Skip``)."""
    return harness.spawn(_rank, world, kind, args, world, timeout=args.timeout)


def summarize(per_round):
    """Per entry: slowest-rank step and phase times (median over all measured steps, range of
    the per-round medians), peak and before-model RSS, parameters and losses."""
    times = harness.step_summary(
        [harness.slowest_rank([r["times"] for r in ranks]) for ranks in per_round], PHASES)
    rss = [max(r["rss_kb"] for r in ranks) * 1024 for ranks in per_round]
    base = [max(r["before_model"] for r in ranks) for ranks in per_round]
    last = per_round[-1]
    return {**times, "rss": statistics.median(rss), "base": statistics.median(base),
            "params": max(r["params"] for r in last),
            "first": last[0]["first"], "loss": last[0]["loss"]}


def _megatron_version() -> str:
    from importlib import metadata

    try:
        return "megatron-core " + metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "megatron-core not installed"


def print_table(rows, skips, entries, args):
    import math

    mb = 1e6
    print(f"\ngloo, world = tp: GPT-2 {args.layers} layers x hidden {args.hidden} "
          f"({args.heads} heads, FFN {4 * args.hidden}), seq {args.seq}, vocab {args.vocab} "
          f"(padded to a multiple of {DIVISIBLE_BY} x tp), fp32, micro-batch "
          f"{args.micro_batch}, no dropout; {harness.rounds_text(args, 'entry-round')}; "
          f"AdamW lr {args.lr:g}, wd 0, no clipping; ln(vocab) = {math.log(args.vocab):.4f}")

    def cells(r):
        ref = rows.get((REFERENCE, r["tp"]))
        return [*harness.step_cells(r, ref), *(f"{r['phases'][p] * 1e3:.1f}" for p in PHASES),
                f"{r['params']:,}", f"{r['rss'] / mb:.0f}", f"{r['base'] / mb:.0f}",
                f"{r['first']:.4f} -> {r['loss']:.4f}"]

    lines = harness.contender_rows(entries, rows, skips, cells, label=list)
    print(harness.markdown_table(
        ["contender", "tp", "step ms (median)", "round medians", f"vs {REFERENCE}", "fwd ms",
         "bwd ms", "opt ms", "params/rank", "peak RSS MB/rank", "before model MB",
         "loss first -> after"], lines, align="lrrrrrrrrrrl"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2],
                        help="tensor-parallel sizes (world size = tp)")
    harness.add_gpt_args(parser, layers=4, hidden=512, heads=8, seq=256, vocab=8192,
                         micro_batch=4, micro_batch_help="sequences per step")
    harness.add_round_args(parser, warmup=1, steps=3, rounds=3, timeout=900,
                           contenders=CONTENDERS)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    for tp in args.tp:
        if tp < 1 or args.heads % tp or (4 * args.hidden) % tp:
            parser.error(f"tp {tp} must be at least 1 and divide --heads and 4 x --hidden")
    print(harness.start_line(_megatron_version()))
    t_start = time.perf_counter()
    entries = [(kind, tp) for tp in args.tp for kind in args.contenders]
    results, skips = harness.interleave(entries, args.rounds, lambda e: run(e[0], args, e[1]),
                                        name=lambda e: f"{e[0]} tp={e[1]}")
    rows = {e: {"tp": e[1], **summarize(v)} for e, v in results.items() if v and e not in skips}
    print_table(rows, skips, entries, args)
    print(harness.end_line(t_start))
    if args.json:
        harness.write_json(args.json, {
            "benchmark": "bench_megatron", "args": vars(args), "versions": _megatron_version(),
            "rows": [{"contender": k, **rows[(k, tp)]} for k, tp in rows],
            "skips": [{"contender": k, "tp": tp, "reason": why} for (k, tp), why in skips.items()]})


if __name__ == "__main__":
    main()
