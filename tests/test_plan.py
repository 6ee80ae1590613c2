"""The planner (megazero.plan): model-state bytes equal to what megazero's optimizer
allocates in real gloo runs and peaks within 10% of them, the CPU time model's blocking
calls and their cost, the command's table and launch lines, and bad input refused with the
flag named (the fit to published runs: tests/test_plan_fit.py)."""

from __future__ import annotations

import dataclasses
import shlex
import tempfile

import pytest

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.plan.__main__ import main as plan_main
from megazero.plan.activations import ActivationModel
from megazero.plan.cost import blocking_calls
from megazero.plan.layout import Job, Layout
from megazero.plan.memory import model_state_bytes, rank_memory
from megazero.plan.models import resolve_model
from megazero.plan.search import parse_fix
from megazero.plan.system import PlanInputError, load_system
from tests.dist_helper import run_distributed

PROVIDERS = (pretrain_gpt2.train_valid_test_datasets_provider, pretrain_gpt2.model_provider,
             pretrain_gpt2.forward_step, pretrain_gpt2.zero3_unit_policy)
SMALL = ("--mock-data --vocab-size 96 --make-vocab-size-divisible-by 8 --num-layers 4 "
         "--hidden-size 32 --num-attention-heads 8 --seq-length 16 --max-position-embeddings "
         "16 --micro-batch-size 1 --global-batch-size 4 --train-iters 2 --attention-dropout 0 "
         "--hidden-dropout 0 --ring-collectives native")


def _real_states(argv, world):
    import torch.distributed as dist

    from megazero.distributed.init import init_distributed
    from megazero.dryrun.memory import MemoryTracker
    from megazero.dryrun.run import DryRunOptions, dry_run_config, measured_pretrain

    config = parse_args(argv, world_size=world)
    with tempfile.TemporaryDirectory() as save_dir:
        cfg = dry_run_config(config, DryRunOptions(rank=0, world_size=world, device="cpu"),
                             save_dir)
        ps = init_distributed(cfg.parallel)
        with MemoryTracker() as tracker:
            measured = measured_pretrain(cfg, ps, PROVIDERS, tracker)
        dist.barrier()
    return {"pp_rank": ps.pp_rank, "states": measured["states"],
            "report": measured["memory_report"],
            "peak": measured["train_peak"]["cpu"]["peak_bytes"]}


STATE_LAYOUTS = [  # (layout, flags, bf16)
    (Layout(1, 1, 2, 1, zero=1), "--zero-stage 1", False),
    (Layout(2, 1, 2, 1, zero=2), "--tensor-model-parallel-size 2 --zero-stage 2 --bf16", True),
    (Layout(1, 2, 2, 1, zero=3), "--pipeline-model-parallel-size 2 --zero-stage 3", False),
]


@pytest.mark.parametrize("layout,flags,bf16", STATE_LAYOUTS,
                         ids=["dp2-z1", "tp2-dp2-z2-bf16", "pp2-dp2-z3"])
def test_model_states_equal_real_optimizer(layout, flags, bf16):
    argv = SMALL.split() + flags.split()
    world = layout.world
    model = resolve_model(["--num-layers", "4", "--hidden-size", "32",
                           "--num-attention-heads", "8", "--seq-length", "16",
                           "--max-position-embeddings", "16", "--vocab-size", "96",
                           "--make-vocab-size-divisible-by", "8"])
    job = Job(model, world, 4, "bf16" if bf16 else "fp32")
    real = run_distributed(_real_states, world, argv, world, timeout=300)
    for r in real:
        predicted = model_state_bytes(job, layout, r["pp_rank"])
        for kind in ("params", "grads", "main_params", "optimizer_states"):
            assert predicted[kind] == r["states"][kind], (kind, predicted, r["states"])
            assert predicted[kind] == r["report"][kind]
    # the fullest rank's peak, from the activation classes dry-run at this job's shape (what
    # the planner does on a CPU system) and the exact states and staging slots
    acts = ActivationModel.for_system(load_system("cpu-local"))  # exact on a CPU system
    assert acts.exact
    acts.dropout = False  # as SMALL runs
    mem = rank_memory(job, layout, acts, list(range(layout.pp)))
    peak = max(r["peak"] for r in real)
    assert abs(mem.peak - peak) <= 0.10 * peak, (mem.peak, peak)  # the bound


