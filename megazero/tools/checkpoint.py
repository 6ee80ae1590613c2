"""Look at, convert and export megazero checkpoints, in one process without process groups.

    python -m megazero.tools.checkpoint inspect CKPT [--iteration I] [--json]
    python -m megazero.tools.checkpoint convert CKPT OUT --tp N --pp M [--iteration I]
    python -m megazero.tools.checkpoint to-hf CKPT OUT [--dtype float32] [--format bin]
    python -m megazero.tools.checkpoint from-hf DIR OUT [--tp N --pp M]
    python -m megazero.tools.checkpoint to-fp32 CKPT OUT [--iteration I]

``CKPT`` is a ``--save`` folder (with ``latest_checkpointed_iteration.txt``) saved at any
tp/pp/dp/ZeRO layout; it is read through ``CheckpointReader`` (memory-mapped, tensor by tensor).

* ``inspect``: iteration, layout, model shape, training state and, per tensor, its full shape,
  dtype, pipeline stage(s) and how it is split; totals of parameters and bytes.
* ``convert``: the same checkpoint at another layout (dp=1, ZeRO stage 0), for files at rest
  in the layout you will run: model, optimizer (fp32 main values and states as stage-0
  fragments, step, loss scaler), scheduler, iteration, consumed samples and args, so
  ``pretrain_gpt2.py --load OUT`` at that layout resumes. RNG states carry over when the grid
  is unchanged, else they are re-derived as the loader does (``checkpoint.rng``).
* ``to-hf`` / ``from-hf``: GPT-2 in Hugging Face's ``GPT2LMHeadModel`` layout (``tools.hf``);
  from-hf writes iteration ``release``, which megazero loads with --finetune semantics
  (iteration 0, no optimizer state). The tokenizer files of a GPT-2 BPE checkpoint travel too.
* ``to-fp32``: one consolidated fp32 state dict (``zero_to_fp32``).
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
from megazero.config import (
    ConfigError,
    DataConfig,
    MegazeroConfig,
    ModelConfig,
    ParallelConfig,
)
from megazero.tensor_parallel.layers import padded_vocab_size
from megazero.tensor_parallel.random import RNGStatesTracker
from megazero.tokenizer import build_tokenizer
from megazero.tools import hf
from megazero.tools.offline import offline_parallel_state, target_config, write_checkpoint
from megazero.tools.zero_to_fp32 import main as zero_to_fp32


def _iteration(value):
    if value is None or value == "release":
        return value
    return int(value)


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
    return reader.args["model"]["params_dtype"]


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
    elem = torch.empty(0, dtype=getattr(torch, model["params_dtype"])).element_size()
    total = sum(t["numel"] for t in tensors)
    return {"checkpoint": reader.root, "iteration": reader.iteration, "layout": lay,
            "world_size": lay["tp"] * lay["pp"] * lay["dp"],
            "model": {k: model.get(k) for k in (
                "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "seq_length", "max_position_embeddings", "vocab_size",
                "make_vocab_size_divisible_by", "params_dtype")},
            "padded_vocab_size": padded_vocab_size(model["vocab_size"],
                                                   model["make_vocab_size_divisible_by"],
                                                   lay["tp"]),
            "consumed_train_samples": first.get("consumed_train_samples"),
            "scheduler": first.get("opt_param_scheduler"),
            "optimizer": _optimizer_summary(reader),
            "tokenizer": {k: args["data"].get(k) for k in (
                "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                "mock_data")},
            "tensors": tensors, "total_parameters": total, "model_bytes": total * elem,
            "files": len(files), "bytes_on_disk": sum(os.path.getsize(f) for f in files)}


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
             f"(world size {d['world_size']})",
             f"model: num_layers={m['num_layers']} hidden_size={m['hidden_size']} "
             f"num_attention_heads={m['num_attention_heads']} "
             f"ffn_hidden_size={m['ffn_hidden_size']} seq_length={m['seq_length']} "
             f"max_position_embeddings={m['max_position_embeddings']} "
             f"vocab_size={m['vocab_size']} (padded {d['padded_vocab_size']} at tp="
             f"{lay['tp']}) params_dtype={m['params_dtype']}"]
    sched = d["scheduler"] or {}
    opt = d["optimizer"]
    lines.append(f"training: consumed samples {d['consumed_train_samples']}, lr schedule at "
                 f"{sched.get('num_steps', '-')} samples; optimizer: "
                 + (f"{opt['optimizer']} step {opt['step']}, fp32 main + "
                    f"{', '.join(opt['states'])}, loss scale {opt['scaler'].get('scale')}"
                    if opt else "not saved"))
    tok = d["tokenizer"]
    lines.append("tokenizer: " + ("mock data (ids)" if tok.get("mock_data") else
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
    lines += ["", f"total: {d['total_parameters']:,} parameters (tied word embedding counted "
                  f"once), {d['model_bytes']:,} bytes ({_mb(d['model_bytes'])}) in "
                  f"{m['params_dtype']}; {d['files']} files, {_mb(d['bytes_on_disk'])} on "
                  "disk"]
    return "\n".join(lines)


def cmd_inspect(a) -> int:
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
    lay = reader.layout
    print(f"converted {reader.base} (tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} "
          f"zero_stage={lay['zero_stage']}) to {base} (tp={a.tp} pp={a.pp} dp=1 "
          f"zero_stage=0), {'with' if opt else 'without'} optimizer state")
    return 0


# ---- Hugging Face ----------------------------------------------------------------------------
def _tokenizer_eod(data: dict, model: dict) -> int | None:
    if data.get("mock_data"):
        return model["vocab_size"] - 1
    try:
        return build_tokenizer(data["tokenizer_type"], vocab_file=data.get("vocab_file"),
                               merge_file=data.get("merge_file"),
                               tokenizer_model=data.get("tokenizer_model")).eod
    except Exception:  # noqa: BLE001 - no tokenizer files here: leave the ids unset
        return None


def cmd_to_hf(a) -> int:
    reader = CheckpointReader(a.checkpoint, _iteration(a.iteration))
    kind = "main" if reader.has_optimizer() else "model"
    dtype = getattr(torch, a.dtype)
    full = {n: reader.full_tensor(n, kind).to(dtype) for n in reader.param_names()}
    model, data = reader.args["model"], reader.args["data"]
    tensors = hf.megazero_to_hf(full, model["num_attention_heads"])
    cfg = hf.hf_config(model, eos_token_id=_tokenizer_eod(data, model), torch_dtype=a.dtype)
    path = hf.save_hf(a.output, tensors, cfg, a.format)
    if data.get("tokenizer_type") == "GPT2BPETokenizer":
        for src, dst in ((data.get("vocab_file"), "vocab.json"),
                         (data.get("merge_file"), "merges.txt")):
            if src and os.path.isfile(src):
                shutil.copyfile(src, os.path.join(a.output, dst))
    print(f"wrote {len(tensors)} tensors ({kind} values, {a.dtype}) to {path} and config.json")
    return 0


def cmd_from_hf(a) -> int:
    cfg, sd = hf.load_hf(a.hf_dir)
    model_args = hf.model_args_from_hf(cfg)
    full = hf.hf_to_megazero(sd, model_args["num_attention_heads"])
    n_layer = 1 + max(int(k.split(".")[1]) for k in full if k.startswith("layers."))
    if n_layer != model_args["num_layers"]:
        raise hf.HFFormatError(f"config.json says n_layer={model_args['num_layers']} but the "
                               f"weights hold {n_layer} layers")
    vocab, merges = (os.path.join(os.path.abspath(a.hf_dir), f)
                     for f in ("vocab.json", "merges.txt"))
    data = DataConfig()
    if os.path.isfile(vocab) and os.path.isfile(merges):
        data = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                          merge_file=merges)
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
          f"semantics) and the model flags --num-layers {model_args['num_layers']} "
          f"--hidden-size {model_args['hidden_size']} --num-attention-heads "
          f"{model_args['num_attention_heads']} --ffn-hidden-size "
          f"{model_args['ffn_hidden_size']} --max-position-embeddings "
          f"{model_args['max_position_embeddings']}")
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
        sp.add_argument("--iteration", default=None,
                        help="iteration to read (default: the tracker's)")

    s = sub.add_parser("inspect", help="layout, iteration, tensors and sizes")
    ckpt(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("convert", help="write the checkpoint for another layout (dp=1, ZeRO 0)")
    ckpt(s)
    s.add_argument("output", help="folder to write (a --save folder)")
    s.add_argument("--tp", type=int, required=True, help="tensor-model-parallel size")
    s.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    s.add_argument("--force", action="store_true", help="overwrite the iteration folder")
    s.set_defaults(fn=cmd_convert)
    s = sub.add_parser("to-hf", help="export to Hugging Face GPT2LMHeadModel files")
    ckpt(s)
    s.add_argument("output", help="folder for model.safetensors / pytorch_model.bin")
    s.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    s.add_argument("--format", default=None, choices=["safetensors", "bin"],
                   help="default: safetensors when the package is installed, else bin")
    s.set_defaults(fn=cmd_to_hf)
    s = sub.add_parser("from-hf", help="import Hugging Face GPT-2 as iteration 'release'")
    s.add_argument("hf_dir", help="folder with config.json and the weights")
    s.add_argument("output", help="folder to write (a --save folder)")
    s.add_argument("--tp", type=int, default=1, help="tensor-model-parallel size")
    s.add_argument("--pp", type=int, default=1, help="pipeline-model-parallel size")
    s.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    s.add_argument("--force", action="store_true", help="overwrite the release folder")
    s.set_defaults(fn=cmd_from_hf)
    s = sub.add_parser("to-fp32", help="one consolidated fp32 state dict (zero_to_fp32)")
    s.add_argument("checkpoint", help="the --save folder (with the tracker file)")
    s.add_argument("output", help="file to write")
    s.add_argument("--iteration", default=None)
    s.set_defaults(fn=cmd_to_fp32)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CheckpointError, ConfigError, hf.HFFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
