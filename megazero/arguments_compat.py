"""Megatron-LM flags beyond megazero's own: the ones megazero honours with Megatron's meaning
through another setting, and the ones it refuses, each refusal naming what to do instead.

A Megatron launch script runs unchanged when all its flags are known. Here live the flags
whose meaning megazero already has under another name or by construction (``--use-mcore-models``:
megazero has one GPT model; ``--use-distributed-optimizer``: ZeRO-1 over dp;
``--no-gradient-accumulation-fusion``: megazero never fuses it), translated into the config by
``apply_compat`` before validation, and the flags megazero does not have (FP8, decoupled
learning rates, TikToken, ...), which ``refusals`` turns into one ``ConfigError`` naming every
such flag given and its alternative. No flag is parsed and then ignored.
``tests/megatron_flags.txt`` lists the flags of Megatron-LM's GPT and Llama example scripts
with their status; a test runs the parser over all of them.
"""

from __future__ import annotations

import argparse

from megazero.config import ConfigError

# flag -> what to do instead
REFUSED = {
    "--fp8-format": "megazero has no FP8 training; use --bf16",
    "--fp8-margin": "megazero has no FP8 training; use --bf16",
    "--fp8-interval": "megazero has no FP8 training; use --bf16",
    "--fp8-amax-history-len": "megazero has no FP8 training; use --bf16",
    "--fp8-amax-compute-algo": "megazero has no FP8 training; use --bf16",
    "--fp8-param-gather": "megazero has no FP8 training; use --bf16",
    "--keep_fp8_weight_transpose_cache": "megazero has no FP8 training; use --bf16",
    "--decoupled-lr": "megazero trains every parameter at --lr; drop --decoupled-lr",
    "--decoupled-min-lr": "megazero decays every parameter to --min-lr; drop it",
    "--grad-reduce-in-bf16": "gradients are reduced in the parameters' dtype (fp32 main "
                             "gradients with --bf16); drop the flag",
    "--calculate-per-token-loss": "megazero averages each micro-batch's per-token mean loss "
                                  "(Megatron's default); drop the flag",
    "--apply-layernorm-1p": "megazero's norms hold the weight itself (initialised to 1); "
                            "drop the flag",
    "--tiktoken-pattern": "the TikToken tokenizer is not available; use --tokenizer-type "
                          "SentencePieceTokenizer or GPT2BPETokenizer",
    "--no-mmap-bin-files": "megazero reads the .bin files through mmap only; drop the flag",
    "--use-torch-fsdp2": "use --zero-stage 3 (megazero's ZeRO-3 shards parameters, gradients "
                         "and optimizer states over dp)",
    "--use-contiguous-parameters-in-local-ddp": "megazero's ZeRO keeps gradients in "
                                                "contiguous buckets; drop the flag",
    "--ckpt-format": "megazero writes its own layout-free checkpoints (loadable at any "
                     "tp/pp/dp); drop the flag, and convert with python -m "
                     "megazero.tools.checkpoint",
    "--zero-allgather-bucket-size": "parameters are all-gathered in the gradient buckets; "
                                    "use --zero-reduce-bucket-size",
}
# Megatron's tokenizers that megazero does not have (parsed so that the refusal names them)
UNSUPPORTED_TOKENIZERS = ("HuggingFaceTokenizer", "TikTokenizer", "Llama2Tokenizer",
                          "GPTSentencePieceTokenizer", "BertWordPieceLowerCase",
                          "BertWordPieceCase", "MultimodalTokenizer")

# flag -> (the values that have Megatron's meaning in megazero, what to do otherwise)
RESTRICTED = {
    "--transformer-impl": (("local",), "megazero's layers are its own (Megatron's 'local'); "
                                       "Transformer Engine is not available"),
    "--context-parallel-size": (("1",), "megazero has no context parallelism; use "
                                        "--sequence-parallel with --tensor-model-parallel-size"),
    "--rerun-mode": (("disabled",), "megazero does not re-run iterations to check results"),
    "--dataloader-type": (("single",), "megazero's sampler walks the shuffled dataset in order "
                                       "(Megatron's 'single')"),
    "--DDP-impl": (("local",), "megazero's data parallelism is its own; use --zero-stage 0 "
                              "for plain bucketed all-reduce"),
    "--data-impl": (("mmap", "infer"), "megazero reads Megatron's mmap format"),
}


