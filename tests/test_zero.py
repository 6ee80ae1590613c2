"""ZeRO stages 0-3 composed with tp and pp: parity, precision, resume, consolidation, memory."""

import pytest
import torch
import torch.distributed as dist

from megazero.tools.consolidate import consolidate
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, assert_same_run, run_training

ITERS = " --train-iters 5"
LAYOUTS = [
    ("", 2),  # dp2
    ("", 4),  # dp4
    (" --tensor-model-parallel-size 2", 4),  # tp2 x dp2
    (" --pipeline-model-parallel-size 2", 4),  # pp2 x dp2
    (" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel",
     8),  # tp2 x pp2 x dp2
]


@pytest.fixture(scope="module")
def single_process_run():
    return run_training(TINY + ITERS, 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("argv,world", LAYOUTS)
def test_zero_stage_matches_single_process(single_process_run, stage, argv, world):
    # small buckets so several reduce-scatters and straddling parameters are exercised
    buckets = " --zero-reduce-bucket-size 6000" if stage < 3 else ""  # ZeRO-3: per unit
    run = run_training(TINY + ITERS + argv + f" --zero-stage {stage}" + buckets, world)
    assert_same_run(run, single_process_run, what=f"stage {stage}{argv} world {world}")


@pytest.mark.parametrize("extra", [" --zero-stage 2 --zero-overlap-comm",
                                   " --zero-stage 3 --zero-param-persistence-threshold 64",
                                   " --zero-stage 3 --checkpoint-activations --no-zero-prefetch",
                                   " --zero-stage 1 --optimizer sgd --lr 0.05",
                                   " --zero-stage 2 --cpu-offload",
                                   " --zero-stage 3 --cpu-offload --cpu-torch-adam",
                                   " --zero-stage 1 --cpu-torch-adam"])
def test_zero_options_match(single_process_run, extra):
    base = single_process_run
    if "sgd" in extra:
        base = run_training(TINY + ITERS + " --optimizer sgd --lr 0.05", 1)
    assert_same_run(run_training(TINY + ITERS + extra, 2), base, what=extra)


def test_lamb_is_layout_invariant():
    base = run_training(TINY + ITERS + " --optimizer lamb --lr 1e-2", 1)
    run = run_training(TINY + ITERS + " --optimizer lamb --lr 1e-2 --zero-stage 2 "
                       "--tensor-model-parallel-size 2 --zero-reduce-bucket-size 6000", 4)
    # LAMB divides by per-parameter update norms: rounding differences of the summation order
    # are amplified a little more than Adam's, hence 3e-5.
    assert_same_run(run, base, rtol=3e-5, what="lamb tp2 x dp2 stage 2")


# Mixed precision against the fp32 run, with bounds from the dtype's unit roundoff u (bf16
# 2^-8, fp16 2^-11; matmuls accumulate in fp32, so each op rounds once to the dtype) and a
# first-order error analysis: a value's relative error is at most the number of roundings on
# its path times u. Along a gradient's path through this model (TINY: 4 layers) there are at
# most K = 6 per layer (norm, attention and MLP outputs, forward and backward) plus 4 (the
# embedding and the head): K = 28. A weight gradient sums the N tokens of a step (TINY: 8
# sequences of 16, N = 128), and its rounding errors are bounded relative to the sum of the
# terms' magnitudes, not to the sum: for terms of mixed signs about sqrt(N) times larger.
UNIT_ROUNDOFF = {"--bf16": 2.0 ** -8, "--fp16": 2.0 ** -11}
K_ROUNDINGS = 6 * 4 + 4
TOKENS_PER_STEP = 8 * 16
LOSS_SCALE = {"--bf16": "", "--fp16": " --initial-loss-scale 4096"}


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_losses_track_fp32(single_process_run, precision):
    """The loss is a mean of per-token log-softmaxes of logits with |z| < 1 here (the loss
    stays near ln 96 = 4.56); each token's error is led by the two roundings of the last
    hidden state and the logits, |d loss| <= 2 |dz| <= 2u |z|, the deeper roundings damped by
    the final norm and averaged over 64 tokens: relative error <= 2u (seen: 0.007u)."""
    u = UNIT_ROUNDOFF[precision]
    losses, _, results = run_training(TINY + ITERS + f" --zero-stage 2 {precision}"
                                      + LOSS_SCALE[precision], 2)
    ref = torch.tensor(single_process_run[0])
    torch.testing.assert_close(torch.tensor(losses), ref, rtol=2 * u, atol=0)
    assert results[0]["memory"]["main_params"] > 0, "an fp32 main copy for a 16-bit model"


SGD_STEP = (" --train-iters 1 --optimizer sgd --lr-decay-style constant --lr-warmup-iters 0 "
            "--clip-grad 0")


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_sgd_step_tracks_fp32(precision):
    """One SGD step from the same initial parameters p0, without clipping: p1 = p0 - lr g, so
    the step's error is lr |dg|, with |dg| <= K sqrt(N) u max|g| per tensor (g from the fp32
    run: (p0 - p1) / lr; seen: up to 74u max|g|, against 317u), plus one rounding of the
    parameter to the dtype (u |p|). A reduction off by a factor (dp averaging, loss scale)
    exceeds it: 317u is 1.2 (bf16) and 0.15 (fp16) of max|g|."""
    u, lr = UNIT_ROUNDOFF[precision], 0.05
    p0 = run_training(TINY + SGD_STEP + " --lr 0", 1)[1]
    p1 = run_training(TINY + SGD_STEP + f" --lr {lr}", 1)[1]
    _, mixed, _ = run_training(TINY + SGD_STEP + f" --lr {lr} --zero-stage 2 {precision}"
                               + LOSS_SCALE[precision], 2)
    for name, p in mixed.items():
        g_max = float((p0[name] - p1[name]).abs().max()) / lr
        err = float((p.float() - p1[name]).abs().max())
        bound = lr * K_ROUNDINGS * TOKENS_PER_STEP ** 0.5 * u * g_max \
            + u * float(p1[name].abs().max())
        assert err <= bound, (name, err, bound)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_exact_for_each_stage(tmp_path, stage):
    argv = TINY + f" --zero-stage {stage} --train-iters 8" \
        + (" --zero-reduce-bucket-size 6000" if stage < 3 else "")
    full = run_training(argv, 2)
    run_training(argv + f" --exit-interval 4 --save {tmp_path}", 2)
    second = run_training(argv + f" --load {tmp_path}", 2)
    assert second[0] == full[0][4:], f"stage {stage}: resumed losses differ"
    for name, p in full[1].items():
        assert torch.equal(p, second[1][name]), f"stage {stage}: {name} differs"


@pytest.mark.parametrize("stage,argv,world", [
    (1, " --tensor-model-parallel-size 2", 4),
    (3, " --pipeline-model-parallel-size 2", 4),
    (0, "", 1),
])
def test_zero_to_fp32_equals_live_parameters(tmp_path, stage, argv, world):
    _, live, _ = run_training(TINY + ITERS + argv + f" --zero-stage {stage} --save {tmp_path}",
                              world)
    out = tmp_path / "consolidated.pt"
    from megazero.tools.zero_to_fp32 import main

    assert main([str(tmp_path), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert state.keys() == live.keys()
    for name, t in live.items():
        assert torch.equal(state[name], t), name
    assert consolidate(str(tmp_path)).keys() == live.keys()


def test_stage3_holds_only_live_layers():
    deep = TINY.replace("--num-layers 4", "--num-layers 8")
    _, params, results = run_training(deep + " --train-iters 3 --zero-stage 3", 2)
    layer = sum(t.numel() for n, t in params.items() if n.startswith("layers.0."))
    emb = sum(t.numel() for n, t in params.items() if n.startswith("embedding."))
    total = sum(t.numel() for t in params.values())
    for r in results:
        peak = r["memory"]["gathered_peak"] / 4  # fp32 elements
        # the embedding (also the output layer) + the running layer + the prefetched one
        assert peak <= emb + 2 * layer + 64 * 4, (peak, emb, layer)
        assert peak < 0.5 * total
        assert r["memory"]["params"] / 4 <= total / 2 + 64 * len(params)


def _divergent_zero3(ring_transport=None):
    """Rank 1 runs the second layer alone: ZeRO-3 gathers in different orders. With
    ``ring_transport`` ("shm" or "tcp") the tiny buckets go over megazero's ring, whose first
    barrier carries the order check; returns (message, whether the ring used shared memory)."""
    import os

    from megazero.config import OptimizerConfig
    from megazero.data_parallel.zero3 import ZeroOrderError
    from megazero.distributed import comm
    from megazero.distributed.parallel_state import ParallelState
    from megazero.engine import initialize

    old = comm.RING_MIN_BYTES
    if ring_transport is not None:
        comm.RING_MIN_BYTES = 0
    if ring_transport == "tcp":
        os.environ["MEGAZERO_SHM"] = "0"
    try:
        ps = ParallelState.build()
        if ring_transport is not None:
            comm.communicator_of(ps.dp_group).ring_policy = "ring"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        engine = initialize(model, OptimizerConfig(zero_stage=3), ps)
        x = torch.randn(2, 8)
        try:
            if ps.dp_rank == 1:
                model[1](x)  # rank 1 runs the second layer alone: different gather order
            else:
                engine(x)
        except ZeroOrderError as exc:
            if ring_transport is None:
                return str(exc)
            ring = comm.communicator_of(ps.dp_group)._rings[ps.dp_group][0]
            return str(exc), ring.shm is not None
        return "no error" if ring_transport is None else ("no error", None)
    finally:
        comm.RING_MIN_BYTES = old
        os.environ.pop("MEGAZERO_SHM", None)


def test_zero3_divergence_fails_clearly():
    from tests.dist_helper import run_distributed

    msgs = run_distributed(_divergent_zero3, 2)
    for m in msgs:
        assert "ZeRO-3 ranks diverged" in m and "dp rank 0" in m and "dp rank 1" in m, m


def _ring_zero_run(argv):
    from megazero.distributed import comm

    old = comm.RING_MIN_BYTES
    comm.RING_MIN_BYTES = 0
    try:
        from tests.train_helper import _train_worker

        return _train_worker([*argv, "--ring-collectives", "ring"])
    finally:
        comm.RING_MIN_BYTES = old


def test_zero_with_ring_collectives_matches(single_process_run):
    from tests.dist_helper import run_distributed

    argv = (TINY + ITERS + " --zero-stage 2 --zero-reduce-bucket-size 6000").split()
    results = run_distributed(_ring_zero_run, 4, argv)
    assert any(d["reduce_scatter"] for d in results[0]["ring"].values())
    losses = results[-1]["history"]["lm loss"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_process_run[0]),
                               rtol=1e-5, atol=0)


def _ring_case(numel, overwrite):
    from megazero.distributed.ring import Ring

    g = dist.new_group(list(range(dist.get_world_size())))
    ring = Ring(g)
    n, r = ring.n, ring.rank
    x = (torch.arange(numel, dtype=torch.float32) % 97) * (r + 1)  # exact in fp32
    expect = (torch.arange(numel, dtype=torch.float32) % 97) * (n * (n + 1) / 2)
    out = torch.empty(numel // n)
    ring.reduce_scatter(out, x.clone(), overwrite_input=overwrite)
    assert torch.equal(out, expect.view(n, -1)[r])
    full = torch.empty(numel)
    ring.all_gather(full, out, async_op=True).wait()
    assert torch.equal(full, expect)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_ring_collectives_are_exact(world):
    from tests.dist_helper import run_distributed

    for numel, overwrite in ((world * 5, False), (world * 1000, True)):
        assert all(run_distributed(_ring_case, world, numel, overwrite))


def _zero3_frees_gathered_buffers():
    import gc
    import time
    import weakref

    from megazero.config import OptimizerConfig
    from megazero.distributed.parallel_state import ParallelState
    from megazero.engine import initialize

    ps = ParallelState.build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    engine = initialize(model, OptimizerConfig(zero_stage=3, zero_prefetch=False), ps)
    opt = engine.optimizer
    buffers = []
    original = opt.gatherer.materialize

    def spy(unit, fulls):
        buffers.extend(weakref.ref(f) for f in fulls)
        return original(unit, fulls)

    opt.gatherer.materialize = spy
    def alive():
        # gloo's worker thread drops its reference to a finished collective's output a moment
        # after wait() returns: poll briefly before counting
        deadline = time.monotonic() + 2.0
        while True:
            gc.collect()
            n = sum(r() is not None for r in buffers)
            if n == 0 or time.monotonic() > deadline:
                return n
            time.sleep(0.01)

    x = torch.randn(3, 64, requires_grad=True)
    loss = engine(x).pow(2).sum()
    # autograd saved views of the weights, yet no gathered buffer outlives its layer
    alive_after_forward = alive()
    engine.backward(loss)
    engine.step()
    return alive_after_forward, len(buffers), alive()


def test_zero3_saved_activations_do_not_pin_gathered_parameters():
    from tests.dist_helper import run_distributed

    for alive_fwd, gathered, alive_end in run_distributed(_zero3_frees_gathered_buffers, 2):
        assert gathered == 8  # 4 layers gathered in forward, again in backward
        assert alive_fwd == 0 and alive_end == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("argv,world", [("", 2), (" --pipeline-model-parallel-size 2", 4)],
                         ids=["dp2", "pp2xdp2"])
def test_overlap_changes_nothing(stage, argv, world):
    """--overlap-grad-reduce and --overlap-param-gather (the defaults) run the same
    collectives on the same buffers as the blocking path: losses and parameters are
    bit-identical. Small buckets and two micro-batches per step keep several reductions of
    one bucket in flight (the staging slots are reused)."""
    flags = TINY + ITERS + argv + f" --zero-stage {stage}" \
        + (" --zero-reduce-bucket-size 3000" if stage < 3 else "")
    overlapped = run_training(flags, world)
    blocking = run_training(flags + " --no-overlap-grad-reduce"
                            + (" --no-overlap-param-gather" if stage < 3 else ""), world)
    assert overlapped[0] == blocking[0], (overlapped[0], blocking[0])
    for name, p in blocking[1].items():
        assert torch.equal(overlapped[1][name], p), name


def test_staging_is_bounded_and_accounted():
    """ZeRO-2's staging slots are reused: after 5 steps of 2 micro-batches over about 10 buckets
    the pool holds at most three bucket-sized slots (one reducing, one filling, one of a
    bucket still open), and the memory report counts them and the ring's buffer."""
    _, _, results = run_training(TINY + ITERS + " --zero-stage 2 --zero-reduce-bucket-size "
                                 "5000", 2)  # no parameter is larger: buckets <= 5000
    for r in results:
        mem = r["memory"]
        assert 0 < mem["staging"] <= 3 * 5000 * 4, mem
        assert mem["comm_buffers"] == 0, mem  # 12 KB buckets stay below the ring's threshold


def _overlap_worker(stage, overlap):
    from megazero.config import ModelConfig, OptimizerConfig
    from megazero.data_parallel import build_optimizer
    from megazero.distributed.parallel_state import ParallelState
    from megazero.model import build_gpt_model_chunks, gpt_zero3_units

    ps = ParallelState.build()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=96, attention_dropout=0.0, hidden_dropout=0.0)
    chunks = build_gpt_model_chunks(cfg, ps, seed=1234, device=ps.device)
    opt = build_optimizer(chunks, OptimizerConfig(
        zero_stage=stage, zero_reduce_bucket_size=3000, overlap_grad_reduce=overlap,
        overlap_param_gather=overlap), ps, unit_policy=gpt_zero3_units)
    g = torch.Generator().manual_seed(ps.dp_rank)
    tokens = torch.randint(0, 96, (2, 17), generator=g)
    pos = torch.arange(16).expand(2, -1)

    def loss():
        return chunks[0](tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean()

    opt.zero_grad()
    loss().backward()
    in_flight_after_backward = len(opt.reducer._pending)
    opt.finish_grad_sync()
    opt.step()
    gathers_after_step = len(opt.param_gather.pending)
    loss()  # the forward waits for every bucket it uses
    gathers_after_forward = len(opt.param_gather.pending)
    return in_flight_after_backward, gathers_after_step, gathers_after_forward


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_is_really_asynchronous(stage):
    """With overlap a reduction is still in flight when the backward returns and the step
    returns with parameter all-gathers posted, which the next forward completes; without,
    nothing is left in flight (the bit-identity test above cannot see the difference)."""
    on = run_distributed(_overlap_worker, 2, stage, True)
    off = run_distributed(_overlap_worker, 2, stage, False)
    for r in on:
        assert r[0] >= 1 and r[1] >= 1 and r[2] == 0, r
    for r in off:
        assert r == (0, 0, 0), r


def _zero3_max_live(limit, prefetch_numel=None):
    from megazero.config import OptimizerConfig
    from megazero.distributed.parallel_state import ParallelState
    from megazero.engine import initialize

    ps = ParallelState.build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    engine = initialize(model, OptimizerConfig(zero_stage=3, zero_max_live_parameters=limit,
                                               zero_prefetch_bucket_size=prefetch_numel,
                                               zero_reduce_bucket_size=64 * 64), ps)
    torch.manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(3, 64)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, engine.memory_report()["gathered_peak"]


def test_zero3_max_live_parameters_limits_prefetch_not_results():
    """DeepSpeed's stage3_max_live_parameters: with room for one layer only, nothing is
    prefetched (the peak of gathered bytes is one layer's), and the training is the same."""
    from tests.dist_helper import run_distributed

    free = run_distributed(_zero3_max_live, 2, None)
    tight = run_distributed(_zero3_max_live, 2, 64 * 64)
    layer_bytes = 64 * 64 * 4
    for (l_free, peak_free), (l_tight, peak_tight) in zip(free, tight):
        assert l_tight == l_free
        assert peak_free >= 2 * layer_bytes  # the current and the prefetched layer
        assert peak_tight == layer_bytes


def test_zero3_prefetch_bucket_size_prefetches_that_many_elements_ahead():
    """DeepSpeed's stage3_prefetch_bucket_size: the units ahead stay in flight while their
    elements fit (3 layers: all four of them gathered at once in forward; 1 layer: the next
    one only, as without the setting), with the same training."""
    from tests.dist_helper import run_distributed

    layer = 64 * 64
    default = run_distributed(_zero3_max_live, 2, None)
    wide = run_distributed(_zero3_max_live, 2, None, 3 * layer)
    one = run_distributed(_zero3_max_live, 2, None, layer)
    for (l_def, peak_def), (l_wide, peak_wide), (l_one, peak_one) in zip(default, wide, one):
        assert l_wide == l_def == l_one
        assert peak_def == peak_one == 2 * layer * 4
        assert peak_wide == 4 * layer * 4
    from megazero.config import ConfigError, OptimizerConfig

    with pytest.raises(ConfigError, match="--zero-prefetch-bucket-size .* --zero-stage 3"):
        OptimizerConfig(zero_stage=2, zero_prefetch_bucket_size=layer)
    with pytest.raises(ConfigError, match="without --no-zero-prefetch"):
        OptimizerConfig(zero_stage=3, zero_prefetch=False, zero_prefetch_bucket_size=layer)
