"""``ParallelConfig`` (the rank grid's sizes) and ``OptimizerConfig`` (optimizer, learning-rate
schedule, precision and loss scaling, ZeRO)."""

from __future__ import annotations

from dataclasses import dataclass

from megazero.config.checks import (
    Needs,
    _check,
    _finite,
    _in_unit,
    _int_at_least,
    _optional_int_at_least,
    check_modes,
)

IO_ALIGN = 4096  # bytes: megazero.ops.aio.ALIGN (tests/test_deepspeed_keys.py holds them equal)

# The flags that act in one mode only (``Needs``): given outside it, refused by name. Checked
# by value too: the NVMe offload's sizes, whose mode no rebuilt config loses, and
# --zero-prefetch-bucket-size (so checked before these tables); not the other ZeRO-3 knobs,
# since generation and conversion rebuild a saved config at ZeRO-0.
PARALLEL_MODES = (
    Needs(("--num-layers-per-virtual-pipeline-stage",), "virtual_pipeline_model_parallel_size",
          lambda p: p.pipeline_model_parallel_size > 1,
          "splits each pipeline stage into virtual stages",
          "--pipeline-model-parallel-size > 1 (got {pipeline_model_parallel_size})"),
    Needs(("--no-overlap-p2p-communication", "--overlap-p2p-communication"),
          "overlap_p2p_comm", lambda p: p.virtual_pipeline_model_parallel_size is not None,
          "sets how the interleaved schedule waits for its p2p exchanges",
          "the interleaved schedule (--num-layers-per-virtual-pipeline-stage below the layers "
          "per pipeline stage)"),
    Needs(("--ring-collectives",), "ring_collectives", lambda p: p.distributed_backend != "nccl",
          "picks gloo's reduce-scatter/all-gather", "the gloo backend (got "
          "--distributed-backend nccl)"),
)

_ADAMS = ("adam", "onebitadam", "zerooneadam")
_DECAYS = ("linear", "cosine", "WSD")


def _decays(o) -> bool:
    return o.lr_decay_style in _DECAYS or o.lr_warmup_fraction is not None


def _dynamic_scale(o) -> bool:
    return o.fp16 and o.loss_scale is None


