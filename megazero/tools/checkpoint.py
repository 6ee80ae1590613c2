"""Look at, convert and export megazero checkpoints, in one process without process groups.

    python -m megazero.tools.checkpoint inspect CKPT [--iteration I] [--json]
    python -m megazero.tools.checkpoint convert CKPT OUT --tp N --pp M [--iteration I]
    python -m megazero.tools.checkpoint to-hf CKPT OUT [--dtype float32] [--format bin]
    python -m megazero.tools.checkpoint from-hf DIR OUT [--tp N --pp M]
    python -m megazero.tools.checkpoint to-fp32 CKPT OUT [--iteration I]
    python -m megazero.tools.checkpoint to-megatron CKPT OUT --tp N --pp M [--format mcore]
    python -m megazero.tools.checkpoint from-megatron MEGATRON_DIR OUT [--tp N --pp M]

``CKPT`` is a ``--save`` folder (with ``latest_checkpointed_iteration.txt``) saved at any
tp/pp/dp/ZeRO layout; it is read through ``CheckpointReader`` (memory-mapped, tensor by tensor).

* ``inspect``: iteration, layout, model shape, training state and, per tensor, its full shape,
  dtype, pipeline stage(s) and how it is split; totals of parameters and bytes.
* ``convert``: the same checkpoint at another layout (dp=1, ZeRO stage 0), for files at rest
  in the layout you will run: model, optimizer (fp32 main values and states as stage-0
  fragments, step, loss scaler), scheduler, iteration, consumed samples and args, so
  ``pretrain_gpt2.py --load OUT`` at that layout resumes. RNG states carry over when the grid
  is unchanged, else they are re-derived as the loader does (``checkpoint.rng``).
* ``to-hf`` / ``from-hf``: GPT-2 in Hugging Face's ``GPT2LMHeadModel`` layout (``tools.hf``)
  or the Llama family in ``LlamaForCausalLM``'s (``tools.hf_llama``); from-hf writes
  iteration ``release``, which megazero loads with --finetune semantics (iteration 0, no
  optimizer state), and copies the HF folder's ``vocab.json`` and ``merges.txt`` (or Llama's
  ``tokenizer.model``) into the checkpoint folder. to-hf exports the tokenizer (``vocab.json`` +
  ``merges.txt``, or ``tokenizer.model``) from ``--vocab-file``/``--merge-file`` or
  ``--tokenizer-model``, else from files inside the checkpoint folder.
* ``to-fp32``: one consolidated fp32 state dict (``zero_to_fp32``).
* ``to-megatron`` / ``from-megatron``, and ``inspect`` (alias ``describe``) of a Megatron-LM
  folder: Megatron's torch format at any tp/pp (``tools.megatron``).

A checkpoint's stored args are untrusted input: no tool opens or copies a path taken from them
(``vocab_file``, ``merge_file``, ``tokenizer_model``, ``data_path``, ``load``, ``save``,
``tensorboard_dir``, ...). Files are read only when the command line names them or when their
real path (symbolic links resolved) lies inside the checkpoint folder; a tokenizer the args
name elsewhere is left out of an export, with a note saying which flag brings it in.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys

import numpy as np
import torch

from megazero.checkpoint.paths import CheckpointError, iteration_dir
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.rng import get_rng_state, rederive_rng
from megazero.checkpoint.save import ARCH_DEFAULTS
from megazero.config import (
    ConfigError,
    DataConfig,
    MegazeroConfig,
    ModelConfig,
    ParallelConfig,
)
from megazero.tensor_parallel.layers import padded_vocab_size
from megazero.tensor_parallel.random import RNGStatesTracker
from megazero.tokenizer import TokenizerError, build_tokenizer
from megazero.tools import hf
from megazero.tools import megatron as megatron_tool
from megazero.tools.hf_llama import check_hf_exportable, export_hf, import_hf, model_flags
from megazero.tools.offline import offline_parallel_state, target_config, write_checkpoint
from megazero.tools.zero_to_fp32 import main as zero_to_fp32


def _iteration(value):
    if value is None or value == "release":
        return value
    return int(value)


# ---- flag types ------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in front of the message)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def iteration_arg(text: str) -> str:
    """argparse type: an iteration number >= 0 or ``release``."""
    if text != "release" and not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 0 or 'release', got {text!r}")
    return text


# ---- tokenizer files: only what the user names -----------------------------------------------
# (args field, file name in a checkpoint or HF folder, the flag that names it) per tokenizer
TOKENIZER_FILES = {
    "GPT2BPETokenizer": (("vocab_file", "vocab.json", "--vocab-file"),
                         ("merge_file", "merges.txt", "--merge-file")),
    "SentencePieceTokenizer": (("tokenizer_model", "tokenizer.model", "--tokenizer-model"),),
}


def file_inside(root: str, path) -> str | None:
    """The real path of ``path`` (a relative one is taken from ``root``) when it is a regular
    file whose real path lies inside ``root``'s, else None. Symbolic links are resolved first,
    so a link inside the folder that points out of it is refused."""
    if not isinstance(path, str) or not path:
        return None
    try:
        real_root = os.path.realpath(root)
        real = os.path.realpath(os.path.join(real_root, path))  # absolute paths stay as given
        if os.path.commonpath([real_root, real]) != real_root or not os.path.isfile(real):
            return None
    except (OSError, ValueError):  # NUL bytes, unreadable parents
        return None
    return real


def checkpoint_tokenizer_files(root: str, data: dict) -> tuple[dict[str, str], list[str]]:
    """({args field: real path}, notes) of the tokenizer of a checkpoint's ``data`` args, taken
    only from inside ``root``: the stored path when it lies inside the folder, else the
    conventional name (``vocab.json``, ``merges.txt``, ``tokenizer.model``) at its top. Paths
    the args name outside the folder are never opened; a note says which flag to pass."""
    kind = data.get("tokenizer_type")
    if kind not in TOKENIZER_FILES:
        return {}, []
    files, outside = {}, []
    for field, name, _ in TOKENIZER_FILES[kind]:
        stored = data.get(field)
        found = file_inside(root, stored) or file_inside(root, name)
        if found is None:
            outside.append(f"{field}={stored!r}")
        files[field] = found
    if not outside:
        return files, []
    flags = " and ".join(flag for _, _, flag in TOKENIZER_FILES[kind])
    return {}, [f"the tokenizer ({kind}) is not exported: the checkpoint's args name "
                f"{', '.join(outside)}, which is not a file inside the checkpoint folder "
                f"{root} (the tools read no other path a checkpoint names); pass {flags} "
                "to include it"]


def copy_into(src: str, folder: str, name: str) -> str:
    """Copy file ``src`` to ``folder/name`` atomically (temporary name, then rename)."""
    dst = os.path.join(folder, name)
    if os.path.exists(dst) and os.path.samefile(src, dst):
        return dst
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


# ---- inspect ---------------------------------------------------------------------------------
def _dtype_of(reader: CheckpointReader, name: str, stage: int) -> str:
    if reader.stage < 3:
        state = reader.model_file(0, stage)
        chunk = reader.meta(name).get("chunk", 0)
        model = state.get("model", state.get(f"model{chunk}", {}))
        if name in model:
            return str(model[name].dtype).replace("torch.", "")
    else:
        for d in range(reader.dp):
            for frag in reader.shard(0, stage, d)["fragments"].get(name, []):
                if "model" in frag:
                    return str(frag["model"].dtype).replace("torch.", "")
    return (reader.args["model"] or reader.args["optimizer"])["params_dtype"]


def _split(meta: dict, tp: int, stage: int, dp: int) -> str:
    local = meta["local_shape"]
    dim = meta.get("dim")
    if dim is None or tp == 1:
        text = "replicated" if tp > 1 else "whole"
        if dim is not None and local[dim] > meta["full_shape"][dim]:
            text += f" (padded to {local[dim]})"
    else:
        text = f"tp dim {dim}: {tp} x {local}"
        if local[dim] * tp > meta["full_shape"][dim]:
            text += f" (padded to {local[dim] * tp})"
    if stage >= 1:
        text += f"; ZeRO-{stage} fragments over dp={dp}"
    return text


def describe(reader: CheckpointReader) -> dict:
    """Everything ``inspect`` prints, as plain values."""
    args, lay = reader.args, reader.layout
    first = reader.model_file(0, 0)
    stages: dict[str, list[int]] = {}
    for p in range(reader.pp):
        for name in reader.model_file(0, p)["param_meta"]:
            stages.setdefault(name, []).append(p)
    tensors = []
    for name in reader.param_names():
        meta = reader.meta(name)
        dtype = _dtype_of(reader, name, stages[name][0])
        numel = int(np.prod(meta["full_shape"], dtype=np.int64))
        tensors.append({"name": name, "full_shape": list(meta["full_shape"]), "dtype": dtype,
                        "numel": numel, "stages": stages[name],
                        "split": _split(meta, reader.tp, reader.stage, reader.dp)})
    files = [os.path.join(d, f) for d, _, fs in os.walk(reader.base) for f in fs]
    model = args["model"]
    total = sum(t["numel"] for t in tensors)
    common = {"checkpoint": reader.root, "iteration": reader.iteration, "layout": lay,
              "world_size": lay["tp"] * lay["pp"] * lay["dp"],
              "consumed_train_samples": first.get("consumed_train_samples"),
              "scheduler": first.get("opt_param_scheduler"),
              "optimizer": _optimizer_summary(reader), "tensors": tensors,
              "total_parameters": total,
              "model_bytes": sum(t["numel"] * torch.empty(0, dtype=getattr(torch, t["dtype"]))
                                 .element_size() for t in tensors),
              "files": len(files), "bytes_on_disk": sum(os.path.getsize(f) for f in files)}
    if model is None:  # an engine's model (megazero.initialize): no GPT settings
        return {**common, "model": None, "architecture": {}, "padded_vocab_size": None,
                "tokenizer": None}
    return {**common,
            "model": {k: model.get(k) for k in (
                "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "seq_length", "max_position_embeddings", "vocab_size",
                "make_vocab_size_divisible_by", "params_dtype")},
            "architecture": _architecture(model),
            "padded_vocab_size": padded_vocab_size(model["vocab_size"],
                                                   model["make_vocab_size_divisible_by"],
                                                   lay["tp"]),
            "tokenizer": {k: args["data"].get(k) for k in (
                "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                "mock_data")}}


def _architecture(model: dict) -> dict:
    """The architecture-family settings that differ from GPT-2's (empty for GPT-2)."""
    return {k: model.get(k, v) for k, v in ARCH_DEFAULTS.items() if model.get(k, v) != v}


