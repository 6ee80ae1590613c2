"""Megatron-core's GPT training step (``GPTModel``, local spec), the way Megatron-LM runs it.

The model is ``GPTModel`` built from ``get_gpt_layer_local_spec()`` (Megatron-core's own
modules, no Transformer Engine) at GPT-2's shapes: learned absolute positions, LayerNorm
(eps 1e-5), tanh-GELU MLP of 4h with biases, tied output layer, the vocabulary padded to a
multiple of 128. It is trained as ``pretrain_gpt.py`` trains it on one GPU: bf16 weights in
``Float16Module``, Megatron's ``DistributedDataParallel`` (fp32 gradient buffer), its
optimizer (fp32 main parameters, clip 1.0) and the no-pipelining schedule with the micro-batch
count of the global batch.

Installed without Transformer Engine and Apex (``pip install megatron-core`` alone), Megatron
falls back to ``torch.optim.AdamW`` (foreach) and to Python loops for the multi-tensor ops its
Apex/TE users get as kernels; the loops read every gradient's norm on the host. Those two
loops are replaced here by torch's multi-tensor (``_foreach``) equivalents, so the step is what
a Megatron user's would be, not a slow fallback (``use_foreach_multi_tensor_ops``).

On fake CUDA (``count_launches.py``, a CPU-only torch with the dry run's fake runtime) a few
host-side CUDA queries are answered as an H100 would (``fake_cuda_shims``); they launch
nothing. Megatron-core is optional: everything imports it inside the functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass
class Shape:
    """A GPT-2 training job's shapes (megazero's flag names)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int
    vocab_size: int = 50257
    micro_batch_size: int = 8
    global_batch_size: int = 16
    dropout: float = 0.0  # hidden and attention
    make_vocab_size_divisible_by: int = 128

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


def import_error() -> str | None:
    """Why megatron-core cannot be imported, or None."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return f"megatron-core not importable ({exc}); pip install megatron-core (pure Python)"
    return None


class HostReadsAsOnes(TorchDispatchMode):
    """A value the host reads from a fake tensor (``.item()``, ``float(t)``) is 1 (a flag is
    False): fake tensors hold no values, and Megatron reads its grad norm (then clips: 1.0
    exceeds ``clip_grad / (1 + 1e-6)``) and torch's foreach AdamW its step count (0 would
    divide by zero in the bias correction) every step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            t = args[0]
            return False if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


def _bfloat16_in_place(module: torch.nn.Module) -> torch.nn.Module:
    """``Module.bfloat16`` by replacing the parameters (fake tensors cannot be swapped)."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != torch.bfloat16:
                q = torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)  # Megatron's attributes (tensor_model_parallel...)
                mod._parameters[name] = q
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(torch.bfloat16)
    return module


def _gather_object_of_one(object_list, obj, group=None):
    if dist.get_world_size(group) != 1:
        raise RuntimeError("the fake-CUDA Megatron-core run is a world of one")
    object_list[0] = obj


class _Uncoalesced:
    def wait(self):
        pass


@contextlib.contextmanager
def _uncoalesced(group=None, device=None, async_ops=False):
    """``dist._coalescing_manager`` with the collectives issued one by one: fake tensors have no
    ``allreduce_coalesced_``; Megatron's DDP puts the gradients in one bucket on one GPU, so
    one collective either way."""
    yield _Uncoalesced()


@contextlib.contextmanager
def fake_cuda_shims():
    """Host-side answers Megatron-core and autocast need on fake CUDA: device 0, bf16
    support, an all-gather of Python objects in a world of one, ``Module.bfloat16`` without
    swapping tensors, Megatron's gradient bucket collectives uncoalesced. None of them changes
    what a GPU would launch."""
    import torch.cuda.amp.common as amp_common
    saved = [(torch.cuda, "current_device"), (torch.cuda, "is_bf16_supported"),
             (amp_common, "amp_definitely_not_available"), (dist, "all_gather_object"),
             (torch.nn.Module, "bfloat16")]
    mcore_buffers = _megatron_module("megatron.core.distributed.param_and_grad_buffer")
    if mcore_buffers is not None:
        saved.append((mcore_buffers, "_coalescing_manager"))

    saved = [(obj, name, getattr(obj, name)) for obj, name in saved]
    if mcore_buffers is not None:
        mcore_buffers._coalescing_manager = _uncoalesced

    torch.cuda.current_device = lambda: 0
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    amp_common.amp_definitely_not_available = lambda: False
    dist.all_gather_object = _gather_object_of_one
    torch.nn.Module.bfloat16 = _bfloat16_in_place
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def _megatron_module(name: str):
    """The Megatron-core module ``name``, or None without megatron-core."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _foreach_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``: the norm of a tensor list ``[1]`` (fp32), on device."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1).float(), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``: ``dst = src * scale`` over two tensor lists."""
    src, dst = tensor_lists
    torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def use_foreach_multi_tensor_ops() -> bool:
    """Replace Megatron's Python-loop fallbacks of Apex's multi-tensor ops by torch's
    multi-tensor ones (True when it did: no Apex/TE)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = _foreach_l2norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    optimizer.multi_tensor_scale_impl = _foreach_scale
    return True


