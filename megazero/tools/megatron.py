"""Megatron-LM checkpoints in the checkpoint tool: describe, to-megatron, from-megatron.

    python -m megazero.tools.checkpoint describe MEGATRON_DIR [--vocab-size V] [--json]
    python -m megazero.tools.checkpoint to-megatron CKPT OUT --tp N --pp M [--format mcore]
    python -m megazero.tools.checkpoint from-megatron MEGATRON_DIR OUT [--tp N --pp M]

One process, no process groups. ``to-megatron`` reads a megazero checkpoint saved at any
layout (``CheckpointReader``) and writes Megatron's ``torch`` format at (tp, pp) in Megatron-
core's names (``--format mcore``, the default) or legacy ones (``checkpoint.megatron_save``):
the model values, iteration, consumed samples and lr schedule, no optimizer or RNG state
(Megatron-LM loads it with ``--finetune``, or ``--no-load-optim --no-load-rng`` to continue at
its iteration). ``from-megatron`` reads a Megatron checkpoint at any tp/pp, either name layout
(``checkpoint.megatron.MegatronReader``), and writes a megazero checkpoint (dp=1, ZeRO stage
0) at (tp, pp) with the same iteration, consumed samples, schedule and, when Megatron's
optimizer state maps onto the model, its fp32 values and Adam moments. Megatron stores the
vocabulary padded: ``--vocab-size`` gives the true size when its args do not record it.
"""

from __future__ import annotations

import dataclasses
import sys