def _optimizer_summary(reader):
    meta = reader.optimizer_meta()
    if meta is None:
        return None
    return {"step": int(meta["step"]), "states": list(meta["state_names"]),
            "scaler": meta["scaler"], "optimizer": reader.args["optimizer"]["optimizer"]}


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_description(d: dict) -> str:
    lay, m = d["layout"], d["model"]
    lines = [f"checkpoint {d['checkpoint']}  iteration {d['iteration']}",
             f"layout: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} "
             f"zero_stage={lay['zero_stage']} virtual={lay.get('virtual')} "
             f"(world size {d['world_size']})"]
    if m is None:
        lines.append("model: trained by megazero's engine (not megazero's GPT): see the "
                     "tensors")
    else:
        lines += [
            f"model: num_layers={m['num_layers']} hidden_size={m['hidden_size']} "
            f"num_attention_heads={m['num_attention_heads']} "
            f"ffn_hidden_size={m['ffn_hidden_size']} seq_length={m['seq_length']} "
            f"max_position_embeddings={m['max_position_embeddings']} "
            f"vocab_size={m['vocab_size']} (padded {d['padded_vocab_size']} at tp="
            f"{lay['tp']}) params_dtype={m['params_dtype']}",
            "architecture: " + (" ".join(f"{k}={v}" for k, v in d["architecture"].items())
                                or "GPT-2")]
    sched = d["scheduler"] or {}
    opt = d["optimizer"]
    lines.append(f"training: consumed samples {d['consumed_train_samples']}, lr schedule at "
                 f"{sched.get('num_steps', '-')} samples; optimizer: "
                 + (f"{opt['optimizer']} step {opt['step']}, fp32 main + "
                    f"{', '.join(opt['states'])}, loss scale {opt['scaler'].get('scale')}"
                    if opt else "not saved"))
    tok = d["tokenizer"] or {}
    lines.append("tokenizer: " + ("none (an engine model)" if d["tokenizer"] is None else
                                  "mock data (ids)" if tok.get("mock_data") else
                                  f"{tok.get('tokenizer_type')} "
                                  f"{tok.get('tokenizer_model') or tok.get('vocab_file') or ''}"))
    rows = [("tensor", "full shape", "dtype", "stage", "split")]
    rows += [(t["name"], "x".join(map(str, t["full_shape"])), t["dtype"],
              ",".join(map(str, t["stages"])), t["split"]) for t in d["tensors"]]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines.append("")
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
        if i == 0:
            lines.append("-" * (sum(widths) + 2 * 4 + len(r[4])))
    dtypes = m["params_dtype"] if m else "/".join(sorted({t["dtype"] for t in d["tensors"]}))
    lines += ["", f"total: {d['total_parameters']:,} parameters (tied weights counted "
                  f"once), {d['model_bytes']:,} bytes ({_mb(d['model_bytes'])}) in "
                  f"{dtypes}; {d['files']} files, {_mb(d['bytes_on_disk'])} on disk"]
    return "\n".join(lines)


