"""The one argparse parser, with Megatron-LM's flag names, turned into a ``MegazeroConfig``.

Flags are grouped by concern like Megatron's ``arguments.py``, the groups defined beside this
module: ``arguments_model`` (model, parallelism), ``arguments_optim`` (optimizer and learning
rate, mixed precision, ZeRO), ``arguments_train`` (data and tokenizer, training, logging and
evaluation, checkpointing), ``arguments_compat`` (Megatron's other flags, honoured through
megazero's own settings or refused with an alternative) and ``arguments_run`` (DeepSpeed's
flags, the dry run). Each flag's destination is a field of one of the config dataclasses and
its default is read from that field, so a default is written once, in ``config``.
``parse_args`` returns the validated config tree; the world size comes from torchrun's
``WORLD_SIZE`` (1 when launched as one process). No flag is parsed and ignored: one that acts
in one mode only is refused when given outside it, at any value, naming the mode it needs
(``MegazeroConfig.check_given``; the dry run's flags without a dry run), and
``tests/test_flag_effects.py`` proves every flag's effect or refusal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from megazero.arguments_compat import add_compat_args, apply_compat
from megazero.arguments_model import add_model_args, add_parallel_args
from megazero.arguments_optim import add_optimizer_args
from megazero.arguments_run import (
    DRY_RUN_FIELDS,
    add_config_arguments,
    add_deepspeed_args,
    add_dry_run_args,
    apply_deepspeed_config,
    check_dry_run,
)
from megazero.arguments_train import add_data_args, add_training_args
from megazero.config import (
    ConfigError,
    DataConfig,
    MegazeroConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from megazero.config.checks import field_default

__all__ = ["DRY_RUN_FIELDS", "add_config_arguments", "apply_deepspeed_config", "build_parser",
           "dry_run_args", "field_default", "given_flags", "namespace_to_config", "parse_args"]


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="megazero GPT-2 pretraining",
                                     allow_abbrev=False)
    add_model_args(parser)
    add_parallel_args(parser)
    add_optimizer_args(parser)
    add_data_args(parser)
    add_training_args(parser)
    add_compat_args(parser)
    add_deepspeed_args(parser)
    add_dry_run_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The option strings of ``parser`` that ``argv`` gives (``--flag`` or ``--flag=value``),
    whatever their values."""
    options = parser._option_string_actions
    return {a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in options}


def dry_run_args(argv=None) -> dict | None:
    """The ``--dry-run-*`` values as a dict (``DryRunOptions`` fields), or None when no dry run
    is asked for. ``--dry-run-rank`` and ``--dry-run-world-size`` come together."""
    parser = build_parser()
    ns, _ = parser.parse_known_args(argv)
    if ns.dry_run_rank is None and ns.dry_run_world_size is None:
        return None
    if ns.dry_run_rank is None or ns.dry_run_world_size is None:
        parser.error("--dry-run-rank and --dry-run-world-size go together")
    return {f: getattr(ns, f"dry_run_{f}") for f in DRY_RUN_FIELDS}


def _pick(ns, cls, **values):
    """Dataclass ``cls`` from the namespace fields of the same name (``values`` win)."""
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
              if hasattr(ns, f.name)}
    return cls(**{**kwargs, **values})


def namespace_to_config(ns: argparse.Namespace, world_size: int | None = None) -> MegazeroConfig:
    apply_compat(ns)
    if world_size is None:
        world_size = getattr(ns, "dry_run_world_size", None) or ns.world_size
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
    v = None
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        per = ns.num_layers_per_virtual_pipeline_stage
        if per < 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage must be an integer "
                              f">= 1, got {per}")
        layers_per_stage = ns.num_layers // max(ns.pipeline_model_parallel_size, 1)
        if layers_per_stage % per != 0:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage ({per}) must divide the layers per "
                f"pipeline stage ({ns.num_layers} / {ns.pipeline_model_parallel_size})")
        v = layers_per_stage // per
    if ns.bf16 or ns.fp16:
        ns.params_dtype = "bfloat16" if ns.bf16 else "float16"
    return MegazeroConfig(
        model=_pick(ns, ModelConfig),
        parallel=_pick(ns, ParallelConfig, virtual_pipeline_model_parallel_size=v,
                       world_size=world_size),
        optimizer=_pick(ns, OptimizerConfig),
        data=_pick(ns, DataConfig),
        train=_pick(ns, TrainConfig),
    )


def parse_args(argv=None, extra_args_provider=None, world_size=None) -> MegazeroConfig:
    """Parse Megatron-style flags into a validated config tree.

    A flag given outside the mode it acts in is refused (``MegazeroConfig.check_given``), and
    a ``ConfigError`` is turned into an argparse error (exit code 2, message on stderr).
    """
    parser = build_parser(extra_args_provider)
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = parser.parse_args(argv)
    try:
        config = apply_deepspeed_config(namespace_to_config(ns, world_size), ns, argv, parser)
        given = given_flags(parser, argv)
        check_dry_run(ns, given)
        if ns.dry_run_rank is not None:  # the dry run's synthetic tokens take --vocab-size
            given -= {"--vocab-size"}
        config.check_given(given)
    except ConfigError as exc:
        parser.error(str(exc))
    return config
