"""megazero.pipe (DeepSpeed's PipelineModule) and the engine's train_batch on tp x pp x dp.

The model is scripts/train_custom_3d.py's: user-written blocks of ColumnParallelLinear and
RowParallelLinear, a tied embedding used again as the output layer on the last stage, and the
vocab-parallel loss. Every layout and ZeRO stage must reproduce the single-process losses and
gradient norms (fp32, same seed, same global batch), and a checkpoint saved at one layout must
resume at another with its client_state.
"""

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from megazero.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from megazero.pipe.partition import partition, partition_balanced, partition_uniform
from tests.dist_helper import run_distributed

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "train_custom_3d.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_custom_3d", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- partitioning (pure) ---------------------------------------------------------------------
def test_partition_uniform_and_balanced():
    assert partition_uniform(7, 4) == [0, 2, 4, 6, 7]
    assert partition_uniform(8, 2) == [0, 4, 8]
    # the heaviest part is as light as a contiguous split allows
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    # light items still give every part one at least
    assert partition_balanced([0, 0, 0, 0], 4) == [0, 1, 2, 3, 4]
    for weights, parts in (([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1] * 10, 4), ([7, 0, 0, 7], 2)):
        b = partition_balanced(weights, parts)
        assert len(b) == parts + 1 and b[0] == 0 and b[-1] == len(weights)
        assert all(x < y for x, y in zip(b, b[1:]))
        worst = max(sum(weights[x:y]) for x, y in zip(b, b[1:]))
        best = min(max(sum(weights[x:y]) for x, y in zip(c, c[1:]))
                   for c in _all_splits(len(weights), parts))
        assert worst == best


def _all_splits(n, parts):
    from itertools import combinations
    for cut in combinations(range(1, n), parts - 1):
        yield [0, *cut, n]


def test_partition_methods_and_their_errors():
    classes = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Embedding"]
    counts = [100, 10, 10, 10, 10, 2, 0]
    assert partition("type:block", classes, counts, 2) == [0, 3, 7]
    assert partition("parameters", classes, counts, 2) == [0, 1, 7]
    assert partition("uniform", classes, counts, 2) == [0, 4, 7]
    assert partition([0, 2, 7], classes, counts, 2) == [0, 2, 7]
    with pytest.raises(ValueError, match="matches no layer"):
        partition("type:Attention", classes, counts, 2)
    with pytest.raises(ValueError, match="partition_method 'size'"):
        partition("size", classes, counts, 2)
    with pytest.raises(ValueError, match="boundaries"):
        partition([0, 5, 3], classes, counts, 2)
    with pytest.raises(ValueError, match="fewer than its 8 pipeline parts"):
        partition("uniform", classes, counts, 8)


# ---- one process -----------------------------------------------------------------------------
class _Scale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.weight


def test_single_stage_module_names_layers_and_seeds_them_by_index():
    specs = [LayerSpec(nn.Linear, 4, 4), lambda x: torch.tanh(x), LayerSpec(nn.Linear, 4, 4),
             TiedLayerSpec("s", _Scale, 4), TiedLayerSpec("s", _Scale, 4)]
    a, b = PipelineModule(specs, num_stages=1), PipelineModule(specs, num_stages=1)
    names = [n for n, _ in a.chunks[0].named_parameters()]
    assert names == ["tied_modules.s.weight", "0.weight", "0.bias", "2.weight", "2.bias"]
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q)  # the same seed per layer index, whatever torch's state
    torch.manual_seed(1234 + 2)  # layer 2 is drawn under base_seed + its index
    assert torch.equal(a.chunks[0].get_parameter("2.weight"), nn.Linear(4, 4).weight)
    with torch.no_grad():
        a.chunks[0].tied_modules["s"].weight.fill_(2.0)
    x = torch.randn(3, 4)
    lin0, lin2 = a.chunks[0].get_submodule("0"), a.chunks[0].get_submodule("2")
    assert torch.allclose(a(x), lin2(torch.tanh(lin0(x))) * 4)  # one tied module, used twice


def test_bad_pipeline_input_fails_naming_it():
    with pytest.raises(TypeError, match="LayerSpec needs an nn.Module subclass"):
        LayerSpec(print)
    with pytest.raises(ValueError, match="must be an identifier"):
        TiedLayerSpec("a-b", nn.Linear, 2, 2)
    with pytest.raises(ValueError, match="num_stages=2 but the parallel state has pp_size=1"):
        from megazero.distributed.parallel_state import ParallelState
        PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 2, num_stages=2,
                       parallel_state=ParallelState.build())
    with pytest.raises(ValueError, match="tied_weight_attr 'bias'"):
        _tied_across("bias")
    import megazero
    engine = megazero.initialize(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="runs a megazero.pipe.PipelineModule"):
        engine.train_batch(iter([]))