def cmd_inspect(a) -> int:
    if megatron_tool.describe_if_megatron(a, lambda d: json.dumps(d, indent=1, default=str)):
        return 0
    d = describe(CheckpointReader(a.checkpoint, _iteration(a.iteration)))
    print(json.dumps(d, indent=1, default=str) if a.json else format_description(d))
    return 0


# ---- convert ---------------------------------------------------------------------------------
def _rng_fn(reader: CheckpointReader, config: MegazeroConfig, first: dict):
    """Per-cell RNG states for the converted checkpoint: the saved ones when the (tp, pp, dp)
    grid is unchanged, else re-derived as ``checkpoint.load_checkpoint`` would."""
    if "rng_state" not in first or reader.iteration == "release":
        return None
    par = config.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if (reader.tp, reader.pp, reader.dp) == (tp, pp, 1):
        return lambda t, p: reader.model_file(t, p)["rng_state"]

    def derive(t, p):
        saved = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                tracker = RNGStatesTracker()
                rederive_rng(config.train.seed, int(first["iteration"]),
                             offline_parallel_state(tp, t, pp, p), tracker)
                return [get_rng_state(tracker)]
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])

    return derive


def cmd_convert(a) -> int:
    reader = CheckpointReader(a.checkpoint, _iteration(a.iteration))
    config = target_config(reader.args, a.tp, a.pp)
    if os.path.realpath(iteration_dir(a.output, reader.iteration)) == \
            os.path.realpath(reader.base):
        raise CheckpointError(f"convert would write over its source {reader.base}; choose "
                              "another output folder")
    first = reader.model_file(0, 0)
    opt = reader.optimizer_meta()
    iteration = reader.iteration
    base = write_checkpoint(
        a.output, iteration, config, full_tensor=reader.full_tensor,
        optimizer=opt, scheduler=first.get("opt_param_scheduler"),
        consumed_train_samples=int(first.get("consumed_train_samples", 0)),
        rng_fn=_rng_fn(reader, config, first), overwrite=a.force)
    tok_files, _ = checkpoint_tokenizer_files(reader.root, reader.args["data"])
    for field, name, _ in TOKENIZER_FILES.get(reader.args["data"].get("tokenizer_type"), ()):
        if field in tok_files:  # files inside the source folder travel with it
            copy_into(tok_files[field], a.output, name)
    lay = reader.layout
    print(f"converted {reader.base} (tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} "
          f"zero_stage={lay['zero_stage']}) to {base} (tp={a.tp} pp={a.pp} dp=1 "
          f"zero_stage=0), {'with' if opt else 'without'} optimizer state")
    return 0