def test_command_prints_table_and_runnable_commands(capsys):
    rc = plan_main(["--model", "gpt3-175b", "--gpus", "64", "--gpu", "a100-80g",
                    "--global-batch-size", "64", "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "step s" in out and "MFU" in out and "bubble" in out
    lines = [x for x in out.splitlines() if x.startswith("torchrun")]
    assert len(lines) == 3
    for line in lines:  # megazero's own parser takes every launch line
        argv = shlex.split(line)
        flags = argv[argv.index("pretrain_gpt2.py") + 1:]
        cfg = parse_args(flags, world_size=64)
        assert cfg.model.num_layers == 96


def test_fix_pins_the_layout(capsys):
    rc = plan_main(["--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "64",
                    "--top", "2", "--fix", "tp=8", "pp=8", "recompute=full"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [x for x in out.splitlines() if x.startswith("# ")]
    assert rows and all("tp8 pp8" in r and "rc-full" in r for r in rows)


@pytest.mark.parametrize("argv,needle", [
    (["--model", "gpt-9000", "--gpus", "8", "--global-batch-size", "8"], "--model"),
    (["--model", "gpt3-175b", "--gpus", "7", "--global-batch-size", "1536"], "--gpus 7"),
    (["--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "64", "--fix", "tp=3"],
     "--fix tp=3"),
    (["--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "64", "--fix", "foo=1"],
     "foo"),
    (["--model", "gpt3-175b", "--gpus", "64", "--global-batch-size", "64", "--gpu", "tpu"],
     "--gpu"),
])
def test_bad_input_names_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_parse_fix_and_models():
    assert parse_fix(["tp=8", "sp=1", "recompute=full"]) == {"tp": 8, "sp": True,
                                                            "recompute": "full"}
    with pytest.raises(PlanInputError, match="recompute"):
        parse_fix(["recompute=some"])
    m = resolve_model("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --bf16")
    assert (m.num_layers, m.hidden_size, m.params_dtype) == (2, 64, "bfloat16")
    # as the command line passes it: --model "<flags>" is one word in a list
    one = resolve_model(["--num-layers 2 --hidden-size 64 --num-attention-heads 4 --bf16"])
    assert one == m
    assert resolve_model(["--num-layers", "2", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--bf16"]) == m


def test_full_recompute_transient_counts_the_recomputed_layer_once():
    """A fitted full-recompute class's transient (T1, T2) was measured with the recomputed
    layer alive, so the planner adds nothing more; Korthikanti's fallback, which has no
    transient of its own, adds the layer's bytes."""
    from megazero.plan.activations import ActivationModel

    job = Job(resolve_model("--num-layers 4 --hidden-size 128 --num-attention-heads 8 "
                            "--seq-length 128 --vocab-size 2048"), 4, 16, "fp32")
    lay = Layout(1, 1, 4, 4, zero=1, recompute="full")
    fallback = ActivationModel({}, backend="auto")
    fitted_coeffs = fallback.coefficients(job, lay)
    key = "full/auto/drop/e4"
    fitted = ActivationModel({key: fitted_coeffs}, backend="auto")
    assert fitted._lookup(job, lay) == (fitted_coeffs, True)
    kw = dict(last=True, stage_params=0, layers_per_stage=4)
    layer = fallback.layer_bytes(job, Layout(1, 1, 4, 4))
    assert layer > 0
    assert fallback.transient_bytes(job, lay, **kw) == \
        pytest.approx(fitted.transient_bytes(job, lay, **kw) + layer)


def test_blocking_calls_follow_the_schedule():
    model = resolve_model(["--num-layers", "4", "--hidden-size", "128",
                           "--num-attention-heads", "8", "--seq-length", "128",
                           "--vocab-size", "2048"])
    job = Job(model, 4, 16, "fp32")
    # tp 2, 2 micro-batches of 4: 4 per layer (6 recomputed) + 4 (the embedding, the
    # output layer, the loss's two) each; dp 2 (groups of 2 as well): the two buckets'
    # all-reduces; the gradient norm (mp group) -- megazero.plan.collectives, held to the
    # dry run's records by tests/test_plan_collectives.py
    assert blocking_calls(job, Layout(2, 1, 2, 4)) == {2: 2 * (4 * 4 + 4) + 2 + 1}
    assert blocking_calls(job, Layout(2, 1, 2, 4, recompute="full"))[2] == \
        2 * (4 * 6 + 4) + 2 + 1
    # sequence parallel: an all-gather and a reduce-scatter per GEMM pair each way, 6 at
    # the edges (the embedding's and output layer's split in two), and once per step the
    # all-reduce of the sp-replicated gradients
    assert blocking_calls(job, Layout(2, 1, 2, 4, sp=True))[2] == 2 * (4 * 8 + 6) + 1 + 2 + 1
    # pp 4, 16 micro-batches, the fullest (middle) stage: 2m + 2w + 1 exchanges posted;
    # ZeRO-1 over dp 4: reduce-scatter and all-gather of each of two buckets, the loss, the
    # norm; ZeRO-3: a gather forward and backward and a reduction per unit (6) and
    # micro-batch (1), each after its order check
    assert blocking_calls(job, Layout(1, 4, 1, 1))["p2p"] == 35
    assert blocking_calls(job, Layout(1, 1, 4, 4, zero=1)) == {4: 2 * 2 + 1 + 1}
    assert blocking_calls(job, Layout(1, 1, 4, 4, zero=3)) == {4: 2 * 3 * 6 + 1 + 1}


def test_call_cost_only_where_ranks_outnumber_cores():
    cpu = dataclasses.replace(load_system("cpu-local"), cores=2,
                              sync_cost={"2": 0.002, "8": 0.008, "p2p": 0.003})
    assert cpu.call_cost(2, 2) == 0.0  # one core per rank: nobody waits for a core
    assert cpu.call_cost(4, 2) == pytest.approx(0.002)
    assert cpu.call_cost(4, 4) == pytest.approx(0.005)  # log2-interpolated between 2 and 8
    assert cpu.call_cost(3, 2) == pytest.approx(0.001)  # half as oversubscribed
    assert cpu.call_cost(4, "p2p") == pytest.approx(0.003)
    assert load_system("a100-80g").call_cost(1024, 8) == 0.0


def _dry_run_inside_a_job():
    from megazero.plan.activations import dry_run_flags, dry_run_report

    flags = dry_run_flags(64, 4, 32, 1, 1, 256, 1, "none", False, "auto", True, 4)
    return dry_run_report(flags, world=1)["peak_bytes"]


def test_dry_run_report_inside_a_job_with_a_process_group():
    """A planner called from a process that already has a default process group (a training
    job, a test worker) dry-runs in a child process, with the same result."""
    from megazero.plan.activations import dry_run_flags, dry_run_report

    inside = run_distributed(_dry_run_inside_a_job, 2)
    flags = dry_run_flags(64, 4, 32, 1, 1, 256, 1, "none", False, "auto", True, 4)
    assert inside[0] == inside[1] == dry_run_report(flags, world=1)["peak_bytes"] > 0


def test_calibration_measures_the_cost_of_a_blocking_call():
    """``calibrate.sync_costs``: 4 ranks on 2 cores, a pair's all-reduce, all four's and a
    pair's exchange, each a non-negative time per call (the child processes' protocol)."""
    from megazero.plan.calibrate import gloo_link, sync_costs

    costs = sync_costs(2)
    assert set(costs) == {"2", "4", "p2p"}, costs
    assert all(0.0 <= v < 1.0 for v in costs.values()), costs
    bandwidth, latency = gloo_link()
    assert bandwidth > 0 and latency > 0