def _tied_across(attr):
    """A tied module's copy for a tie across two stages, whose tied_weight_attr is checked
    then (on one process: the tie's stages set by hand)."""
    module = PipelineModule([TiedLayerSpec("t", _Scale, 2, tied_weight_attr=attr)],
                            num_stages=1)
    module.tied_stages = {"t": [0, 1]}
    module._shared(TiedLayerSpec("t", _Scale, 2, tied_weight_attr=attr), 0)


def test_train_batch_checks_the_batch_and_the_stage_output():
    import megazero
    model = PipelineModule([LayerSpec(nn.Linear, 4, 1)], num_stages=1,
                           loss_fn=lambda out, y: ((out - y) ** 2).mean())
    engine, _, _, _ = megazero.initialize(model=model, config={
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1})
    with pytest.raises(TypeError, match=r"\(inputs, labels\) pairs, got dict"):
        engine.train_batch(iter([{"x": 1}] * 2))
    x, y = torch.randn(1, 4), torch.randn(1, 1)
    loss = engine.train_batch(iter([(x, y), (x, y)]))
    assert loss.shape == () and torch.isfinite(loss)
    bad = PipelineModule([LayerSpec(nn.Linear, 4, 3)], num_stages=1,
                         loss_fn=lambda out, y: out)
    engine, _, _, _ = megazero.initialize(model=bad, config={"train_batch_size": 1})
    with pytest.raises(ValueError, match=r"must be a scalar tensor, got Tensor of shape \(1, 3\)"):
        engine.train_batch(iter([(x, y)]))


# ---- every layout against one process --------------------------------------------------------
def _train(tp, pp, zero, steps, virtual=1, method="type:Block", interval=0, save=None,
           load=None, first=1, bf16=False):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    script = _script()
    ps = ParallelState.build(tp, pp)
    model = script.build_model(ps, virtual_stages=virtual, partition_method=method,
                               activation_checkpoint_interval=interval)
    config = script.ds_config(zero)
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, scheduler = megazero.initialize(model=model, config=config)
    dtypes = {p.dtype for p in model.parameters()}
    client = None
    if load is not None:
        path, client = engine.load_checkpoint(load)
        first = client["next_step"]
    history = []
    for step in range(first, first + steps):
        data = script.batches(step, config["train_batch_size"],
                              config["train_micro_batch_size_per_gpu"], ps.dp_rank, ps.dp_size)
        loss = engine.train_batch(data)
        history.append((float(loss), float(engine.last_grad_norm), engine.get_lr()[0]))
    evals = float(engine.eval_batch(script.batches(99, config["train_batch_size"],
                                                   config["train_micro_batch_size_per_gpu"],
                                                   ps.dp_rank, ps.dp_size)))
    if save is not None:
        engine.save_checkpoint(save, tag="t", client_state={"next_step": first + steps,
                                                           "note": "from the 3D run"})
    return {"history": history, "eval": evals, "client": client,
            "steps": engine.global_steps, "dtypes": dtypes}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_train, 1, 1, 1, 1, 6)[0]


def _same(a, b):
    for (la, ga, lra), (lb, gb, lrb) in zip(a, b):
        assert la == pytest.approx(lb, rel=1e-5)
        assert ga == pytest.approx(gb, rel=1e-5)
        assert lra == lrb
    assert len(a) == len(b)


@pytest.mark.parametrize("tp,pp,zero,virtual,method,interval", [
    (2, 2, 3, 1, "type:Block", 0),      # tp x pp with ZeRO-3 partitions over dp 1
    (1, 2, 2, 2, "type:Block", 2),      # interleaved, recompute every 2 layers, dp 2
    (1, 4, 1, 1, "uniform", 0),         # four stages, tied embedding on the first and last
    (1, 1, 3, 1, "parameters", 0),      # dp 4, ZeRO-3
])
def test_every_layout_reproduces_the_single_process_run(reference, tp, pp, zero, virtual,
                                                        method, interval):
    results = run_distributed(_train, 4, tp, pp, zero, 6, virtual, method, interval)
    for r in results:  # every rank returns the same loss (broadcast from the last stage)
        _same(r["history"], reference["history"])
        assert r["eval"] == pytest.approx(reference["eval"], rel=1e-5)


