"""DeepSpeed's ``ds_config.json``, accepted strictly and turned into megazero's settings.

``parse_ds_config(cfg, world_size, tp, pp)`` checks every key against DeepSpeed's schema as
megazero supports it and returns ``DeepSpeedSettings``: field values for the config tree
(``OptimizerConfig``, ``ModelConfig``, ``TrainConfig``), the batch sizes and the scheduler.
Nothing is ignored: an unknown key, a wrong type or an out-of-range value fails naming the key
path, the value and the valid choices; a key DeepSpeed has and megazero does not is refused,
named, with what to do instead; the batch sizes are checked against the world size as
DeepSpeed does (``train_batch_size = micro x accumulation x dp``, two of three given).
Pure data: nothing here knows torch.distributed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

from megazero.config.checks import ConfigError


class DeepSpeedConfigError(ConfigError):
    """A ds_config key, value or combination megazero cannot run with."""


_BOOL, _STR, _DICT = "bool", "str", "dict"


def _int(low):
    return ("int", low)


def _float(low, *, positive=False):
    return ("float", low, positive)


def _choice(*values):
    return ("choice", values)


# offload_optimizer: buffer_count, fast_init and pipeline_read/write tune DeepSpeed's swapper;
# megazero always streams through two slots, reading ahead and writing behind
_OFFLOAD = {"device": _choice("none", "cpu", "nvme"), "pin_memory": _BOOL, "nvme_path": _STR,
            "buffer_count": _int(1), "fast_init": _BOOL, "pipeline_read": _BOOL,
            "pipeline_write": _BOOL}
SCHEMA = {
    "train_batch_size": _int(1), "train_micro_batch_size_per_gpu": _int(1),
    "gradient_accumulation_steps": _int(1), "gradient_clipping": _float(0.0),
    "steps_per_print": _int(1), "wall_clock_breakdown": _BOOL,
    "fp16": {"enabled": _BOOL, "loss_scale": _float(0.0), "initial_scale_power": _int(0),
             "loss_scale_window": _int(1), "hysteresis": _int(1),
             "min_loss_scale": _float(0.0, positive=True)},
    "bf16": {"enabled": _BOOL},
    "optimizer": {"type": _choice("Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam"),
                  "params": _DICT},
    "scheduler": {"type": _choice("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"),
                  "params": _DICT},
    "zero_optimization": {
        "stage": _choice(0, 1, 2, 3), "offload_optimizer": _OFFLOAD,
        # offload_param's buffer_count/buffer_size/max_in_cpu tune DeepSpeed's pool of
        # parameter buffers; megazero reads each unit's chunk when it is gathered (no pool)
        "offload_param": {"device": _choice("none", "nvme"), "nvme_path": _STR,
                          "pin_memory": _BOOL, "buffer_count": _int(1),
                          "buffer_size": _float(0.0), "max_in_cpu": _float(0.0)},
        "sub_group_size": _int(1), "overlap_comm": _BOOL,
        "contiguous_gradients": _choice(True), "reduce_bucket_size": _int(1),
        "allgather_bucket_size": _int(1), "stage3_prefetch_bucket_size": _int(0),
        "stage3_param_persistence_threshold": _int(0), "stage3_max_live_parameters": _int(1),
        "reduce_scatter": _choice(True),
        "allgather_partitions": _choice(True)},
    "activation_checkpointing": {"partition_activations": _BOOL,
                                 "contiguous_memory_optimization": _choice(False),
                                 "cpu_checkpointing": _BOOL},
    "tensorboard": {"enabled": _BOOL, "output_path": _STR, "job_name": _STR},
    "wandb": {"enabled": _BOOL, "project": _STR},
    # the NVMe I/O engine: thread_count is --nvme-threads; megazero's engine moves requests
    # in 1 MiB blocks with one thread pool (block_size, queue_depth, single_submit and
    # overlap_events tune libaio and are accepted without effect)
    "aio": {"thread_count": _int(1), "block_size": _int(1), "queue_depth": _int(1),
            "single_submit": _BOOL, "overlap_events": _BOOL},
}
_ADAM = {"lr": _float(0.0), "betas": "betas", "eps": _float(0.0, positive=True),
         "weight_decay": _float(0.0), "adam_w_mode": _BOOL, "torch_adam": _BOOL,
         "bias_correction": _BOOL, "amsgrad": _choice(False)}
OPTIMIZER_PARAMS = {
    "Adam": _ADAM, "AdamW": _ADAM,
    # comm_backend_name: megazero's compressed exchange runs on the dp process group's own
    # backend (NCCL with GPUs, gloo on CPU); cuda_aware concerns MPI, which megazero lacks
    "OneBitAdam": {"lr": _float(0.0), "betas": "betas", "eps": _float(0.0, positive=True),
                   "weight_decay": _float(0.0), "freeze_step": _int(1), "bias_correction": _BOOL,
                   "cuda_aware": _choice(False), "comm_backend_name": _choice("nccl", "gloo")},
    "ZeroOneAdam": {"lr": _float(0.0), "betas": "betas", "eps": _float(0.0, positive=True),
                    "weight_decay": _float(0.0), "var_freeze_step": _int(1),
                    "bias_correction": _BOOL,
                    "var_update_scaler": _int(1), "local_step_scaler": _int(1),
                    "local_step_clipper": _int(1), "cuda_aware": _choice(False),
                    "comm_backend_name": _choice("nccl", "gloo")},
    "Lamb": {"lr": _float(0.0), "betas": "betas", "eps": _float(0.0, positive=True),
             "weight_decay": _float(0.0), "bias_correction": _choice(True),
             "max_coeff": _choice(10.0), "min_coeff": _choice(0.01)},
}
_WARMUP = {"warmup_min_lr": _float(0.0), "warmup_max_lr": _float(0.0),
           "warmup_num_steps": _int(2), "warmup_type": _choice("log", "linear")}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": _int(1)},
    "WarmupCosineLR": {"total_num_steps": _int(1), "warmup_min_ratio": _float(0.0),
                       "cos_min_ratio": _float(0.0), "warmup_num_steps": _int(2),
                       "warmup_type": _choice("log", "linear")},
}
REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}
# DeepSpeed keys megazero does not have: key path -> what to do instead
REFUSED = {
    "optimizer.type=OneBitLamb": "1-bit LAMB is not available; use Lamb",
    "zero_optimization.offload_param.device=cpu": "megazero offloads parameters to NVMe "
                                                  "(device nvme, stage 3); use nvme or none",
    "activation_checkpointing.number_checkpoints": "use --recompute-num-layers",
    "activation_checkpointing.synchronize_checkpoint_boundary": "drop it",
    "activation_checkpointing.profile": "use --log-timers",
    "zero_optimization.stage3_max_reuse_distance": "drop it (megazero frees each unit after "
                                                   "its forward and backward)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "megazero's checkpoints are "
                                                                   "layout-free; drop it",
    "zero_optimization.round_robin_gradients": "drop it",
    "amp": "use bf16 or fp16", "communication_data_type": "drop it (gradients are reduced "
                                                          "in the parameters' dtype)",
    "prescale_gradients": "drop it", "gradient_predivide_factor": "drop it",
    "sparse_gradients": "drop it", "flops_profiler": "use --profile (torch.profiler)",
    "compression_training": "drop it", "data_efficiency": "drop it", "elasticity": "drop it",
    "autotuning": "use python -m megazero.plan when available, or the dry run",
    "comms_logger": "use megazero's comm statistics",
    "checkpoint": "drop it (checkpoints are always layout-free)",
    "zero_allow_untested_optimizer": "drop it", "zero_force_ds_cpu_optimizer": "drop it",
    "sparse_attention": "drop it", "pipeline": "use --pipeline-model-parallel-size",
    "curriculum_learning": "drop it", "csv_monitor": "use tensorboard or wandb",
    "memory_breakdown": "use --log-memory", "progressive_layer_drop": "drop it",
    "quantize_training": "drop it", "hybrid_engine": "drop it", "torch_autocast": "use bf16",
    "compile": "use --compile (torch.compile on each transformer layer of megazero's GPT "
               "model; DeepSpeed's block configures DeepCompile, which megazero does not "
               "have)",
    "wandb.team": "drop it (wandb reads WANDB_ENTITY)",
    "wandb.group": "drop it", "fp16.auto_cast": "drop it", "fp16.consecutive_hysteresis":
        "drop it (megazero's hysteresis resets after a clean step)",
}


@dataclass
class DeepSpeedSettings:
    """What a ds_config sets: config-tree fields by section, batch sizes, the scheduler."""

    micro_batch: int
    accumulation: int
    train_batch: int
    fields: dict = field(default_factory=dict)  # "optimizer.lr" -> value
    scheduler: tuple[str, dict] | None = None

    def apply(self, config, explicit: dict | None = None):
        """``config`` (a ``MegazeroConfig``) with these settings; ``explicit``: the flags the
        command line set (field path -> flag), which must agree with the config's values."""
        explicit = explicit or {}
        clash = [f"{flag} {_get(config, path)!r} vs ds_config's {value!r} ({path})"
                 for path, value in self.fields.items()
                 for flag in [explicit.get(path)] if flag and _get(config, path) != value]
        if clash:
            raise DeepSpeedConfigError("the ds_config contradicts the command line: "
                                       + "; ".join(clash))
        parts = {}
        for path, value in self.fields.items():
            section, name = path.split(".")
            parts.setdefault(section, {})[name] = value
        d = config.to_dict()
        for section, values in parts.items():
            d[section].update(values)
        return type(config).from_dict(d) if parts else replace(config)