_ZERO3 = "--zero-stage 3 (got {zero_stage})"
_PREFETCHING = _ZERO3 + " without --no-zero-prefetch"
OPTIMIZER_MODES = (
    Needs(("--freeze-step",), "freeze_step", lambda o: o.optimizer == "onebitadam",
          "sets 1-bit Adam's uncompressed steps", "--optimizer onebitadam (got {optimizer})"),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda o: o.optimizer == "zerooneadam",
            "tunes 0/1 Adam's intervals", "--optimizer zerooneadam (got {optimizer})")
      for flag in ("--var-freeze-step", "--var-update-scaler", "--local-step-scaler",
                   "--local-step-clipper")),
    Needs(("--lr",), "lr", lambda o: o.ds_scheduler in (None, "WarmupCosineLR"),
          "sets the peak learning rate", "no ds_config scheduler, or WarmupCosineLR (the "
          "ds_config's {ds_scheduler} takes its range from warmup_min_lr/warmup_max_lr)"),
    Needs(("--min-lr",), "min_lr", lambda o: o.lr_decay_style != "constant",
          "sets the learning rate the decay ends at", "a decaying --lr-decay-style (got "
          "constant)"),
    Needs(("--lr-decay-iters",), "lr_decay_iters", _decays,
          "sets the length of the lr decay", "--lr-decay-style linear, cosine or WSD, or "
          "--lr-warmup-fraction (got {lr_decay_style})"),
    Needs(("--lr-decay-samples",), "lr_decay_samples", _decays,
          "sets the length of the lr decay", "--lr-decay-style linear, cosine or WSD, or "
          "--lr-warmup-fraction (got {lr_decay_style})"),
    Needs(("--lr-decay-iters",), "lr_decay_iters", lambda o: o.lr_decay_samples is None,
          "sets the length of the lr decay", "no --lr-decay-samples (which wins)"),
    Needs(("--lr-warmup-iters",), "lr_warmup_iters", lambda o: o.lr_warmup_samples == 0,
          "sets the length of the lr warmup", "no --lr-warmup-samples (which wins)"),
    Needs(("--lr-wsd-decay-iters",), "lr_wsd_decay_iters",
          lambda o: o.lr_wsd_decay_samples is None, "sets the length of WSD's final decay",
          "no --lr-wsd-decay-samples (which wins)"),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda o: o.lr_decay_style == "WSD",
            "shapes WSD's final decay", "--lr-decay-style WSD (got {lr_decay_style})")
      for flag in ("--lr-wsd-decay-style", "--lr-wsd-decay-iters", "--lr-wsd-decay-samples")),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda o: o.ds_scheduler is None,
            "shapes megazero's lr schedule", "no scheduler in the ds_config (its "
            "{ds_scheduler} replaces the schedule)")
      for flag in ("--min-lr", "--lr-decay-style", "--lr-wsd-decay-style",
                   "--lr-wsd-decay-iters", "--lr-wsd-decay-samples", "--lr-warmup-fraction",
                   "--lr-warmup-iters", "--lr-warmup-samples", "--lr-decay-iters",
                   "--lr-decay-samples")),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda o: o.optimizer != "sgd",
            "sets Adam's and LAMB's moments", "--optimizer adam, lamb, onebitadam or "
            "zerooneadam (got sgd)")
      for flag in ("--adam-beta1", "--adam-beta2", "--adam-eps")),
    Needs(("--no-adam-w-mode", "--adam-w-mode"), "adam_w_mode",
          lambda o: o.optimizer in _ADAMS, "chooses how Adam decays weights",
          "--optimizer adam, onebitadam or zerooneadam (got {optimizer})"),
    Needs(("--sgd-momentum",), "sgd_momentum", lambda o: o.optimizer == "sgd",
          "sets SGD's momentum", "--optimizer sgd (got {optimizer})"),
    Needs(("--cpu-torch-adam", "--cpu_torch_adam"), "cpu_torch_adam",
          lambda o: o.optimizer == "adam", "steps Adam with torch.optim.AdamW",
          "--optimizer adam (got {optimizer})"),
    Needs(("--no-fused-optimizer-step", "--ds_fused_adam", "--ds-fused-adam"),
          "use_fused_step", lambda o: o.optimizer in _ADAMS and not o.cpu_torch_adam,
          "chooses megazero's Adam step kernel or its reference", "megazero's Adam "
          "(--optimizer adam, onebitadam or zerooneadam, without --cpu-torch-adam)"),
    *(Needs((flag,), flag[2:].replace("-", "_"), _dynamic_scale,
            "tunes the dynamic loss scale", "--fp16 without --loss-scale")
      for flag in ("--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
                   "--hysteresis")),
    Needs(("--zero-reduce-bucket-size", "--ddp-bucket-size"), "zero_reduce_bucket_size",
          lambda o: o.zero_stage != 3, "sizes the gradient buckets of ZeRO 0-2 (ZeRO-3 "
          "reduces per unit)", "--zero-stage 0, 1 or 2 (got 3)"),
    Needs(("--no-overlap-param-gather", "--overlap-param-gather"), "overlap_param_gather",
          lambda o: o.zero_stage in (1, 2), "sets when ZeRO 1-2 all-gather updated "
          "parameters", "--zero-stage 1 or 2, or --use-distributed-optimizer (got "
          "{zero_stage})"),
    Needs(("--zero-param-persistence-threshold",), "zero_param_persistence_threshold",
          lambda o: o.zero_stage == 3, "keeps ZeRO-3's small parameters whole", _ZERO3),
    Needs(("--no-zero-prefetch",), "zero_prefetch", lambda o: o.zero_stage == 3,
          "turns ZeRO-3's prefetch off", _ZERO3),
    Needs(("--zero-max-live-parameters",), "zero_max_live_parameters",
          lambda o: o.zero_stage == 3 and o.zero_prefetch, "limits ZeRO-3's prefetch",
          _PREFETCHING),
    Needs(("--zero-prefetch-bucket-size",), "zero_prefetch_bucket_size",
          lambda o: o.zero_stage == 3 and o.zero_prefetch, "sizes ZeRO-3's prefetch",
          _PREFETCHING, by_value=True),
    Needs(("--no-zero3-order-check",), "zero3_order_check", lambda o: o.zero_stage == 3,
          "turns ZeRO-3's collective order check off", _ZERO3),
    Needs(("--nvme-sub-group-size",), "nvme_sub_group_size",
          lambda o: o.offload_optimizer == "nvme",
          "sizes the NVMe optimizer step's sub-groups", "--offload-optimizer nvme",
          by_value=True),
    Needs(("--nvme-buffer-count",), "nvme_buffer_count",
          lambda o: o.offload_optimizer == "nvme",
          "sizes the NVMe optimizer step's host slots", "--offload-optimizer nvme",
          by_value=True),
    *(Needs((flag,), flag[2:].replace("-", "_"),
            lambda o: o.offload_optimizer == "nvme" or o.offload_param == "nvme", acts,
            "--offload-optimizer nvme or --offload-param nvme", by_value=True)
      for flag, acts in (("--nvme-threads", "sizes the NVMe offload's I/O threads"),
                         ("--nvme-block-size", "sizes the NVMe offload's I/O"))),
)


