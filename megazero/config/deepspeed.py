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
import os
from dataclasses import dataclass, field, replace

from megazero.config import deepspeed_schema as schema
from megazero.config.checks import ConfigError
from megazero.config.deepspeed_schema import DeepSpeedConfigError, check
from megazero.config.optimizer import IO_ALIGN, OPTIMIZER_MODES

# ds_config keys whose setting acts in one mode only (the flag's ``Needs`` in OPTIMIZER_MODES
# says which): given outside it, the key is refused by name, as the flag is
MODE_KEYS = {
    "optimizer.zero_reduce_bucket_size": "zero_optimization.reduce_bucket_size / "
                                         "allgather_bucket_size",
    "optimizer.zero_prefetch": "zero_optimization.stage3_prefetch_bucket_size",
    "optimizer.zero_prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "optimizer.zero_max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "optimizer.zero_param_persistence_threshold":
        "zero_optimization.stage3_param_persistence_threshold",
    "optimizer.nvme_sub_group_size": "zero_optimization.sub_group_size",
    "optimizer.nvme_buffer_count": "zero_optimization.offload_optimizer.buffer_count",
    "optimizer.nvme_threads": "aio.thread_count",
    "optimizer.nvme_block_size": "aio.block_size",
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
        try:
            out = type(config).from_dict(d) if parts else replace(config)
        except ConfigError as exc:  # a mode the dataclass refuses by value: name the key
            keys = [key for path, key in MODE_KEYS.items() if path in self.fields
                    for n in OPTIMIZER_MODES if n.field == path.split(".", 1)[1]
                    if n.flags[0] in str(exc)]
            if keys:
                raise DeepSpeedConfigError(f"ds_config {', '.join(keys)}: {exc}") from None
            raise
        refuse_outside_mode(self.fields, out.optimizer)
        return out


def refuse_outside_mode(fields: dict, optimizer) -> None:
    """Refuse the ds_config keys of ``MODE_KEYS`` that ``fields`` sets where the final
    ``optimizer`` config (an ``OptimizerConfig``) is outside their mode, each named."""
    refused = [f"{key}: {n.message(optimizer)}"
               for path, key in MODE_KEYS.items() if path in fields
               for n in OPTIMIZER_MODES if n.field == path.split(".", 1)[1]
               and not n.mode(optimizer)]
    if refused:
        raise DeepSpeedConfigError("ds_config keys that do nothing in this configuration: "
                                   + "; ".join(refused))


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
    check(cfg)
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
    aio = cfg.get("aio", {})
    if "thread_count" in aio:
        f["optimizer.nvme_threads"] = aio["thread_count"]
    if "block_size" in aio:
        if aio["block_size"] % IO_ALIGN:
            raise DeepSpeedConfigError(f"ds_config aio.block_size: {aio['block_size']} is not "
                                       f"a multiple of {IO_ALIGN} (O_DIRECT's alignment)")
        f["optimizer.nvme_block_size"] = aio["block_size"]
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
    f["optimizer.optimizer"] = {"Lamb": "lamb", "OneBitAdam": "onebitadam",
                                "ZeroOneAdam": "zerooneadam"}.get(kind, "adam")
    if kind in ("OneBitAdam", "ZeroOneAdam"):  # DeepSpeed's add the decay to the update
        f["optimizer.adam_w_mode"] = True
        for key in ("freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler",
                    "local_step_clipper"):
            if key in params:
                f[f"optimizer.{key}"] = params[key]
        if "comm_backend_name" in params:
            f["optimizer.compressed_comm_backend"] = params["comm_backend_name"]
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
    missing = [k for k in schema.REQUIRED.get(kind, ()) if k not in params]
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
    if "buffer_count" in off:
        f["optimizer.nvme_buffer_count"] = off["buffer_count"]
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
        size = z["stage3_prefetch_bucket_size"]
        f["optimizer.zero_prefetch"] = size > 0
        if size > 0:
            f["optimizer.zero_prefetch_bucket_size"] = size
    if "stage3_max_live_parameters" in z:
        f["optimizer.zero_max_live_parameters"] = z["stage3_max_live_parameters"]
    if "stage3_param_persistence_threshold" in z:
        f["optimizer.zero_param_persistence_threshold"] = \
            z["stage3_param_persistence_threshold"]


__all__ = ["DeepSpeedConfigError", "DeepSpeedSettings", "load_ds_config", "parse_ds_config"]