# ---- Hugging Face ----------------------------------------------------------------------------
def _export_tokenizer(a, root: str, data: dict, model: dict):
    """(tokenizer type or None, {args field: path}, eod id or None) for to-hf: from the
    command line's files (an error when they do not load), else from files inside the
    checkpoint folder (left out, with a note, when they do not load), else none."""
    flags = {"vocab_file": a.vocab_file, "merge_file": a.merge_file,
             "tokenizer_model": a.tokenizer_model}
    files = {k: v for k, v in flags.items() if v}
    from_flags = bool(files)
    if from_flags:
        kind = "SentencePieceTokenizer" if a.tokenizer_model else "GPT2BPETokenizer"
    else:
        if data.get("mock_data"):
            return None, {}, model["vocab_size"] - 1
        kind = data.get("tokenizer_type")
        files, notes = checkpoint_tokenizer_files(root, data)
        for text in notes:
            _note(text)
        if not files:
            return None, {}, None
    try:
        tokenizer = build_tokenizer(kind, **files)
        if tokenizer.eod >= model["vocab_size"]:
            raise TokenizerError(f"its end-of-document id {tokenizer.eod} is outside the "
                                 f"model's vocabulary of {model['vocab_size']}")
    except TokenizerError as exc:
        if from_flags:
            raise
        _note(f"the tokenizer in the checkpoint folder is not exported: {exc}")
        return None, {}, None
    return kind, files, tokenizer.eod