from megazero.checkpoint.megatron import MegatronReader, is_megatron_checkpoint
from megazero.checkpoint.megatron_format import megatron_scheduler
from megazero.checkpoint.megatron_save import FORMATS, write_megatron_checkpoint
from megazero.checkpoint.paths import CheckpointError
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.save import ARCH_DEFAULTS
from megazero.config import (
    DTYPES,
    ConfigError,
    MegazeroConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from megazero.tools.offline import write_checkpoint


def _iteration(value):
    return value if value in (None, "release") else int(value)


# ---- describe --------------------------------------------------------------------------------
def megatron_summary(reader: MegatronReader) -> dict:
    """What ``describe`` prints for a Megatron checkpoint, as plain values."""
    a = reader.megatron_args
    state = reader.training_state()
    tensors = []
    if reader.vocab_size is not None:
        tensors = [{"name": n, "megatron_key": w["key"], "stage": w["pp"],
                    "split": {0: "column (dim 0)", 1: "row (dim 1)"}.get(w["dim"],
                                                                          "replicated")}
                   for n, w in reader.index().items()]
    return {"checkpoint": reader.root, "description": reader.description,
            "iteration": reader.iteration, "consumed_train_samples":
                state["consumed_train_samples"],
            "model": reader.model_args, "padded_vocab_size": reader.padded_vocab,
            "vocab_size": reader.vocab_size,
            "params_dtype": str(a.get("params_dtype", "")).replace("torch.", ""),
            "optimizer": reader.optimizer_meta() and {
                k: v for k, v in reader.optimizer_meta().items() if k != "scaler"},
            "optimizer_problem": reader.no_optimizer_reason() or None,
            "scheduler": state["opt_param_scheduler"], "tensors": tensors}


def format_megatron(d: dict) -> str:
    m = d["model"]
    arch = {k: m.get(k, v) for k, v in ARCH_DEFAULTS.items() if m.get(k, v) != v}
    lines = [f"{d['description']}: {d['checkpoint']}  iteration {d['iteration']}",
             "model: " + " ".join(f"{k}={m[k]}" for k in (
                 "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "max_position_embeddings")) + f" vocab_size={d['vocab_size']} (padded "
             f"{d['padded_vocab_size']}) params_dtype={d['params_dtype']}",
             "architecture: " + (" ".join(f"{k}={v}" for k, v in arch.items()) or "GPT-2"),
             f"training: consumed samples {d['consumed_train_samples']}; optimizer: "
             + (f"step {d['optimizer']['step']}, {', '.join(d['optimizer']['state_names'])}"
                if d["optimizer"] else f"not loadable ({d['optimizer_problem']})")]
    if d["tensors"]:
        width = max(len(t["name"]) for t in d["tensors"])
        lines += [""] + [f"{t['name'].ljust(width)}  stage {t['stage']}  {t['split']:<15} "
                         f"<- {t['megatron_key']}" for t in d["tensors"]]
    return "\n".join(lines)


# ---- to-megatron -----------------------------------------------------------------------------
def cmd_to_megatron(a) -> int:
    reader = CheckpointReader(a.checkpoint, _iteration(a.iteration))
    model = {**ARCH_DEFAULTS, **reader.args["model"]}
    opt, train = reader.args["optimizer"], reader.args["train"]
    state = reader.training_state()
    sched = state.get("opt_param_scheduler")
    base = write_megatron_checkpoint(
        a.output, reader.iteration, model, full_tensor=lambda n: reader.full_tensor(n, "model"),
        vocab_size=model["vocab_size"], tp=a.tp, pp=a.pp, fmt=a.format,
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by
        or model["make_vocab_size_divisible_by"],
        params_dtype=DTYPES[model["params_dtype"]],
        consumed_train_samples=int(state.get("consumed_train_samples", 0)),
        scheduler=megatron_scheduler(sched, opt["weight_decay"]) if sched else None,
        extra_args={"seq_length": model["seq_length"], "lr": opt["lr"],
                    "min_lr": opt["min_lr"], "weight_decay": opt["weight_decay"],
                    "micro_batch_size": train["micro_batch_size"],
                    "global_batch_size": train["global_batch_size"], "seed": train["seed"]},
        overwrite=a.force)
    sys.stdout.write(
        f"wrote {base} (Megatron-LM, tp={a.tp} pp={a.pp}, {a.format} names, model values "
          "only); load it in Megatron-LM with --load "
          f"{a.output} --finetune (or --no-load-optim --no-load-rng to keep iteration "
          f"{reader.iteration}) and --use-checkpoint-args"
          + (" --use-legacy-models" if a.format == "legacy" else "") + "\n")
    return 0


# ---- from-megatron ---------------------------------------------------------------------------
def _section(cls, args: dict, rename: dict | None = None, **fixed):
    """A config section from the Megatron args it shares (``rename``: ours -> Megatron's);
    the defaults when Megatron's values do not validate."""
    rename = rename or {}
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: args[rename.get(k, k)] for k in fields
              if args.get(rename.get(k, k)) is not None and k not in fixed}
    try:
        return cls(**values, **fixed)
    except (ConfigError, TypeError):
        return cls(**fixed)


def megazero_config(reader: MegatronReader, tp: int, pp: int,
                    divisible_by: int | None = None) -> MegazeroConfig:
    """A megazero config for the Megatron model of ``reader`` at (tp, pp), dp=1."""
    a = reader.megatron_args
    if reader.vocab_size is None:
        raise CheckpointError(f"{reader.description} {reader.base} records its vocabulary "
                              f"padded ({reader.padded_vocab} rows) but not its true size: "
                              "pass --vocab-size")
    model = {**reader.model_args, "vocab_size": reader.vocab_size,
             "make_vocab_size_divisible_by": divisible_by or a.get(
                 "make_vocab_size_divisible_by") or 128,
             "seq_length": min(int(a.get("seq_length") or 1 << 30),
                               reader.model_args["max_position_embeddings"])}
    for k in ("attention_dropout", "hidden_dropout", "init_method_std"):
        if a.get(k) is not None:
            model[k] = a[k]
    optimizer = _section(OptimizerConfig, a, fp16=bool(a.get("fp16")), bf16=bool(a.get("bf16")),
                         zero_stage=0)
    train = _section(TrainConfig, a, global_batch_size=None)
    return MegazeroConfig(model=ModelConfig(**model), optimizer=optimizer, train=train,
                          parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                  pipeline_model_parallel_size=pp,
                                                  world_size=tp * pp))


def cmd_from_megatron(a) -> int:
    reader = MegatronReader(a.megatron_dir, _iteration(a.iteration), vocab_size=a.vocab_size)
    config = megazero_config(reader, a.tp, a.pp, a.make_vocab_size_divisible_by)
    state = reader.training_state()
    opt = reader.optimizer_meta()
    base = write_checkpoint(a.output, reader.iteration, config,
                            full_tensor=reader.full_tensor, optimizer=opt,
                            scheduler=state["opt_param_scheduler"] if opt else None,
                            consumed_train_samples=state["consumed_train_samples"],
                            overwrite=a.force)
    print(f"wrote {base} (megazero, tp={a.tp} pp={a.pp}) from the {reader.description}, "
          + ("with its optimizer state" if opt else
             f"without optimizer state ({reader.no_optimizer_reason()}): resume it with "
             "--no-load-optim or --finetune"))
    return 0


def add_commands(sub, ckpt, positive_int, iteration_arg) -> None:
    """Register to-megatron and from-megatron on the checkpoint tool's subparsers."""
    s = sub.add_parser("to-megatron", help="export to Megatron-LM's torch checkpoint format")
    ckpt(s)
    s.add_argument("output", help="folder to write (a Megatron --save folder)")
    s.add_argument("--tp", type=positive_int, default=1, help="tensor-model-parallel size")
    s.add_argument("--pp", type=positive_int, default=1, help="pipeline-model-parallel size")
    s.add_argument("--format", default="mcore", choices=FORMATS,
                   help="Megatron-core's names (default) or the legacy model's")
    s.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=None,
                   help="Megatron's vocabulary padding (default: the checkpoint's)")
    s.add_argument("--force", action="store_true", help="overwrite the iteration folder")
    s.set_defaults(fn=cmd_to_megatron)
    s = sub.add_parser("from-megatron", help="import a Megatron-LM (torch format) checkpoint")
    s.add_argument("megatron_dir", help="Megatron's --save folder (with the tracker file)")
    s.add_argument("output", help="folder to write (a megazero --save folder)")
    s.add_argument("--iteration", default=None, type=iteration_arg)
    s.add_argument("--tp", type=positive_int, default=1, help="tensor-model-parallel size")
    s.add_argument("--pp", type=positive_int, default=1, help="pipeline-model-parallel size")
    s.add_argument("--vocab-size", type=positive_int, default=None,
                   help="the true vocabulary (Megatron stores it padded; default: its args')")
    s.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=None)
    s.add_argument("--force", action="store_true", help="overwrite the iteration folder")
    s.set_defaults(fn=cmd_from_megatron)


def describe_if_megatron(a, json_dumps) -> bool:
    """Print the description of ``a.checkpoint`` when it is a Megatron checkpoint."""
    if not is_megatron_checkpoint(a.checkpoint, _iteration(a.iteration)):
        return False
    reader = MegatronReader(a.checkpoint, _iteration(a.iteration),
                            vocab_size=getattr(a, "vocab_size", None))
    d = megatron_summary(reader)
    print(json_dumps(d) if a.json else format_megatron(d))
    return True


__all__ = ["add_commands", "cmd_from_megatron", "cmd_to_megatron", "describe_if_megatron",
           "megatron_summary", "megazero_config"]