def init_parallel_state(fake: bool) -> None:
    """Megatron's parallel state for one rank: torch's fake process group on fake CUDA, else
    a world of one in memory (NCCL on a GPU, gloo on a CPU); the RNG tracker (without
    CUDA generators on fake CUDA: dropout's forks then draw nothing, launch the same)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import (
        initialize_rng_tracker,
        model_parallel_cuda_manual_seed,
    )
    if not dist.is_initialized():
        if fake:
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    if fake:
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        model_parallel_cuda_manual_seed(1234)


class MegatronCoreGPT:
    """Megatron-core's model, DDP, optimizer and schedule for ``shape`` on CUDA (real or fake).

    ``step(micro_batches)`` runs one iteration: zero the grad buffer, forward/backward of the
    micro-batches through Megatron's schedule (``forward_step`` wrapped by
    ``wrap_forward_step`` when given, e.g. a launch counter's), the optimizer step (inside
    ``optimizer_phase()`` when given)."""

    def __init__(self, shape: Shape, lr: float = 3e-4, weight_decay: float = 0.1):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig
        self.shape = shape
        self.foreach_ops = use_foreach_multi_tensor_ops()
        config = TransformerConfig(
            num_layers=shape.num_layers, hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_heads, hidden_dropout=shape.dropout,
            attention_dropout=shape.dropout, layernorm_epsilon=1e-5, add_bias_linear=True,
            activation_func=functools.partial(F.gelu, approximate="tanh"),
            init_method_std=0.02, bf16=True, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            # the fusions below need Apex/TE kernels (or a JIT of tanh-GELU Megatron lacks)
            bias_activation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False)
        with torch.device("cuda"):
            model = GPTModel(config, get_gpt_layer_local_spec(),
                             vocab_size=shape.padded_vocab_size,
                             max_sequence_length=shape.seq_length,
                             position_embedding_type="learned_absolute",
                             share_embeddings_and_output_weights=True)
        model = Float16Module(config, model)
        self.model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, bf16=True,
                            clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8),
            [self.model], use_gloo_process_groups=False)
        # torch's AdamW (Megatron's without Apex/TE) takes its multi-tensor path for CUDA
        # tensors of type Tensor: said explicitly, so that fake CUDA tensors take it too
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.optimizer.param_groups:
                if group.get("foreach", False) is None:
                    group["foreach"] = True
        # as megatron/training/training.py wires them
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.config = config

    def forward_step(self, data_iterator, model):
        """Megatron's GPT forward step: one micro-batch, the loss averaged over its tokens."""
        tokens, labels = next(data_iterator)
        tokens = tokens.to("cuda", non_blocking=True)  # [b, s]
        labels = labels.to("cuda", non_blocking=True)
        b, s = tokens.shape
        position_ids = torch.arange(s, device="cuda").unsqueeze(0).expand(b, s)  # [b, s]
        losses = model(tokens, position_ids, None, labels=labels)  # [b, s] fp32

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}
        return losses, loss_func

    def step(self, micro_batches, wrap_forward_step=None, optimizer_phase=None):
        """One iteration over ``micro_batches`` (a list of (tokens, labels) ``[b, s]``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        forward_step = self.forward_step
        if wrap_forward_step is not None:
            forward_step = wrap_forward_step(forward_step)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches),
            model=[self.model], num_microbatches=len(micro_batches),
            seq_length=self.shape.seq_length, micro_batch_size=self.shape.micro_batch_size,
            forward_only=False)
        with optimizer_phase() if optimizer_phase is not None else contextlib.nullcontext():
            self.optimizer.step()