def cmd_to_hf(a) -> int:
    reader = CheckpointReader(a.checkpoint, _iteration(a.iteration))
    kind = "main" if reader.has_optimizer() else "model"
    dtype = getattr(torch, a.dtype)
    model, data = reader.args["model"], reader.args["data"]
    check_hf_exportable(model)  # before anything is read or written
    tok_kind, tok_files, eod = _export_tokenizer(a, reader.root, data, model)
    full = {n: reader.full_tensor(n, kind).to(dtype) for n in reader.param_names()}
    tensors, cfg = export_hf(full, model, eos_token_id=eod, torch_dtype=a.dtype)
    path = hf.save_hf(a.output, tensors, cfg, a.format)
    names = [copy_into(tok_files[field], a.output, name)
             for field, name, _ in TOKENIZER_FILES.get(tok_kind, ())]
    print(f"wrote {len(tensors)} tensors ({kind} values, {a.dtype}) to {path} and config.json"
          + (f"; tokenizer: {', '.join(os.path.basename(n) for n in names)}" if names else ""))
    return 0


def cmd_from_hf(a) -> int:
    cfg, sd = hf.load_hf(a.hf_dir)
    model_args, full = import_hf(cfg, sd)
    n_layer = 1 + max(int(k.split(".")[1]) for k in full if k.startswith("layers."))
    if n_layer != model_args["num_layers"]:
        raise hf.HFFormatError(f"config.json says n_layer={model_args['num_layers']} but the "
                               f"weights hold {n_layer} layers")
    if os.path.exists(iteration_dir(a.output, "release")) and not a.force:
        raise CheckpointError(f"{iteration_dir(a.output, 'release')} already exists; remove "
                              "it, pass --force or write elsewhere")
    vocab, merges, spm = (os.path.join(os.path.abspath(a.hf_dir), f)
                          for f in ("vocab.json", "merges.txt", "tokenizer.model"))
    data = DataConfig()
    if os.path.isfile(spm):  # Llama's SentencePiece model, into the checkpoint folder
        os.makedirs(a.output, exist_ok=True)
        data = DataConfig(tokenizer_type="SentencePieceTokenizer",
                          tokenizer_model=os.path.abspath(copy_into(spm, a.output,
                                                                    "tokenizer.model")))
    elif os.path.isfile(vocab) and os.path.isfile(merges):  # into the checkpoint folder
        os.makedirs(a.output, exist_ok=True)
        data = DataConfig(tokenizer_type="GPT2BPETokenizer",
                          vocab_file=os.path.abspath(copy_into(vocab, a.output, "vocab.json")),
                          merge_file=os.path.abspath(copy_into(merges, a.output,
                                                               "merges.txt")))
    config = MegazeroConfig(
        model=ModelConfig(**model_args,
                          make_vocab_size_divisible_by=a.make_vocab_size_divisible_by),
        parallel=ParallelConfig(tensor_model_parallel_size=a.tp,
                                pipeline_model_parallel_size=a.pp, world_size=a.tp * a.pp),
        data=data)
    expected = {n: tuple(t.shape) for n, t in full.items()}
    wte = expected["embedding.word_embeddings.weight"]
    if wte[0] != model_args["vocab_size"]:
        raise hf.HFFormatError(f"wte has {wte[0]} rows but config.json vocab_size is "
                               f"{model_args['vocab_size']}")

    def tensor(name, kind):
        if name not in full:
            raise hf.HFFormatError(f"the HF checkpoint gives no value for {name}")
        return full[name].float()

    base = write_checkpoint(a.output, "release", config, full_tensor=tensor,
                            overwrite=a.force)
    print(f"wrote {base} (tp={a.tp} pp={a.pp}); load it with --load {a.output} (finetune "
          f"semantics) and the model flags {model_flags(model_args)}")
    return 0


