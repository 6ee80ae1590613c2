"""megazero's CUDA custom ops on fake CUDA (FakeTensorMode on this CPU-only torch, as the dry run
runs them): every fused chain of the transformer layer is one dispatched op forward, so the
dry run's ``DeviceOpCounter`` counts one launch; the backward counts are the documented ones;
outputs have the PyTorch reference's shape, dtype and strides; gradients reach every input;
``torch.compile(fullgraph=True)`` traces each op's face without a graph break. The same cases
with the CUDA route switched off give the eager counts they replace (the "before" column).

The cases run in a child process (tests/fake_cuda_ops_worker.py) with the fake CUDA runtime
preloaded (``megazero.dryrun.fake_cuda``: autograd over fake CUDA tensors needs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megazero.dryrun import fake_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# case -> ({op: launches} forward, {op: launches} backward) on the CUDA route
M = "megazero.{}.default".format
EXPECTED = {
    "bias_gelu": ({M("bias_gelu"): 1}, {M("bias_gelu_backward"): 1, M("column_sum"): 1}),
    "bias_gelu_frozen_bias": ({M("bias_gelu"): 1}, {M("bias_gelu_backward"): 1}),
    "bias_dropout_add_train": ({M("bias_dropout_add"): 1},
                               {M("bias_dropout_add_backward"): 1, M("column_sum"): 1}),
    # without dropout dx = dresidual = dy: only dbias's row sum launches
    "bias_dropout_add_eval": ({M("bias_dropout_add"): 1}, {"aten.sum.dim_IntList": 1}),
    "bias_swiglu": ({M("bias_swiglu"): 1}, {M("bias_swiglu_backward"): 1, M("column_sum"): 1}),
    "rope": ({M("rope"): 1}, {M("rope_backward"): 1}),
    # ATen's fused RMSNorm in one op each way; its backward launches 2 kernels on a GPU
    # (cuda_ops.KERNELS_PER_CALL), which the counter's MULTI_KERNEL counts
    "rms_norm": ({M("rms_norm"): 1}, {M("rms_norm_backward"): 2}),
    # ATen's LayerNorm, as before (the counter's MULTI_KERNEL counts its backward as 2)
    "layer_norm": ({"aten.native_layer_norm.default": 1},
                   {"aten.native_layer_norm_backward.default": 2}),
    "causal_softmax": ({M("causal_softmax"): 1}, {M("causal_softmax_backward"): 1}),
    "cross_entropy_tp1": ({M("vocab_ce_forward"): 1}, {M("vocab_ce_backward"): 1}),
    # three kernels around the two tp all-reduces (max, then target logit and sum together)
    "cross_entropy_tp2": ({M("vocab_ce_stats"): 1, "c10d.allreduce_.default": 2,
                           M("vocab_ce_rescale"): 1, M("vocab_ce_loss"): 1},
                          {M("vocab_ce_backward"): 1}),
}
INPUT_GRADS = {"bias_gelu": {"x", "bias"}, "bias_gelu_frozen_bias": {"x"},
               "bias_dropout_add_train": {"x", "bias", "residual"},
               "bias_dropout_add_eval": {"x", "bias", "residual"}, "bias_swiglu": {"y", "bias"},
               "rope": {"t"}, "rms_norm": {"x", "weight"}, "layer_norm": {"x", "weight", "bias"},
               "causal_softmax": {"scores"}, "cross_entropy_tp1": {"logits"},
               "cross_entropy_tp2": {"logits"}}


def _run_worker(*flags) -> dict:
    try:
        env = fake_cuda.preload_env()
    except fake_cuda.FakeCudaError as exc:
        pytest.skip(f"fake CUDA runtime unavailable: {exc}")
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fake_cuda_ops_worker.py"),
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fused():
    return _run_worker()


@pytest.fixture(scope="module")
def eager():
    return _run_worker("--eager-cuda")


def test_every_case_ran(fused):
    assert set(fused) == set(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_launches_forward_and_backward(fused, case):
    forward, backward = EXPECTED[case]
    got = fused[case]
    assert got["forward_ops"] == forward
    assert got["forward"] == sum(forward.values())
    assert got["backward_ops"] == backward
    assert got["backward"] == sum(backward.values())
    assert not got["other"], got["other"]  # nothing outside forward and backward
    # fake tensors take the fake implementations: the dropout draws no seed from any generator
    assert got["cpu_rng_untouched"]


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_outputs_match_the_reference_and_gradients_reach_inputs(fused, case):
    got = fused[case]
    assert got["out"]["device"] == "cuda"
    assert got["out"] == got["expected"]  # shape, dtype, strides of the PyTorch formula's
    assert got["compiled"] == got["out"]  # torch.compile(fullgraph=True) traced it
    assert set(got["grads"]) == INPUT_GRADS[case]
    for name, grad in got["grads"].items():
        assert grad is not None and grad["device"] == "cuda", name


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_fused_chains_launch_fewer_kernels_than_eager(fused, eager, case):
    before, after = eager[case], fused[case]
    if case == "bias_dropout_add_train":  # eager: F.dropout's fake mask costs no host draw
        assert before["cpu_rng_untouched"]
    assert before["out"] == after["out"]
    if case == "layer_norm":  # ATen's either way
        assert before["forward_ops"] == after["forward_ops"]
        return
    assert after["forward"] < before["forward"] or after["forward"] == 1
    assert after["forward"] + after["backward"] < before["forward"] + before["backward"]
    assert not any(op.startswith("megazero.") for op in before["forward_ops"])
