"""GPT-2 or a Llama-family model (or one pipeline stage of it), tensor-parallel over the tp
group.

A ``GPTModel`` holds a set of layers given by their global indices (a whole model, a pipeline
stage, or one virtual chunk of the interleaved schedule). ``pre_process`` (first stage) adds the
word embedding and, with ``--position-embedding-type learned_absolute`` (GPT-2's), the position
embedding; ``post_process`` (last stage) adds the final norm, the output layer and the
vocab-parallel loss. The output layer is tied to the word embedding (GPT-2) or has a weight of
its own (``--untie-embeddings-and-output-weights``: ``output_layer.weight``, vocab-parallel
like the embedding). Tied, on a last stage that is not also first, the word embedding is a
separate copy with the same name (so the same initial values) whose gradient the optimizer
all-reduces over the embedding group. With RoPE, every stage computes the rotary tables from
the position ids it is given (``[b, s]``; arange when None).

With ``--compile`` each layer's forward goes through ``torch.compile``
(``megazero.model.compile``).

Parameter names do not depend on the layout (``layers.<global index>....``), so one seed gives
the same full model for any split, and checkpoints can be reassembled at another layout.
Inputs are ``[b, s]`` like Megatron's; inside, activations are ``[s, b, h]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig
from megazero.distributed.parallel_state import ParallelState
from megazero.model.compile import LayerCompile
from megazero.model.fused import make_norm
from megazero.model.rotary import rotary_tables
from megazero.model.transformer import TransformerLayer
from megazero.tensor_parallel import (
    VocabParallelEmbedding,
    checkpoint,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    init_normal,
    initialize_parameters,
    vocab_parallel_cross_entropy,
)
from megazero.tensor_parallel.meta import ParamMeta, set_meta, update_meta
from megazero.tensor_parallel.random import RNGStatesTracker


class Embedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings (if any), then dropout."""

    def __init__(self, config: ModelConfig, ps: ParallelState, *, with_positions: bool,
                 sequence_parallel: bool, tracker, device=None):
        super().__init__()
        dtype = config.torch_dtype
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=ps.tp_group,
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            sequence_parallel=sequence_parallel, init_method=init_normal(config.init_method_std),
            params_dtype=dtype, device=device)
        self.position_embeddings = None
        if with_positions:
            shape = (config.max_position_embeddings, config.hidden_size)
            # On meta, skip torch's default init: it draws nothing there but goes through
            # torch._refs, which imports torch._dynamo (~100 MB resident per rank, ZeRO-3)
            weight = torch.empty(shape, dtype=dtype, device=device) \
                if device is not None and torch.device(device).type == "meta" else None
            self.position_embeddings = nn.Embedding(*shape, dtype=dtype, device=device,
                                                    _weight=weight)
            # each tp rank sees its part of the sequence: a partial gradient with sp
            set_meta(self.position_embeddings.weight, ParamMeta.replicated(
                self.position_embeddings.weight.shape, init=init_normal(config.init_method_std),
                sequence_parallel=sequence_parallel))
        self.dropout_p = config.hidden_dropout
        self.sequence_parallel, self.tracker = sequence_parallel, tracker
        self.tp_size, self.tp_rank = ps.tp_size, ps.tp_rank

    def forward(self, input_ids, position_ids):
        ids = input_ids.transpose(0, 1)  # [s, b]
        x = self.word_embeddings(ids)  # [s, b, h] (or [s/tp, b, h], reduce-scattered)
        if self.position_embeddings is not None:
            pos = position_ids.transpose(0, 1)  # [s, b]
            if self.sequence_parallel and self.tp_size > 1:
                pos = pos.chunk(self.tp_size, dim=0)[self.tp_rank]  # this rank's part of s
            x = x + self.position_embeddings(pos)
        if self.sequence_parallel and self.tracker is not None and self.training:
            with self.tracker.fork():
                return F.dropout(x, self.dropout_p, self.training)
        return F.dropout(x, self.dropout_p, self.training)


class TiedOutputLayer(nn.Module):
    """Logits ``[s, b, Vp/tp]`` from hidden ``[s, b, h]`` with the word embedding's weight.

    Holds no parameter of its own (the weight is passed in), so ZeRO-3 knows to gather the
    embedding before it runs (see ``gpt_zero3_units``).
    """

    def forward(self, x, weight):
        return F.linear(x, weight)


