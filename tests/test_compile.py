"""--compile (megazero.model.compile): torch.compile on each transformer layer's forward.

Training through pretrain_gpt2's providers with --compile gives the eager single process's
losses and parameters (fp32, dropout off) at tp1, tp2 with sequence parallelism, pp2 with full
recompute, ZeRO-3 (dp2) with selective recompute and ZeRO-2 (dp2). At tp1 a layer is one graph
without breaks; at tp2 the graph breaks only at the documented boundary (the tp linears and
the sequence-parallel dropout, run eagerly), never inside ``distributed.comm``. With dropout the
compiled layers train, and full recompute replays their masks (inductor's RNG). The dry run
runs the layers eagerly and says so.

Inductor's C++ compile is slow on CPU: every run uses TINY's shapes, so the layouts share
compiled graphs through inductor's on-disk cache.
"""

import os
import subprocess
import sys

import pytest
import torch

from megazero.arguments import parse_args
from megazero.config import ModelConfig
from megazero.config.deepspeed import DeepSpeedConfigError, parse_ds_config
from megazero.model.compile import DRY_RUN_NOTE, LayerCompile, compile_note
from megazero.model.kv_cache import KVCache
from megazero.model.transformer import TransformerLayer
from megazero.tensor_parallel.random import model_parallel_manual_seed
from tests.dist_helper import run_distributed
from tests.test_scripts import _TEARDOWN_PROBE, free_port
from tests.train_helper import TINY, assert_same_run, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = " --train-iters 3"
DROPOUT = " --attention-dropout 0.1 --hidden-dropout 0.1"
LAYOUTS = {
    "tp1": ("", 1),
    "tp2-sp": (" --tensor-model-parallel-size 2 --sequence-parallel", 2),
    "pp2-full-recompute": (" --pipeline-model-parallel-size 2 --recompute-granularity full", 2),
    "dp2-zero3-selective-recompute": (" --zero-stage 3 --recompute-granularity selective", 2),
    "dp2-zero2": (" --zero-stage 2", 2),
}
# where dynamo leaves the graph at tp2 with sequence parallelism: the disabled boundaries
TP2_BOUNDARIES = {"ColumnParallelLinear.forward", "RowParallelLinear.forward",
                  "TransformerLayer._residual_dropout"}
_eager = {}


def _dynamo_counters(clear: bool):
    """This worker's dynamo counters (graphs compiled, graph breaks by reason)."""
    from torch._dynamo.utils import counters

    out = {"graphs": counters["stats"]["unique_graphs"],
           "breaks": dict(counters["graph_break"])}
    if clear:
        counters.clear()
    return out


def _compiled_run(argv: str, world: int):
    """(run_training's result, the dynamo counters of the last rank's training)."""
    run_distributed(_dynamo_counters, world, True)
    run = run_training(argv + " --compile", world)
    return run, run_distributed(_dynamo_counters, world, False)[-1]


def _eager_run(extra: str = ""):
    if extra not in _eager:
        _eager[extra] = run_training(TINY + ITERS + extra, 1)
    return _eager[extra]


def _boundaries(breaks: dict) -> set:
    """The functions of ``torch.compiler.disable()``d graph breaks; any other break fails."""
    names = set()
    for reason in breaks:
        assert "torch.compiler.disable()" in reason, reason
        names.add(reason.split("<function ")[1].split(" at ")[0])
    return names


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_training_matches_eager(layout):
    argv, world = LAYOUTS[layout]
    run, counters = _compiled_run(TINY + ITERS + argv, world)
    assert_same_run(run, _eager_run(), what=f"--compile at {layout}")
    assert counters["graphs"] > 0  # the layers did go through torch.compile
    boundaries = _boundaries(counters["breaks"])
    if layout == "tp2-sp":
        assert boundaries == TP2_BOUNDARIES
    elif layout.endswith("selective-recompute"):
        assert boundaries == {"ParallelAttention._recomputed_core"}
    else:
        assert boundaries == set()  # one graph per layer, no break


def test_compiled_dropout_trains_and_full_recompute_replays_it():
    """Dropout inside the compiled layer draws inductor's masks (not eager's); full recompute
    restores the generator, so the recomputed graph draws the masks its forward drew."""
    plain, counters = _compiled_run(TINY + ITERS + DROPOUT, 1)
    assert counters["graphs"] > 0 and counters["breaks"] == {}
    recomputed, _ = _compiled_run(TINY + ITERS + DROPOUT + " --recompute-granularity full", 1)
    losses = torch.tensor(plain[0])
    assert torch.isfinite(losses).all()
    assert_same_run(recomputed, plain, what="compiled dropout with full recompute")
    eager = torch.tensor(_eager_run(DROPOUT)[0])
    assert not torch.allclose(losses, eager, rtol=1e-5, atol=0)  # other masks