def _get(config, path: str):
    section, name = path.split(".")
    return getattr(getattr(config, section), name)


def load_ds_config(source) -> dict:
    """The ds_config as a dict, from a dict or a JSON file's path (errors name the file)."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise DeepSpeedConfigError(f"cannot read the ds_config {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError(f"the ds_config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError(f"the ds_config {path} must hold a JSON object, got "
                                   f"{type(cfg).__name__}")
    return cfg


def _check_value(path: str, value, spec) -> None:
    if spec == _BOOL:
        ok, want = isinstance(value, bool), "true or false"
    elif spec == _STR:
        ok, want = isinstance(value, str), "a string"
    elif spec == _DICT:
        ok, want = isinstance(value, dict), "an object"
    elif spec == "betas":
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
            for b in value)
        want = "two numbers in [0, 1)"
    elif spec[0] == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= spec[1]
        want = f"an integer >= {spec[1]}"
    elif spec[0] == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value) and (value > spec[1] if spec[2] else value >= spec[1])
        want = f"a finite number {'>' if spec[2] else '>='} {spec[1]}"
    else:  # choice
        ok = any(value == c and type(value) is type(c) or (isinstance(c, float)
                 and isinstance(value, (int, float)) and value == c) for c in spec[1])
        want = "one of " + ", ".join(json.dumps(c) for c in spec[1])
    if not ok:
        raise DeepSpeedConfigError(f"ds_config {path}: {json.dumps(value)} is not {want}")


def _walk(cfg: dict, schema: dict, prefix: str = "") -> None:
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError(f"ds_config {prefix.rstrip('.')} must be an object, got "
                                   f"{json.dumps(cfg)}")
    for key, value in cfg.items():
        path = prefix + key
        if path in REFUSED:
            raise DeepSpeedConfigError(f"ds_config {path} is not supported by megazero: "
                                       f"{REFUSED[path]}")
        refused_value = f"{path}={value}"
        if refused_value in REFUSED:
            raise DeepSpeedConfigError(f"ds_config {path} {json.dumps(value)} is not "
                                       f"supported by megazero: {REFUSED[refused_value]}")
        if key not in schema:
            raise DeepSpeedConfigError(f"ds_config has an unknown key {path!r}; valid keys "
                                       f"here: {', '.join(sorted(schema))}")
        if isinstance(schema[key], dict):
            _walk(value, schema[key], path + ".")
        else:
            _check_value(path, value, schema[key])


def _batch(cfg: dict, dp: int) -> tuple[int, int, int]:
    """(micro, accumulation, train batch) as DeepSpeed resolves them."""
    tb, mb = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    if tb is None and mb is None:
        raise DeepSpeedConfigError("ds_config needs train_batch_size or "
                                   "train_micro_batch_size_per_gpu")
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // (mb * dp)
    elif tb is not None and gas is not None:
        mb = tb // (gas * dp)
    elif mb is not None and gas is not None:
        tb = mb * gas * dp
    elif tb is not None:
        gas, mb = 1, tb // dp
    else:
        gas, tb = 1, mb * dp
    if mb < 1 or gas < 1 or tb != mb * gas * dp:
        raise DeepSpeedConfigError(
            f"ds_config train_batch_size ({cfg.get('train_batch_size')}) must equal "
            f"train_micro_batch_size_per_gpu ({cfg.get('train_micro_batch_size_per_gpu')}) x "
            f"gradient_accumulation_steps ({cfg.get('gradient_accumulation_steps')}) x "
            f"data-parallel size ({dp})")
    return mb, gas, tb


def parse_ds_config(source, world_size: int, tp: int = 1, pp: int = 1) -> DeepSpeedSettings:
    """Check a ds_config (dict or JSON path) and translate it (see the module docstring)."""
    cfg = load_ds_config(source)
    _walk(cfg, SCHEMA)
    dp = world_size // (tp * pp)
    mb, gas, tb = _batch(cfg, dp)
    f: dict = {"train.micro_batch_size": mb, "train.global_batch_size": tb}
    if "gradient_clipping" in cfg:
        f["optimizer.clip_grad"] = float(cfg["gradient_clipping"])
    fp16, bf16 = cfg.get("fp16", {}), cfg.get("bf16", {})
    if fp16.get("enabled") and bf16.get("enabled"):
        raise DeepSpeedConfigError("ds_config enables both fp16 and bf16")
    if fp16.get("enabled"):
        f["optimizer.fp16"] = True
        if fp16.get("loss_scale", 0) > 0:
            f["optimizer.loss_scale"] = float(fp16["loss_scale"])
        f["optimizer.initial_loss_scale"] = 2.0 ** fp16.get("initial_scale_power", 16)
        for key, name in (("loss_scale_window", "loss_scale_window"),
                          ("hysteresis", "hysteresis"), ("min_loss_scale", "min_loss_scale")):
            if key in fp16:
                f[f"optimizer.{name}"] = fp16[key] if key != "min_loss_scale" \
                    else float(fp16[key])
    if bf16.get("enabled"):
        f["optimizer.bf16"] = True
    _optimizer(cfg.get("optimizer"), f)
    scheduler = _scheduler(cfg.get("scheduler"))
    _zero(cfg.get("zero_optimization", {}), f)
    if "thread_count" in cfg.get("aio", {}):
        f["optimizer.nvme_threads"] = cfg["aio"]["thread_count"]
    ac = cfg.get("activation_checkpointing", {})
    if ac.get("partition_activations"):
        f["model.recompute_activations"] = True
        f["model.partition_activations"] = True
    if ac.get("cpu_checkpointing"):
        f["model.recompute_activations"] = True
        f["model.checkpoint_in_cpu"] = True
    if "steps_per_print" in cfg:
        f["train.log_interval"] = cfg["steps_per_print"]
    if cfg.get("wall_clock_breakdown"):
        f["train.log_timers"] = True
    tb_cfg = cfg.get("tensorboard", {})
    if tb_cfg.get("enabled"):
        f["train.tensorboard_dir"] = os.path.join(tb_cfg.get("output_path", "runs"),
                                                  tb_cfg.get("job_name", "DeepSpeedJobName"))
    wb = cfg.get("wandb", {})
    if wb.get("enabled"):
        f["train.wandb_project"] = wb.get("project", "deepspeed")
    return DeepSpeedSettings(mb, gas, tb, f, scheduler)


def _optimizer(opt: dict | None, f: dict) -> None:
    if opt is None:
        return
    kind = opt.get("type")
    if kind is None:
        raise DeepSpeedConfigError("ds_config optimizer needs a type (Adam, AdamW, Lamb)")
    params = opt.get("params", {})
    _walk(params, OPTIMIZER_PARAMS[kind], "optimizer.params.")
    f["optimizer.optimizer"] = {"Lamb": "lamb", "OneBitAdam": "onebitadam",
                                "ZeroOneAdam": "zerooneadam"}.get(kind, "adam")
    if kind in ("OneBitAdam", "ZeroOneAdam"):  # DeepSpeed's add the decay to the update
        f["optimizer.adam_w_mode"] = True
        for key in ("freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler",
                    "local_step_clipper"):
            if key in params:
                f[f"optimizer.{key}"] = params[key]
    elif kind != "Lamb":
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; "AdamW" always
        f["optimizer.adam_w_mode"] = params.get("adam_w_mode", True) if kind == "Adam" \
            else True
        if params.get("torch_adam"):
            f["optimizer.cpu_torch_adam"] = True
    if "bias_correction" in params and kind != "Lamb":
        f["optimizer.adam_bias_correction"] = bool(params["bias_correction"])
    if "lr" in params:
        f["optimizer.lr"] = float(params["lr"])
    if "betas" in params:
        f["optimizer.adam_beta1"], f["optimizer.adam_beta2"] = map(float, params["betas"])
    if "eps" in params:
        f["optimizer.adam_eps"] = float(params["eps"])
    if "weight_decay" in params:
        f["optimizer.weight_decay"] = float(params["weight_decay"])


def _scheduler(s: dict | None) -> tuple[str, dict] | None:
    if s is None:
        return None
    kind = s.get("type")
    if kind is None:
        raise DeepSpeedConfigError("ds_config scheduler needs a type (WarmupLR, WarmupDecayLR, "
                                   "WarmupCosineLR)")
    params = s.get("params", {})
    _walk(params, SCHEDULER_PARAMS[kind], "scheduler.params.")
    missing = [k for k in REQUIRED.get(kind, ()) if k not in params]
    if missing:
        raise DeepSpeedConfigError(f"ds_config scheduler {kind} needs scheduler.params."
                                   f"{missing[0]}")
    return kind, dict(params)


def _zero(z: dict, f: dict) -> None:
    if "stage" in z:
        f["optimizer.zero_stage"] = z["stage"]
    off = z.get("offload_optimizer", {})
    if off.get("device") == "cpu":
        f["optimizer.cpu_offload"] = True
    if off.get("device") == "nvme":
        if "nvme_path" not in off:
            raise DeepSpeedConfigError("ds_config zero_optimization.offload_optimizer.device "
                                       "nvme needs offload_optimizer.nvme_path")
        f["optimizer.offload_optimizer"] = "nvme"
        f["optimizer.nvme_path"] = off["nvme_path"]
    par = z.get("offload_param", {})
    if par.get("device") == "nvme":
        path = par.get("nvme_path", off.get("nvme_path"))
        if path is None:
            raise DeepSpeedConfigError("ds_config zero_optimization.offload_param.device nvme "
                                       "needs offload_param.nvme_path")
        if f.get("optimizer.nvme_path", path) != path:
            raise DeepSpeedConfigError(
                f"ds_config zero_optimization.offload_param.nvme_path ({path}) differs from "
                f"offload_optimizer.nvme_path ({f['optimizer.nvme_path']}): megazero keeps "
                "both kinds of swap files under one --nvme-path")
        f["optimizer.offload_param"] = "nvme"
        f["optimizer.nvme_path"] = path
    if "sub_group_size" in z:
        f["optimizer.nvme_sub_group_size"] = z["sub_group_size"]
    if "overlap_comm" in z:
        f["optimizer.overlap_grad_reduce"] = z["overlap_comm"]
    reduce, gather = z.get("reduce_bucket_size"), z.get("allgather_bucket_size")
    if reduce is not None and gather is not None and reduce != gather:
        raise DeepSpeedConfigError(
            f"ds_config zero_optimization.allgather_bucket_size ({gather}) differs from "
            f"reduce_bucket_size ({reduce}): megazero all-gathers parameters in the gradient "
            "buckets; use one value for both")
    if reduce or gather:
        f["optimizer.zero_reduce_bucket_size"] = reduce or gather
    if "stage3_prefetch_bucket_size" in z:
        f["optimizer.zero_prefetch"] = z["stage3_prefetch_bucket_size"] > 0
    if "stage3_max_live_parameters" in z:
        f["optimizer.zero_max_live_parameters"] = z["stage3_max_live_parameters"]
    if "stage3_param_persistence_threshold" in z:
        f["optimizer.zero_param_persistence_threshold"] = \
            z["stage3_param_persistence_threshold"]


__all__ = ["DeepSpeedConfigError", "DeepSpeedSettings", "load_ds_config", "parse_ds_config"]