class UntiedOutputLayer(VocabParallelEmbedding):
    """Logits ``[s, b, Vp/tp]`` from hidden ``[s, b, h]`` with a weight of its own, sharded
    and padded over the vocabulary as the word embedding (``output_layer.weight``)."""

    def forward(self, x, weight=None):
        return F.linear(x, self.weight)


class GPTModel(nn.Module):
    """GPT-2 layers ``layer_numbers`` (global, 0-based) with optional embedding and head."""

    def __init__(self, config: ModelConfig, ps: ParallelState, *,
                 tracker: RNGStatesTracker | None = None, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: list[int] | None = None,
                 sequence_parallel: bool = False, seed: int | None = None, device=None):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size is not set (it comes from the tokenizer)")
        self.config, self.ps, self.tracker = config, ps, tracker
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and ps.tp_size > 1
        if layer_numbers is None:
            layer_numbers = list(range(config.num_layers))
        self.layer_numbers = list(layer_numbers)
        sp = self.sequence_parallel
        self.tied = not config.untie_embeddings_and_output_weights
        self.embedding = None
        if pre_process or (post_process and self.tied):
            # Tied, the last stage holds the word embedding too (its output layer).
            positions = pre_process and config.position_embedding_type == "learned_absolute"
            self.embedding = Embedding(config, ps, with_positions=positions,
                                       sequence_parallel=sp, tracker=tracker, device=device)
            # With pp > 1 the first and last stages each hold the tied word embedding; its
            # gradient is all-reduced over the embedding group, and the grad norm counts only
            # the first stage's copy.
            update_meta(self.embedding.word_embeddings.weight,
                        tied_embedding=self.tied and ps.pp_size > 1,
                        shared_embedding=self.tied and post_process and not pre_process)
        # --compile: how the layers are built (fused ops off) and run (megazero.model.compile)
        self.layer_compile = LayerCompile.for_config(config)
        layer_config = self.layer_compile.layer_config(config)
        layer_tracker = self.layer_compile.layer_tracker(tracker, ps.tp_size)
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(layer_config, ps.tp_group, layer_tracker,
                                     sequence_parallel=sp, device=device)
            for i in self.layer_numbers})
        self.final_layernorm = None
        self.output_layer = None
        if post_process:
            self.final_layernorm = make_norm(config, sp, device)
            self.output_layer = TiedOutputLayer() if self.tied else UntiedOutputLayer(
                config.vocab_size, config.hidden_size, tp_group=ps.tp_group,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                init_method=init_normal(config.init_method_std),
                params_dtype=config.torch_dtype, device=device)
        self.input_tensor = None
        if seed is not None:
            initialize_parameters(self, seed)
        for layer in self.layers.values():
            self.layer_compile.apply(layer, ps.tp_size)

    # ---- pipeline plumbing ---------------------------------------------------------------
    def set_input_tensor(self, tensor):
        """Activation received from the previous pipeline stage (``[s, b, h]``)."""
        self.input_tensor = tensor

    @property
    def word_embedding_weight(self):
        return self.embedding.word_embeddings.weight if self.embedding is not None else None

    @property
    def output_weight(self):
        """The output layer's weight ``[Vp/tp, h]`` (the word embedding's when tied)."""
        return self.word_embedding_weight if self.tied else self.output_layer.weight

    def _rotary(self, position_ids, s: int, kv_cache):
        """RoPE's (cos, sin) ``[b, 1, s, rot]`` for this forward, or None without RoPE."""
        rot = self.config.rotary_dim
        if rot == 0:
            return None
        if position_ids is None:
            start = kv_cache.offset if kv_cache is not None else 0
            device = self.input_tensor.device if self.input_tensor is not None else None
            position_ids = torch.arange(start, start + s, device=device).unsqueeze(0)
        return rotary_tables(position_ids, rot, self.config.rotary_base,
                             self.config.torch_dtype)

    # ---- forward -------------------------------------------------------------------------
    def _run_layers(self, x, attention_mask, kv_cache=None, rotary=None):
        layers = list(self.layers.values())
        cfg = self.config
        if kv_cache is not None or not (cfg.recompute_activations and self.training):
            for layer in layers:
                x = layer(x, attention_mask, kv_cache=kv_cache, rotary=rotary)
            return x
        group = self.ps.tp_group if cfg.partition_activations else None
        n = cfg.recompute_num_layers
        # uniform: chunks of n layers, each recomputed as one; block: the first n layers of
        # this chunk recomputed one by one, the others not at all (Megatron's methods)
        if cfg.recompute_method == "block":
            blocks = [layers[i:i + 1] for i in range(len(layers))]
            recomputed = min(n, len(layers))
        else:
            blocks = [layers[i:i + n] for i in range(0, len(layers), n)]
            recomputed = len(blocks)
        for i, block in enumerate(blocks):

            def run(h, mask=attention_mask, block=block):
                for layer in block:
                    h = layer(h, mask, rotary=rotary)
                return h

            x = checkpoint(run, x, tracker=self.tracker, partition_group=group,
                           offload=cfg.checkpoint_in_cpu) \
                if i < recomputed else run(x)
        return x

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None,
                kv_cache=None):
        """First stage: ids ``[b, s]``; other stages: the tensor from ``set_input_tensor``.

        Returns the per-token loss ``[b, s]`` (last stage, with labels), the vocab-parallel
        logits ``[b, s, Vp/tp]`` (last stage, no labels) or the hidden states ``[s, b, h]``
        for the next stage. With ``kv_cache`` (a ``KVCache``; inference, no sequence
        parallelism) the ids are the positions after those already cached, and
        ``position_ids`` must number them from ``kv_cache.offset``.
        """
        if kv_cache is not None:
            if self.sequence_parallel:
                raise ValueError("a KV cache needs the model built without sequence "
                                 "parallelism")
            kv_cache.reserve(input_ids.shape[1] if self.pre_process
                             else self.input_tensor.shape[0])
        if self.pre_process:
            x = self.embedding(input_ids, position_ids)
        else:
            x = self.input_tensor
            if x is None:
                raise RuntimeError("pipeline stage called without set_input_tensor()")
        s = input_ids.shape[1] if self.pre_process else x.shape[0] * (
            self.ps.tp_size if self.sequence_parallel else 1)
        x = self._run_layers(x, attention_mask, kv_cache, self._rotary(position_ids, s, kv_cache))
        if kv_cache is not None:
            kv_cache.advance(x.shape[0])
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.ps.tp_group)  # [s, b, h]
        else:
            x = copy_to_tp_region(x, self.ps.tp_group)
        logits = self.output_layer(x, self.output_weight)  # [s, b, Vp/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        # fp32 loss; the logits buffer is consumed in place (it is not needed afterwards)
        # unless it is a view (module hooks, e.g. ZeRO-3's, wrap outputs in views).
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.ps.tp_group,
                                            vocab_size=self.config.vocab_size,
                                            inplace=logits._base is None)  # [s, b]
        return loss.transpose(0, 1).contiguous()  # [b, s]