def _tiny_layer_config(**kw) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=96, compile=True, **kw)


def test_a_compiled_layer_is_one_graph_at_tp1():
    """No graph break inside a layer at tp1, with dropout on and a tracker given (the layer
    is built without it: no fork of the generator states inside the graph)."""
    import torch._dynamo

    config = _tiny_layer_config(attention_dropout=0.1, hidden_dropout=0.1)
    plan = LayerCompile.for_config(config)
    tracker = model_parallel_manual_seed(1, 0)
    layer = TransformerLayer(plan.layer_config(config), None, plan.layer_tracker(tracker, 1))
    assert not layer.input_layernorm.fused and not layer.mlp.fused_bias_gelu  # plain formulas
    x = torch.randn(16, 2, 32, requires_grad=True)  # [s, b, h]
    explained = torch._dynamo.explain(layer.forward)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons
    # the eager layer with the fused ops and the tracker breaks there (the test can fail)
    eager = TransformerLayer(config, None, tracker)
    assert torch._dynamo.explain(eager.forward)(x).graph_break_count > 0


def test_flag_and_ds_config():
    assert not parse_args(TINY.split(), world_size=1).model.compile
    assert parse_args((TINY + " --compile").split(), world_size=1).model.compile
    with pytest.raises(DeepSpeedConfigError, match="use --compile"):
        parse_ds_config({"train_batch_size": 8, "compile": {"deepcompile": True}}, 1)


def test_eager_where_compile_cannot_run():
    """The dry run's fake tensors: layers built eagerly with the fused ops, and a note; a KV
    cache decodes eagerly; hooks inside a compiled layer are refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = _tiny_layer_config()
    with FakeTensorMode():
        plan = LayerCompile.for_config(config)
    assert not plan.compiled and plan.note == DRY_RUN_NOTE
    assert plan.layer_config(config) is config
    chunk = torch.nn.Module()
    chunk.layer_compile = plan
    assert compile_note([chunk]) == DRY_RUN_NOTE
    assert compile_note([torch.nn.Module()]) is None

    plan = LayerCompile.for_config(config)
    layer = TransformerLayer(plan.layer_config(config), None, None).eval()
    plan.apply(layer, 1)
    x = torch.randn(16, 2, 32)  # [s, b, h]
    graphs = _dynamo_counters(False)["graphs"]
    with torch.no_grad():
        eager = type(layer).forward(layer, x, kv_cache=KVCache(16))
        torch.testing.assert_close(layer(x, kv_cache=KVCache(16)), eager, rtol=0, atol=0)
    assert _dynamo_counters(False)["graphs"] == graphs  # nothing compiled
    layer.mlp.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(RuntimeError, match="inside a compiled transformer layer has hooks"):
        layer(x)


def test_dry_run_with_compile_runs():
    """pretrain_gpt2.py --compile --dry-run-* on fake CUDA (a CPU-only torch) completes."""
    from megazero.dryrun import fake_cuda

    flags = ("--mock-data --vocab-size 96 --make-vocab-size-divisible-by 8 --num-layers 2 "
             "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
             "--global-batch-size 2 --train-iters 4 --tensor-model-parallel-size 2 "
             "--zero-stage 3 --compile --dry-run-rank 0 --dry-run-world-size 4 "
             "--dry-run-device cuda --no-dry-run-check-peers")
    env = {**fake_cuda.preload_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "pretrain_gpt2.py", *flags.split()], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "launches" in done.stdout


def test_teardown_joins_every_gloo_thread_after_compile(tmp_path):
    """dynamo's caches hold the process groups its graphs traced (a tp group of one at pp2):
    ``destroy_distributed`` resets them, so no gloo thread outlives the run (see
    tests/test_scripts.py's teardown test)."""
    probe = tmp_path / "probe.py"
    probe.write_text(_TEARDOWN_PROBE)
    flags = (TINY + ITERS + " --compile --pipeline-model-parallel-size 2").split()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_OUT": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), str(probe),
                           "pretrain_gpt2.py", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    left = {name: int((tmp_path / name).read_text()) for name in ("rank0", "rank1")}
    assert left == {"rank0": 0, "rank1": 0}, ("gloo threads left", left)