@dataclass
class ParallelConfig:
    """Sizes of the rank grid: world = tp * dp * pp (tp fastest, then dp, then pp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    overlap_p2p_comm: bool = True  # interleaved schedule: exchanges in flight during compute
    world_size: int = 1
    distributed_backend: str | None = None  # None: nccl with CUDA, else gloo
    distributed_timeout_minutes: float = 10.0
    ring_collectives: str = "auto"  # gloo reduce-scatter/all-gather: auto | ring | native

    def __post_init__(self):
        tp, pp, world = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                         self.world_size)
        _int_at_least(tp, "--tensor-model-parallel-size", 1)
        _int_at_least(pp, "--pipeline-model-parallel-size", 1)
        _int_at_least(world, "--world-size (or WORLD_SIZE)", 1)
        _check(world % (tp * pp) == 0,
               f"world size ({world}) is not divisible by --tensor-model-parallel-size ({tp}) "
               f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}")
        if self.virtual_pipeline_model_parallel_size is not None:
            v = self.virtual_pipeline_model_parallel_size
            _int_at_least(v, "the number of virtual pipeline stages", 1)
            _check(pp > 1 or v == 1,
                   "--num-layers-per-virtual-pipeline-stage needs "
                   "--pipeline-model-parallel-size > 1")
            if v == 1:
                self.virtual_pipeline_model_parallel_size = None
        _check(self.distributed_backend in (None, "gloo", "nccl"),
               f"--distributed-backend must be gloo or nccl, got {self.distributed_backend!r}")
        _check(self.ring_collectives in ("auto", "ring", "native"),
               f"--ring-collectives must be auto, ring or native, got {self.ring_collectives!r}")
        _finite(self.distributed_timeout_minutes, "--distributed-timeout-minutes",
                positive=True)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size
                                   * self.pipeline_model_parallel_size)


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule, precision, loss scaling and ZeRO."""

    optimizer: str = "adam"  # adam | lamb | sgd | onebitadam
    adam_bias_correction: bool = True  # Adam's 1/(1 - beta^t) factors (DeepSpeed's option)
    freeze_step: int = 100000  # onebitadam: full-precision Adam steps before compression
    # zerooneadam (DeepSpeed's defaults): the last variance update, the variance interval's
    # doubling period (in updates), the local interval's doubling period and its cap
    var_freeze_step: int = 100000
    var_update_scaler: int = 16
    local_step_scaler: int = 32678
    local_step_clipper: int = 16
    # onebitadam/zerooneadam: the backend a ds_config names for the compressed exchange
    # (comm_backend_name), checked against the one the dp group uses; None: not named
    compressed_comm_backend: str | None = None
    lr: float = 1.5e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant | linear | cosine | inverse-square-root | WSD
    lr_wsd_decay_style: str = "exponential"  # linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    adam_w_mode: bool = True
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    # precision and loss scaling
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # constant scale; None -> dynamic (fp16 only)
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # ZeRO data parallelism
    zero_stage: int = 0
    # elements per reduce bucket; None: chosen from the model size (layout.default_bucket_size)
    zero_reduce_bucket_size: int | None = None
    overlap_grad_reduce: bool = True  # bucket reduce-scatters run during the backward
    overlap_param_gather: bool = True  # updated parameters gathered during the next forward
    zero_param_persistence_threshold: int = 0  # elements; params at or below stay whole
    zero_prefetch: bool = True
    # ZeRO-3: no prefetch once it would hold more parameter elements gathered than this
    # (DeepSpeed's stage3_max_live_parameters); None: no limit
    zero_max_live_parameters: int | None = None
    # ZeRO-3: prefetch the units ahead while their elements sum to at most this
    # (DeepSpeed's stage3_prefetch_bucket_size); None: the next unit only
    zero_prefetch_bucket_size: int | None = None
    zero3_order_check: bool = True  # all-gather (kind, bucket, seq) before each collective
    cpu_offload: bool = False
    # --offload-optimizer nvme: the fp32 main values and moments in files under nvme_path,
    # streamed in sub-groups of nvme_sub_group_size elements by nvme_threads I/O threads
    offload_optimizer: str | None = None  # None | cpu | nvme
    # --offload-param nvme (ZeRO-3): this rank's parameter chunks in files under nvme_path
    offload_param: str | None = None  # None | nvme
    nvme_path: str | None = None
    nvme_sub_group_size: int = 1 << 22
    nvme_threads: int = 4
    nvme_block_size: int = 1 << 20  # bytes per I/O piece (DeepSpeed's aio.block_size)
    nvme_buffer_count: int = 2  # host slots the step streams through (offload_optimizer's)
    cpu_torch_adam: bool = False
    use_fused_step: bool = True  # fused unscale+clip+adam+cast kernel when built
    # a ds_config's scheduler (WarmupLR | WarmupDecayLR | WarmupCosineLR, counted in steps)
    ds_scheduler: str | None = None
    ds_scheduler_params: dict | None = None

    def __post_init__(self):
        _check(self.optimizer in ("adam", "lamb", "sgd", "onebitadam", "zerooneadam"),
               f"--optimizer must be adam, lamb, sgd, onebitadam or zerooneadam, got "
               f"{self.optimizer!r}")
        _int_at_least(self.freeze_step, "--freeze-step", 1)
        _check(self.compressed_comm_backend in (None, "nccl", "gloo"),
               "ds_config optimizer.params.comm_backend_name must be nccl or gloo, got "
               f"{self.compressed_comm_backend!r}")
        _check(self.adam_bias_correction or (
            self.optimizer in ("adam", "onebitadam", "zerooneadam") and not self.cpu_torch_adam),
            "--no-adam-bias-correction needs megazero's Adam (--optimizer adam, onebitadam or "
            "zerooneadam, without --cpu-torch-adam)")
        for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                     "local_step_clipper"):
            _int_at_least(getattr(self, name), "--" + name.replace("_", "-"), 1)
        styles = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
        _check(self.lr_decay_style in styles,
               f"--lr-decay-style must be one of {', '.join(styles)}, got "
               f"{self.lr_decay_style!r}")
        wsd = ("linear", "cosine", "exponential", "minus_sqrt")
        _check(self.lr_wsd_decay_style in wsd,
               f"--lr-wsd-decay-style must be one of {', '.join(wsd)}, got "
               f"{self.lr_wsd_decay_style!r}")
        _optional_int_at_least(self.lr_wsd_decay_iters, "--lr-wsd-decay-iters", 1)
        _optional_int_at_least(self.lr_wsd_decay_samples, "--lr-wsd-decay-samples", 1)
        if self.lr_decay_style == "WSD":
            _check(self.lr_wsd_decay_iters is not None or self.lr_wsd_decay_samples is not None,
                   "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        _check(not (self.fp16 and self.bf16), "--fp16 and --bf16 cannot both be set")
        _finite(self.lr, "--lr", positive=False)
        _finite(self.min_lr, "--min-lr", positive=False)
        _check(self.min_lr <= self.lr or self.lr == 0,
               f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        _int_at_least(self.lr_warmup_iters, "--lr-warmup-iters", 0)
        _int_at_least(self.lr_warmup_samples, "--lr-warmup-samples", 0)
        _optional_int_at_least(self.lr_decay_iters, "--lr-decay-iters", 1)
        _optional_int_at_least(self.lr_decay_samples, "--lr-decay-samples", 1)
        if self.lr_warmup_fraction is not None:
            _in_unit(self.lr_warmup_fraction, "--lr-warmup-fraction", closed=True)
            _check(self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0,
                   "--lr-warmup-fraction cannot be combined with --lr-warmup-iters/samples")
        _finite(self.weight_decay, "--weight-decay", positive=False)
        _in_unit(self.adam_beta1, "--adam-beta1")
        _in_unit(self.adam_beta2, "--adam-beta2")
        _finite(self.adam_eps, "--adam-eps", positive=True)
        _in_unit(self.sgd_momentum, "--sgd-momentum")
        _check(self.zero_stage in (0, 1, 2, 3),
               f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _optional_int_at_least(self.zero_reduce_bucket_size, "--zero-reduce-bucket-size", 1)
        _int_at_least(self.zero_param_persistence_threshold,
                      "--zero-param-persistence-threshold", 0)
        _optional_int_at_least(self.zero_max_live_parameters, "--zero-max-live-parameters", 1)
        _optional_int_at_least(self.zero_prefetch_bucket_size, "--zero-prefetch-bucket-size", 1)
        _finite(self.clip_grad, "--clip-grad", positive=False)
        _int_at_least(self.hysteresis, "--hysteresis", 1)
        _int_at_least(self.loss_scale_window, "--loss-scale-window", 1)
        if self.loss_scale is not None:
            _finite(self.loss_scale, "--loss-scale", positive=True)
        _finite(self.initial_loss_scale, "--initial-loss-scale", positive=True)
        _finite(self.min_loss_scale, "--min-loss-scale", positive=True)
        if self.fp16 and self.loss_scale is None:  # the dynamic scaler's range
            _check(self.min_loss_scale <= self.initial_loss_scale,
                   f"--min-loss-scale ({self.min_loss_scale}) must not exceed "
                   f"--initial-loss-scale ({self.initial_loss_scale})")
        _check(self.offload_optimizer in (None, "none", "cpu", "nvme"),
               f"--offload-optimizer must be cpu or nvme, got {self.offload_optimizer!r}")
        if self.offload_optimizer in ("cpu", "nvme"):
            self.cpu_offload = True  # NVMe streams through the host, as --cpu-offload
        _check(self.offload_param in (None, "none", "nvme"),
               f"--offload-param must be nvme, got {self.offload_param!r}")
        nvme = self.offload_optimizer == "nvme" or self.offload_param == "nvme"
        _check(nvme == (self.nvme_path is not None),
               "--offload-optimizer nvme / --offload-param nvme and --nvme-path DIR go "
               "together")
        _check(not (self.offload_param == "nvme" and self.zero_stage != 3),
               "--offload-param nvme partitions parameters into files: it needs "
               f"--zero-stage 3 (got {self.zero_stage})")
        _check(not (self.offload_param == "nvme" and not self.cpu_offload),
               "--offload-param nvme keeps no fp32 main values with the parameters: add "
               "--offload-optimizer cpu or nvme (or --cpu-offload)")
        _int_at_least(self.nvme_sub_group_size, "--nvme-sub-group-size", 1)
        _int_at_least(self.nvme_threads, "--nvme-threads", 1)
        _int_at_least(self.nvme_buffer_count, "--nvme-buffer-count", 2)
        _check(self.nvme_block_size >= IO_ALIGN and self.nvme_block_size % IO_ALIGN == 0,
               f"--nvme-block-size must be >= {IO_ALIGN} and a multiple of {IO_ALIGN} bytes "
               f"(O_DIRECT's alignment), got {self.nvme_block_size}")
        _check(not (self.offload_optimizer == "nvme" and self.zero_stage not in (1, 2, 3)),
               "--offload-optimizer nvme needs --zero-stage 1, 2 or 3")
        _check(not (self.offload_optimizer == "nvme" and self.optimizer not in ("adam", "sgd")),
               "--offload-optimizer nvme steps parameters in sub-groups: --optimizer adam or "
               "sgd (LAMB needs whole parameters)")
        _check(not (self.cpu_offload and self.zero_stage == 0),
               "--cpu-offload / --zero-offload-optimizer / --offload-optimizer cpu needs "
               "--zero-stage >= 1")
        check_modes(self, OPTIMIZER_MODES)

    @property
    def params_dtype(self) -> str:
        return "float16" if self.fp16 else "bfloat16" if self.bf16 else "float32"