def gpt_zero3_units(chunk: GPTModel) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO-3's unit policy for a GPT chunk: (module path, modules that need its parameters).

    The embedding is one unit, used by the embedding and, on the last stage, by the tied
    output layer (which holds no parameter of its own); each layer and the final norm is
    one, and so is an untied output layer. Passed to the optimizer by the caller
    (``pretrain(..., zero3_unit_policy=...)``).
    """
    units = []
    if chunk.embedding is not None:
        users = ([chunk.embedding] if chunk.pre_process else []) \
            + ([chunk.output_layer] if chunk.post_process and chunk.tied else [])
        units.append(("embedding", users))
    units += [(f"layers.{i}", [layer]) for i, layer in chunk.layers.items()]
    if chunk.final_layernorm is not None:
        units.append(("final_layernorm", [chunk.final_layernorm]))
    if chunk.output_layer is not None and not chunk.tied:
        units.append(("output_layer", [chunk.output_layer]))
    return units


def stage_layer_numbers(num_layers: int, pp_size: int, pp_rank: int,
                        virtual_size: int | None = None, chunk: int = 0) -> list[int]:
    """Global layer indices of pipeline rank ``pp_rank`` (virtual chunk ``chunk``).

    Plain: stage r holds layers ``[r * L/p, (r+1) * L/p)``. Interleaved with v chunks, chunk c
    of stage r holds ``[(c * p + r) * L/(p v), ...)`` (Megatron's assignment).
    """
    v = virtual_size or 1
    per = num_layers // (pp_size * v)
    start = (chunk * pp_size + pp_rank) * per
    return list(range(start, start + per))