def cmd_to_fp32(a) -> int:
    argv = [a.checkpoint, a.output] + ([] if a.iteration is None else
                                       ["--iteration", str(a.iteration)])
    return zero_to_fp32(argv)


# ---- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megazero.tools.checkpoint",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def ckpt(sp):
        sp.add_argument("checkpoint", help="the --save folder (with the tracker file)")
        sp.add_argument("--iteration", default=None, type=iteration_arg,
                        help="iteration to read (default: the tracker's)")

    s = sub.add_parser("inspect", aliases=["describe"],
                       help="layout, iteration, tensors and sizes (megazero or Megatron-LM)")
    ckpt(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--vocab-size", type=positive_int, default=None,
                   help="a Megatron checkpoint's true vocabulary (it stores it padded)")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("convert", help="write the checkpoint for another layout (dp=1, ZeRO 0)")
    ckpt(s)
    s.add_argument("output", help="folder to write (a --save folder)")
    s.add_argument("--tp", type=positive_int, required=True, help="tensor-model-parallel size")
    s.add_argument("--pp", type=positive_int, default=1, help="pipeline-model-parallel size")
    s.add_argument("--force", action="store_true", help="overwrite the iteration folder")
    s.set_defaults(fn=cmd_convert)
    s = sub.add_parser("to-hf", help="export to Hugging Face GPT2LMHeadModel or "
                       "LlamaForCausalLM files")
    ckpt(s)
    s.add_argument("output", help="folder for model.safetensors / pytorch_model.bin")
    s.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    s.add_argument("--format", default=None, choices=["safetensors", "bin"],
                   help="default: safetensors when the package is installed, else bin")
    g = s.add_argument_group(
        "tokenizer", "files to export with the weights (default: the tokenizer files inside "
                     "the checkpoint folder; paths in the checkpoint's args are never read)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model")
    s.set_defaults(fn=cmd_to_hf)
    s = sub.add_parser("from-hf", help="import Hugging Face GPT-2 or Llama as iteration "
                       "'release'")
    s.add_argument("hf_dir", help="folder with config.json and the weights")
    s.add_argument("output", help="folder to write (a --save folder)")
    s.add_argument("--tp", type=positive_int, default=1, help="tensor-model-parallel size")
    s.add_argument("--pp", type=positive_int, default=1, help="pipeline-model-parallel size")
    s.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    s.add_argument("--force", action="store_true", help="overwrite the release folder")
    s.set_defaults(fn=cmd_from_hf)
    s = sub.add_parser("to-fp32", help="one consolidated fp32 state dict (zero_to_fp32)")
    s.add_argument("checkpoint", help="the --save folder (with the tracker file)")
    s.add_argument("output", help="file to write")
    s.add_argument("--iteration", default=None, type=iteration_arg)
    s.set_defaults(fn=cmd_to_fp32)
    megatron_tool.add_commands(sub, ckpt, positive_int, iteration_arg)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "to-hf":
        if args.tokenizer_model and (args.vocab_file or args.merge_file):
            parser.error("--tokenizer-model (SentencePiece) and --vocab-file/--merge-file "
                         "(GPT-2 BPE) are exclusive")
        if bool(args.vocab_file) != bool(args.merge_file):
            parser.error("--vocab-file and --merge-file go together")
    try:
        return args.fn(args)
    except (CheckpointError, ConfigError, hf.HFFormatError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
