"""Child process of tests/test_ops_cuda_fake.py (started with the fake CUDA runtime preloaded):
runs every fused op's Python face on fake CUDA tensors, as the dry run does, and prints one JSON
object per case: output metadata next to the PyTorch reference's, which inputs received a
gradient, and what ``DeviceOpCounter`` counted forward and backward (total and by op). Also
compiles each face with ``torch.compile(fullgraph=True)`` on the same fake tensors (a graph
break raises). ``--eager-cuda`` forces the eager path (the ops' CUDA route switched off), for
the before/after launch counts.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore

from megazero.dryrun.launches import DeviceOpCounter
from megazero.ops import cuda_fused, fused_dropout
from megazero.ops.fused_bias_gelu import bias_gelu_reference, fused_bias_gelu
from megazero.ops.fused_layer_norm import fused_layer_norm, layer_norm_reference
from megazero.ops.fused_rms_norm import fused_rms_norm, rms_norm_reference
from megazero.ops.fused_rope import fused_rope, rope_reference
from megazero.ops.fused_softmax import scaled_upper_triang_masked_softmax, softmax_reference
from megazero.ops.fused_swiglu import fused_bias_swiglu, swiglu_reference
from megazero.tensor_parallel.cross_entropy import (
    _VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)

BF16 = torch.bfloat16
S, B, H = 16, 2, 64


def leaf(*shape, dtype=BF16, grad=True):
    return torch.empty(*shape, dtype=dtype, device="cuda").requires_grad_(grad)


def meta(t):
    return None if t is None else {"shape": list(t.shape), "dtype": str(t.dtype),
                                   "device": t.device.type, "stride": list(t.stride()),
                                   "contiguous": t.is_contiguous()}


def ce_reference(logits, target, group, vocab_size):
    """The PyTorch formulation (fp32 copy of the logits, softmax saved)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, False)


def cases():
    """(name, face, reference, make inputs, names of the inputs) per case."""
    def dropout(p, training):
        face = lambda x, b, r: fused_dropout.fused_bias_dropout_add(x, b, r, p, training)
        ref = lambda x, b, r: fused_dropout.bias_dropout_add_reference(x, b, r, p, training, 1)
        return face, ref

    def rope_inputs():
        t = leaf(S, B, 4, 32, grad=False).permute(1, 2, 0, 3).requires_grad_()  # [b, h, s, hn]
        cos = torch.empty(1, 1, S, 16, dtype=BF16, device="cuda").expand(B, 1, S, 16)
        return t, cos, cos.clone()

    def ce_inputs(tp):
        labels = torch.empty(B, S, dtype=torch.int64, device="cuda")
        return leaf(S, B, 48), labels.transpose(0, 1), None if tp == 1 else dist.group.WORLD, 90

    ce = lambda logits, target, group, vocab: vocab_parallel_cross_entropy(
        logits, target, group, vocab_size=vocab)
    yield ("bias_gelu", fused_bias_gelu, bias_gelu_reference,
           lambda: (leaf(S, B, H), leaf(H)), ("x", "bias"))
    yield ("bias_gelu_frozen_bias", fused_bias_gelu, bias_gelu_reference,
           lambda: (leaf(S, B, H), leaf(H, grad=False)), ("x", "bias"))
    yield ("bias_dropout_add_train", *dropout(0.1, True),
           lambda: (leaf(S, B, H), leaf(H), leaf(S, B, H)), ("x", "bias", "residual"))
    yield ("bias_dropout_add_eval", *dropout(0.1, False),
           lambda: (leaf(S, B, H), leaf(H), leaf(S, B, H)), ("x", "bias", "residual"))
    yield ("bias_swiglu", fused_bias_swiglu, lambda y, b: swiglu_reference(y + b),
           lambda: (leaf(S, B, 2 * H), leaf(2 * H)), ("y", "bias"))
    yield ("rope", fused_rope, rope_reference, rope_inputs, ("t", "cos", "sin"))
    yield ("rms_norm", lambda x, w: fused_rms_norm(x, w, 1e-5),
           lambda x, w: rms_norm_reference(x, w, 1e-5), lambda: (leaf(S, B, H), leaf(H)),
           ("x", "weight"))
    yield ("layer_norm", lambda x, w, b: fused_layer_norm(x, w, b, 1e-5), layer_norm_reference,
           lambda: (leaf(S, B, H), leaf(H), leaf(H)), ("x", "weight", "bias"))
    yield ("causal_softmax", lambda s: scaled_upper_triang_masked_softmax(s, 0.5),
           lambda s: softmax_reference(s, 0.5), lambda: (leaf(4, S, S),), ("scores",))
    yield ("cross_entropy_tp1", ce, ce_reference, lambda: ce_inputs(1),
           ("logits", "target", "group", "vocab_size"))
    yield ("cross_entropy_tp2", ce, ce_reference, lambda: ce_inputs(2),
           ("logits", "target", "group", "vocab_size"))


def run_case(name, face, reference, make, names):
    counter = DeviceOpCounter("cuda")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, counter:
        inputs = make()
        expected = reference(*inputs)
        counter.start_iteration(0)
        with unset_fake_temporarily():
            rng = torch.get_rng_state()
        with counter.phase("forward_op"):
            out = face(*inputs)
        with unset_fake_temporarily():
            rng_kept = torch.equal(rng, torch.get_rng_state())
        fwd = counter.iterations[-1]
        counter.start_iteration(1)
        wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(out, wrt, torch.empty_like(out), allow_unused=True)
        bwd = counter.iterations[-1]
    with fake:  # dynamo refuses to trace under a non-infra dispatch mode (the counter)
        compiled = torch.compile(face, fullgraph=True, backend="eager")(*inputs)
    return {
        "out": meta(out), "cpu_rng_untouched": rng_kept, "expected": meta(expected),
        "compiled": meta(compiled),
        "grads": dict(zip([n for n, t in zip(names, inputs) if any(t is w for w in wrt)],
                          map(meta, grads))),
        "forward": fwd.kernel_launches, "forward_ops": dict(fwd.launches_by_op),
        "backward": bwd.launches_by_phase.get("backward", 0),
        "backward_ops": dict(bwd.launches_by_op),
        "other": {k: v for k, v in bwd.launches_by_phase.items() if k != "backward"},
    }


def main(argv):
    if "--eager-cuda" in argv:
        cuda_fused.cuda_route = lambda *t, **kw: False  # noqa: E731 - the faces' eager path
        for mod in ("cuda_elementwise", "cuda_rope_norm", "cuda_cross_entropy"):
            sys.modules[f"megazero.ops.{mod}"].cuda_route = cuda_fused.cuda_route
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    results = {}
    try:
        for name, face, reference, make, names in cases():
            torch._dynamo.reset()
            results[name] = run_case(name, face, reference, make, names)
    finally:
        dist.destroy_process_group()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