# Megatron flags whose request megazero always fulfils (nothing to switch): flag -> why
ALWAYS_SO = {
    "--use-mcore-models": "megazero has one GPT model, with Megatron-core's architecture",
    "--use-legacy-models": "megazero has one GPT model (the same as --use-mcore-models)",
    "--use-cpu-initialization": "initialisation is always drawn per full tensor from a CPU "
                                "generator (layout-invariant)",
    "--cross-entropy-loss-fusion": "the vocab-parallel cross entropy is always fused (in "
                                   "place over the logits)",
    "--no-async-tensor-model-parallel-allreduce": "megazero's tp all-reduce is never "
                                                  "asynchronous",
    "--no-gradient-accumulation-fusion": "megazero never fuses the weight-gradient "
                                         "accumulation into the GEMM",
    "--no-query-key-layer-scaling": "megazero never scales the attention scores by the "
                                    "layer number (Megatron-DeepSpeed's query-key layer "
                                    "scaling)",
}


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """The Megatron flags that megazero honours through other settings, and the refused ones
    (parsed so that the error can name them)."""
    g = parser.add_argument_group(
        "Megatron flags with Megatron's meaning through megazero's own settings")
    for flag, why in ALWAYS_SO.items():
        g.add_argument(flag, action="store_true", help=f"always so: {why}")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: ZeRO-1 over dp (--zero-stage 1 "
                        "unless a higher stage is given)")
    g.add_argument("--recompute-activations", dest="megatron_recompute_activations",
                   action="store_true",
                   help="Megatron-LM's: selective recompute of the attention core "
                        "(--recompute-granularity selective); --checkpoint-activations "
                        "recomputes whole layers")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="no learned absolute position embedding (--position-embedding-type "
                        "none unless rope)")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="Megatron-DeepSpeed's: key/value heads (--group-query-attention "
                        "--num-query-groups N when fewer than the attention heads)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head; must equal --hidden-size / "
                        "--num-attention-heads")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="attention through PyTorch's flash kernel (--attention-backend flash)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion",
                   action="store_false", default=True,
                   help="attention as explicit matmul + softmax (--attention-backend unfused)")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true",
                   help="megazero builds no mask unless --reset-attention-mask (causal "
                        "attention needs none)")
    for flag, (values, why) in RESTRICTED.items():
        g.add_argument(flag, dest=_dest(flag), default=None,
                       help=f"only {' or '.join(values)} ({why})")
    r = parser.add_argument_group("Megatron flags megazero refuses (each names an alternative)")
    for flag, why in REFUSED.items():
        r.add_argument(flag, dest=_dest(flag), nargs="*", default=None,
                       help=f"refused: {why}")


def _key_value_heads(ns: argparse.Namespace) -> None:
    """--num-key-value-heads N: grouped-query attention with N groups (fewer than the heads),
    or plain multi-head attention (as many as the heads)."""
    n = ns.num_key_value_heads
    if n < 1 or (ns.num_attention_heads and ns.num_attention_heads % n):
        raise ConfigError(f"--num-key-value-heads must be an integer >= 1 dividing "
                          f"--num-attention-heads ({ns.num_attention_heads}), got {n}")
    if ns.num_query_groups is not None and ns.num_query_groups != n:
        raise ConfigError(f"--num-key-value-heads {n} contradicts --num-query-groups "
                          f"{ns.num_query_groups}")
    if n != ns.num_attention_heads:
        ns.group_query_attention, ns.num_query_groups = True, n


def _dest(flag: str) -> str:
    return "compat_" + flag.lstrip("-").replace("-", "_").lower()


def refusals(ns: argparse.Namespace) -> list[str]:
    """One line per refused flag given, or restricted flag given another value."""
    lines = []
    for flag, why in REFUSED.items():
        if getattr(ns, _dest(flag), None) is not None:
            lines.append(f"{flag} is not supported: {why}")
    for flag, (values, why) in RESTRICTED.items():
        value = getattr(ns, _dest(flag), None)
        if value is not None and value not in values:
            lines.append(f"{flag} {value} is not supported (only {' or '.join(values)}): {why}")
    return lines


def apply_compat(ns: argparse.Namespace) -> None:
    """Translate the honoured flags into megazero's settings (in the namespace), or raise a
    ``ConfigError`` naming every refused flag given."""
    lines = refusals(ns)
    if ns.kv_channels is not None and ns.kv_channels < 1:
        lines.append(f"--kv-channels must be an integer >= 1, got {ns.kv_channels}")
    elif ns.kv_channels is not None and ns.kv_channels * ns.num_attention_heads \
            != ns.hidden_size:
        lines.append(f"--kv-channels {ns.kv_channels} is not --hidden-size "
                     f"({ns.hidden_size}) / --num-attention-heads ({ns.num_attention_heads}): "
                     "megazero's heads have hidden/heads channels; drop --kv-channels or "
                     "change the head count")
    if ns.tokenizer_type in UNSUPPORTED_TOKENIZERS:
        lines.append(f"--tokenizer-type {ns.tokenizer_type} is not supported: use "
                     "SentencePieceTokenizer with --tokenizer-model (a sentencepiece "
                     "tokenizer.model), GPT2BPETokenizer with --vocab-file and --merge-file, "
                     "or NullTokenizer for pre-tokenized ids")
    if ns.no_create_attention_mask_in_dataloader and ns.reset_attention_mask:
        lines.append("--no-create-attention-mask-in-dataloader contradicts "
                     "--reset-attention-mask, whose document masks the data loader builds")
    if lines:
        raise ConfigError("; ".join(lines))
    if ns.megatron_recompute_activations:
        if ns.recompute_granularity == "full" or ns.recompute_activations:
            raise ConfigError(
                "--recompute-activations is Megatron-LM's selective recompute: it contradicts "
                + ("--recompute-granularity full" if ns.recompute_granularity == "full"
                   else "--checkpoint-activations")
                + " (whole layers); give one of them")
        ns.recompute_granularity = "selective"
    if ns.use_distributed_optimizer and ns.zero_stage == 0:
        ns.zero_stage = 1
    if ns.num_key_value_heads is not None:
        _key_value_heads(ns)
    if ns.no_position_embedding and ns.position_embedding_type == "learned_absolute":
        ns.position_embedding_type = "none"
    if ns.use_flash_attn:
        if ns.attention_backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn contradicts --attention-backend "
                              f"{ns.attention_backend}")
        ns.attention_backend = "flash"
    if not ns.masked_softmax_fusion:
        if ns.attention_backend not in ("auto", "unfused", "local"):
            raise ConfigError(
                "--no-masked-softmax-fusion asks for the unfused attention: it contradicts "
                + ("--use-flash-attn" if ns.use_flash_attn
                   else f"--attention-backend {ns.attention_backend}"))
        if ns.attention_backend == "auto":
            ns.attention_backend = "unfused"
