"""DeepSpeed's ds_config schema as megazero supports it: every key it accepts, with the type or
the values it takes, and every key DeepSpeed has that megazero refuses, with what to do instead.

``walk(cfg, schema)`` checks a config (section) against a schema: an unknown key, a wrong type
or an out-of-range value fails at once, naming the key path, the value and the valid choices;
refused keys (``REFUSED``: a key, or ``key=value``) are collected in ``refusals`` so that one
error names them all. A key accepted with only one value (``_choice(True)``) states megazero's
fixed behaviour; every other accepted key changes a setting (``deepspeed.parse_ds_config``;
``tests/test_deepspeed_config.py`` walks this table and proves each). Pure data.
"""

from __future__ import annotations

import json
import math

from megazero.config.checks import ConfigError


class DeepSpeedConfigError(ConfigError):
    """A ds_config key, value or combination megazero cannot run with."""


_BOOL, _STR, _DICT = "bool", "str", "dict"


def _int(low, high=None):
    return ("int", low, high)


def _float(low, *, positive=False):
    return ("float", low, positive)


def _choice(*values):
    return ("choice", values)


# offload_optimizer: buffer_count is --nvme-buffer-count (the host slots the NVMe step streams
# through); megazero always reads ahead and writes behind (pipeline_read/write true) and pins
# its offload buffers whenever the device is CUDA (pin_memory true)
_OFFLOAD = {"device": _choice("none", "cpu", "nvme"), "pin_memory": _choice(True),
            "nvme_path": _STR, "buffer_count": _int(2), "pipeline_read": _choice(True),
            "pipeline_write": _choice(True)}
SCHEMA = {
    "train_batch_size": _int(1), "train_micro_batch_size_per_gpu": _int(1),
    "gradient_accumulation_steps": _int(1), "gradient_clipping": _float(0.0),
    "steps_per_print": _int(1), "wall_clock_breakdown": _BOOL,
    "fp16": {"enabled": _BOOL, "loss_scale": _float(0.0), "initial_scale_power": _int(0, 64),
             "loss_scale_window": _int(1), "hysteresis": _int(1),
             "min_loss_scale": _float(0.0, positive=True)},
    "bf16": {"enabled": _BOOL},
    "optimizer": {"type": _choice("Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam"),
                  "params": _DICT},
    "scheduler": {"type": _choice("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"),
                  "params": _DICT},
    "zero_optimization": {
        "stage": _choice(0, 1, 2, 3), "offload_optimizer": _OFFLOAD,
        "offload_param": {"device": _choice("none", "nvme"), "nvme_path": _STR,
                          "pin_memory": _choice(True)},
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
    # the NVMe I/O engine: thread_count is --nvme-threads, block_size --nvme-block-size
    "aio": {"thread_count": _int(1), "block_size": _int(4096)},
}
_ADAM = {"lr": _float(0.0), "betas": "betas", "eps": _float(0.0, positive=True),
         "weight_decay": _float(0.0), "adam_w_mode": _BOOL, "torch_adam": _BOOL,
         "bias_correction": _BOOL, "amsgrad": _choice(False)}
OPTIMIZER_PARAMS = {
    "Adam": _ADAM, "AdamW": {**_ADAM, "adam_w_mode": _choice(True)},  # AdamW decouples
    # comm_backend_name: checked against the backend the compressed exchange runs on (the dp
    # group's: NCCL with GPUs, gloo on CPU); cuda_aware concerns MPI, which megazero lacks
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
_PIPELINED = ("megazero always reads the next sub-groups ahead and writes the last one behind "
              "(--nvme-buffer-count slots); drop it")
_PINNED = "megazero pins its offload buffers whenever the device is CUDA; drop it"
_NO_POOL = ("drop it (megazero reads each ZeRO-3 unit's chunk from its file when the unit is "
            "gathered: there is no pool of parameter buffers to size)")
_ONE_PER_THREAD = ("drop it (megazero's I/O engine runs one pread/pwrite per thread, not libaio "
                   "queues: size it with aio.thread_count and aio.block_size)")
# DeepSpeed keys megazero does not have: key path (or key=value) -> what to do instead
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
    # DeepSpeed's swapper and libaio tuning, which megazero's I/O has no counterpart of
    "zero_optimization.offload_optimizer.fast_init": "drop it (megazero writes the initial "
                                                     "states sub-group by sub-group)",
    "zero_optimization.offload_optimizer.pipeline_read=False": _PIPELINED,
    "zero_optimization.offload_optimizer.pipeline_write=False": _PIPELINED,
    "zero_optimization.offload_optimizer.pin_memory=False": _PINNED,
    "zero_optimization.offload_param.pin_memory=False": _PINNED,
    "zero_optimization.offload_param.buffer_count": _NO_POOL,
    "zero_optimization.offload_param.buffer_size": _NO_POOL,
    "zero_optimization.offload_param.max_in_cpu": _NO_POOL,
    "aio.queue_depth": _ONE_PER_THREAD, "aio.single_submit": _ONE_PER_THREAD,
    "aio.overlap_events": _ONE_PER_THREAD,
    "compile": "use --compile (torch.compile on each transformer layer of megazero's GPT "
               "model; DeepSpeed's block configures DeepCompile, which megazero does not "
               "have)",
    "wandb.team": "drop it (wandb reads WANDB_ENTITY)",
    "wandb.group": "drop it", "fp16.auto_cast": "drop it", "fp16.consecutive_hysteresis":
        "drop it (megazero's hysteresis resets after a clean step)",
}


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
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= spec[1] \
            and (spec[2] is None or value <= spec[2])
        want = f"an integer >= {spec[1]}" + (f" and <= {spec[2]}" if spec[2] is not None
                                               else "")
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


def walk(cfg: dict, schema: dict, prefix: str, refusals: list[tuple[str, str]]) -> None:
    """Check ``cfg`` against ``schema`` (see the module doc); refused keys go to ``refusals``."""
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError(f"ds_config {prefix.rstrip('.')} must be an object, got "
                                   f"{json.dumps(cfg)}")
    for key, value in cfg.items():
        path = prefix + key
        if path in REFUSED:
            refusals.append((path, REFUSED[path]))
            continue
        refused_value = f"{path}={value}"
        if refused_value in REFUSED:
            refusals.append((f"{path} {json.dumps(value)}", REFUSED[refused_value]))
            continue
        if key not in schema:
            raise DeepSpeedConfigError(f"ds_config has an unknown key {path!r}; valid keys "
                                       f"here: {', '.join(sorted(schema))}")
        if isinstance(schema[key], dict):
            walk(value, schema[key], path + ".", refusals)
        else:
            _check_value(path, value, schema[key])


def check(cfg: dict) -> None:
    """Check a whole ds_config, the optimizer's and scheduler's params by their type, and
    refuse every refused key it holds in one error."""
    refusals: list[tuple[str, str]] = []
    walk(cfg, SCHEMA, "", refusals)
    for section, tables in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        kind = cfg.get(section, {}).get("type")
        if kind in tables:
            walk(cfg[section].get("params", {}), tables[kind], f"{section}.params.", refusals)
    if refusals:
        by_reason: dict[str, list[str]] = {}
        for what, reason in refusals:
            by_reason.setdefault(reason, []).append(what)
        raise DeepSpeedConfigError(
            "ds_config holds settings megazero does not support: " + "; ".join(
                f"{', '.join(keys)}: {reason}" for reason, keys in by_reason.items()))
