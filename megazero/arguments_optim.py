"""Flags of the optimizer, learning rate, mixed precision and ZeRO (``OptimizerConfig``). Part
of ``megazero.arguments``' parser."""

from __future__ import annotations

from megazero.arguments_model import FlagGroup
from megazero.config import OptimizerConfig


def add_optimizer_args(parser):
    g = FlagGroup(parser, "optimizer and learning rate", OptimizerConfig)
    g.add("--optimizer", choices=["adam", "lamb", "sgd", "onebitadam", "zerooneadam"])
    g.add("--var-freeze-step", type=int,
          help="zerooneadam: the last step that updates the variance (DeepSpeed's)")
    g.add("--var-update-scaler", type=int,
          help="zerooneadam: variance updates between doublings of their interval")
    g.add("--local-step-scaler", type=int,
          help="zerooneadam: steps between doublings of the local-step interval")
    g.add("--local-step-clipper", type=int,
          help="zerooneadam: the largest local-step interval")
    g.add("--freeze-step", type=int,
          help="onebitadam: Adam steps with full-precision gradients before the variance is "
               "frozen and momenta travel 1-bit compressed (DeepSpeed's freeze_step)")
    g.add("--lr", type=float)
    g.add("--min-lr", type=float)
    g.add("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root",
                                       "WSD"])
    g.add("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential", "minus_sqrt"],
          help="WSD's final decay (default exponential, as Megatron)")
    g.add("--lr-wsd-decay-iters", type=int, help="WSD: iterations of the final decay")
    g.add("--lr-wsd-decay-samples", type=int, help="WSD: samples of the final decay")
    g.add("--lr-warmup-fraction", type=float)
    g.add("--lr-warmup-iters", type=int)
    g.add("--lr-warmup-samples", type=int)
    g.add("--lr-decay-iters", type=int)
    g.add("--lr-decay-samples", type=int)
    for name in ("weight-decay", "adam-beta1", "adam-beta2", "adam-eps"):
        g.add(f"--{name}", type=float)
    g.add("--adam-w-mode", action="store_true",
          help="decoupled weight decay (AdamW); --no-adam-w-mode: L2")
    g.add("--no-adam-w-mode", field="adam_w_mode", action="store_false")
    g.add("--no-adam-bias-correction", field="adam_bias_correction", action="store_false",
          help="Adam without its bias corrections (DeepSpeed's bias_correction: false)")
    g.add("--sgd-momentum", type=float)
    g.add("--clip-grad", type=float)

    g = FlagGroup(parser, "mixed precision", OptimizerConfig)
    g.add("--fp16", action="store_true")
    g.add("--bf16", action="store_true")
    g.add("--loss-scale", type=float,
          help="constant loss scale; unset means dynamic scaling with --fp16")
    g.add("--initial-loss-scale", type=float)
    g.add("--min-loss-scale", type=float)
    g.add("--loss-scale-window", type=int)
    g.add("--hysteresis", type=int)

    g = FlagGroup(parser, "ZeRO", OptimizerConfig)
    g.add("--zero-stage", type=int, choices=[0, 1, 2, 3])
    g.add("--zero-reduce-bucket-size", "--ddp-bucket-size", field="zero_reduce_bucket_size",
          type=int, help="elements per gradient bucket (default: from the model size, "
          "several buckets in flight)")
    g.add("--overlap-grad-reduce", "--zero-overlap-comm", field="overlap_grad_reduce",
          action="store_true", help="reduce-scatter each gradient bucket during the rest of "
          "the backward (the default)")
    g.add("--no-overlap-grad-reduce", field="overlap_grad_reduce", action="store_false",
          help="reduce the gradient buckets after the backward instead")
    g.add("--overlap-param-gather", field="overlap_param_gather", action="store_true",
          help="ZeRO 1-2: all-gather updated parameters during the next forward, each layer "
          "waiting for its own bucket (the default; ZeRO-3 prefetches units in forward and "
          "backward, see --no-zero-prefetch)")
    g.add("--no-overlap-param-gather", field="overlap_param_gather", action="store_false",
          help="all-gather updated parameters inside the optimizer step instead")
    g.add("--zero-param-persistence-threshold", type=int)
    g.add("--no-zero-prefetch", field="zero_prefetch", action="store_false")
    g.add("--zero-max-live-parameters", type=int,
          help="ZeRO-3: prefetch the next unit only while the gathered parameters stay at or "
               "below this many elements (DeepSpeed's stage3_max_live_parameters)")
    g.add("--zero-prefetch-bucket-size", type=int,
          help="ZeRO-3: prefetch the units ahead while their elements sum to at most this "
               "(DeepSpeed's stage3_prefetch_bucket_size; default: the next unit only)")
    g.add("--no-zero3-order-check", field="zero3_order_check", action="store_false",
          help="skip ZeRO-3's check that dp ranks issue collectives in one order (a tiny "
               "all-gather before each; on by default)")
    g.add("--cpu-offload", "--zero-offload-optimizer", field="cpu_offload",
          action="store_true")
    g.add("--offload-optimizer", choices=["cpu", "nvme"],
          help="cpu: --cpu-offload; nvme: fp32 main values and moments in files under "
               "--nvme-path, streamed through the host (ZeRO-Infinity)")
    g.add("--offload-param", choices=["nvme"],
          help="nvme (ZeRO-3): this rank's parameter partition in files under --nvme-path, "
               "read when a unit is gathered (ZeRO-Infinity); needs --offload-optimizer")
    g.add("--nvme-path", help="a directory on a fast disk for --offload-optimizer/--offload-"
                              "param nvme")
    g.add("--nvme-sub-group-size", type=int,
          help="elements per streamed sub-group of --offload-optimizer nvme")
    g.add("--nvme-threads", type=int, help="I/O threads of --offload-optimizer nvme")
    g.add("--nvme-block-size", type=int, help="bytes per I/O piece of the NVMe offload "
          "(1 MiB; DeepSpeed's aio.block_size)")
    g.add("--nvme-buffer-count", type=int, help="host slots --offload-optimizer nvme streams "
          "its sub-groups through (2; DeepSpeed's offload_optimizer.buffer_count)")
    g.add("--cpu-torch-adam", "--cpu_torch_adam", action="store_true",
          help="use torch.optim.AdamW even when megazero's CPU Adam is built")
    g.add("--ds_fused_adam", "--ds-fused-adam", field="use_fused_step", action="store_true",
          help="Megatron-DeepSpeed's flag: the fused Adam step (megazero's kernel; the "
               "default)")
    g.add("--no-fused-optimizer-step", field="use_fused_step", action="store_false",
          help="run the PyTorch reference of the fused optimizer step instead of the kernel")