def test_bf16_config_trains_a_bf16_model_at_every_layout():
    """ds_config bf16: the engine casts the user's model to bf16 (DeepSpeed's module.bfloat16())
    and its floating inputs; the pipeline passes bf16 activations. pp2 x dp2 follows the
    single-process bf16 run closely, and differs from the fp32 run."""
    one = run_distributed(_train, 1, 1, 1, 1, 4, bf16=True)[0]
    four = run_distributed(_train, 4, 1, 2, 2, 4, bf16=True)
    fp32 = run_distributed(_train, 1, 1, 1, 1, 4)[0]
    assert one["dtypes"] == {torch.bfloat16}
    for r in four:
        assert r["dtypes"] == {torch.bfloat16}
        for (la, _, _), (lb, _, _) in zip(r["history"], one["history"]):
            assert la == pytest.approx(lb, rel=1e-3)
    assert [h[0] for h in one["history"]] != [h[0] for h in fp32["history"]]


def test_checkpoint_resumes_at_another_layout_with_its_client_state(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 4, 2, 2, 1, 3, 1, "type:Block", 0, ckpt)
    assert (tmp_path / "ckpt" / "latest").read_text() == "t"
    for world, tp, pp, zero in ((1, 1, 1, 2), (4, 1, 4, 3)):
        results = run_distributed(_train, world, tp, pp, zero, 3, 1, "uniform", 0, None, ckpt)
        for r in results:
            assert r["client"] == {"next_step": 4, "note": "from the 3D run"}
            assert r["steps"] == 6
            _same(r["history"], reference["history"][3:])


def test_ties_between_middle_stages_are_refused():
    with pytest.raises(Exception, match=r"used on pipeline stages \[1, 2\]"):
        run_distributed(_tie_in_the_middle, 4)


def _tie_in_the_middle():
    from megazero.distributed.parallel_state import ParallelState

    ps = ParallelState.build(1, 4)
    specs = [LayerSpec(nn.Linear, 2, 2), TiedLayerSpec("t", _Scale, 2),
             TiedLayerSpec("t", _Scale, 2), LayerSpec(nn.Linear, 2, 2)]
    PipelineModule(specs, num_stages=4, parallel_state=ps, partition_method="uniform")


# ---- the script under torchrun ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(cmd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 4, out[-3000:]
    return [(float(line.split("loss ")[1].split()[0]),
             float(line.split("grad norm ")[1].split()[0])) for line in lines]


def test_custom_3d_script_tp2_pp2_dp2_under_torchrun_matches_one_process():
    """The issue's check: the user-written model at tp2 x pp2 x dp2 (8 processes) prints the
    single-process losses and gradient norms."""
    one = _losses([sys.executable, str(SCRIPT), "--steps", "4"])
    three_d = _losses([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8",
                       "--master-port", str(_free_port()), str(SCRIPT), "--tp", "2", "--pp",
                       "2", "--steps", "4"])
    for (la, ga), (lb, gb) in zip(three_d, one):
        assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-5)
    assert one[-1][0] < one[0][0]  # and it learns


def _varying_shapes(dynamic):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    ps = ParallelState.build(1, 2)
    model = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 1)],
                           num_stages=2, parallel_state=ps, partition_method="uniform",
                           loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                           dynamic_shapes=dynamic)
    engine, _, _, _ = megazero.initialize(model=model, config={"train_batch_size": 2})
    g = torch.Generator().manual_seed(0)
    learnt = []
    for rows in (3, 3, 5):  # the third batch's activations are [5, 4], not [3, 4]
        if rows == 5 and not dynamic:
            assert learnt == [(3, 4), (3, 4)]
        batch = [(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g))] * 2
        engine.train_batch(iter(batch))
        learnt.append(model.activation_shape)
    return learnt


def test_activation_shape_is_learnt_once_unless_dynamic():
    """The first batch's shape messages fix the shape (no shape round afterwards, as
    DeepSpeed); a later batch of another shape fails on the sending stage, naming both shapes
    and dynamic_shapes=True, with which it trains."""
    for learnt in run_distributed(_varying_shapes, 2, True):
        assert learnt == [None, None, None]
    with pytest.raises(Exception, match=r"shape \(5, 4\)[^\n]*\(3, 4\)[\s\S]*dynamic_shapes"):
        run_distributed(_varying_shapes, 2, False, fresh=True, timeout=60)
