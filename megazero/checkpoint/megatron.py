"""Megatron-LM checkpoints (its ``torch`` format): detection, description and reading.

Megatron-LM writes the folder layout megazero uses, one file per (tp, pp) cell::

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt   args (argparse.Namespace),
        checkpoint_version 3.0, iteration, model (model0, model1, ... with virtual stages),
        optimizer, opt_param_scheduler, rng_state
    <root>/iter_0000100/mp_rank_TT[_PPP]/distrib_optim.pt     distributed optimizer (not read)

but no ``layout.json`` and no checksum sidecars (``is_megatron_checkpoint`` tells them apart),
with its own tensor names (``megatron_format``). Nothing here communicates: a
``MegatronReader`` reads the files of every cell (memory-mapped, unpickled with the
allow-list of ``megatron_format.load_megatron_file``) and joins each tensor's tp shards
(column-parallel along dim 0, row-parallel along dim 1, replicated ones from tp rank 0) and pp
stages (each numbers its layers from 0: offset by the layers of the stages and virtual chunks
before it, chunk by chunk as Megatron assigns them) into megazero's full logical tensors,
vocabulary padding stripped and SwiGLU's rows interleaved. ``read_flat`` cuts any layout's
local slice from them, so ``load_checkpoint`` loads a Megatron checkpoint at any tp/pp/dp/ZeRO
layout as it loads megazero's.

The optimizer state comes from Megatron's non-distributed ``optimizer`` entry: torch Adam (or
SGD) state indexed by parameter position in its param groups, plus the fp32 copies of 16-bit
parameters. Megatron groups parameters by weight decay (biases and 1-D tensors apart) and,
with a decoupled lr, embedding/output apart, each group in model order; the mapping rebuilds
that order from the file's model state and each group's ``wd_mult`` / ``is_decoupled_lr`` and
checks every count and shape. A distributed optimizer (``distrib_optim.pt``) is not mapped:
``no_optimizer_reason`` says so and the loader asks for --no-load-optim or --finetune.
"""

from __future__ import annotations

import logging
import os
import re
from functools import cache, lru_cache

import torch

from megazero.checkpoint.megatron_format import (
    VOCAB_PARALLEL,
    expected_shapes,
    flatten,
    interleave_swiglu,
    load_megatron_file,
    megazero_name,
    model_args_from_megatron,
    name_format,
    plain_args,
    scheduler_state,
)
from megazero.checkpoint.paths import (
    LAYOUT_FILE,
    MODEL_FILE,
    CheckpointError,
    checksum_path,
    foreign_file_error,
    iteration_dir,
    read_tracker,
    unsafe_globals,
)
from megazero.checkpoint.reshard import cut
from megazero.tensor_parallel.layers import padded_vocab_size

logger = logging.getLogger(__name__)

DISTRIB_OPTIM_FILE = "distrib_optim.pt"
_CELL = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_TORCH_DIST_MARKERS = ("metadata.json", ".metadata", "common.pt")


# ---- detection -------------------------------------------------------------------------------
def find_cells(base: str) -> dict[tuple[int, int], str]:
    """{(tp rank, pp rank): model file} of an iteration folder's ``mp_rank_*`` cells."""
    cells = {}
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        m = _CELL.match(entry)
        path = os.path.join(base, entry, MODEL_FILE)
        if m and os.path.isfile(path):
            cells[(int(m.group(1)), int(m.group(2) or 0))] = path
    return cells


def looks_megatron(state: dict) -> bool:
    """A loaded file's top level is Megatron's (model state and its version or args)."""
    return any(isinstance(state.get(k), dict) for k in ("model", "model0")) and (
        "checkpoint_version" in state or "args" in state) and "layout" not in state


def is_megatron_checkpoint(root: str, iteration=None) -> bool:
    """True for a Megatron-LM ``torch``-format checkpoint, False for megazero's (or a folder
    without one). A distributed (``torch_dist``) Megatron checkpoint, or a model file that is
    neither, is a ``CheckpointError`` saying what it is."""
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return False
    base = iteration_dir(root, iteration)
    if os.path.exists(os.path.join(base, LAYOUT_FILE)):
        return False
    cells = find_cells(base)
    if not cells:
        if any(os.path.exists(os.path.join(base, f)) for f in _TORCH_DIST_MARKERS):
            raise CheckpointError(
                f"{base} is a Megatron-core distributed (torch_dist) checkpoint; megazero reads "
                "Megatron's torch format: convert it with Megatron-LM (--ckpt-convert-format "
                "torch --ckpt-convert-save DIR)")
        return False
    path = cells[min(cells)]
    if os.path.exists(checksum_path(path)):
        return False
    if "argparse.Namespace" in unsafe_globals(path):
        return True
    state = load_megatron_file(path)
    if "layout" in state:
        return False
    if looks_megatron(state):
        return True
    raise CheckpointError(foreign_file_error(path, state))


# ---- the reader ------------------------------------------------------------------------------
class MegatronReader:
    """Full megazero tensors (and optimizer states) of one iteration of a Megatron-LM
    checkpoint, for any target layout (``read_flat``: the interface ``CheckpointReader``
    gives ``load_checkpoint``). ``vocab_size``: the true vocabulary (the files hold it
    padded); by default the one Megatron recorded, if any."""

    stage = 0  # the layout reported to the loader: every file is a (tp, pp) cell
    dp = 1

    def __init__(self, root: str, iteration=None, *, vocab_size: int | None = None):
        self.root = root
        if iteration is None:
            iteration = read_tracker(root)
            if iteration is None:
                raise CheckpointError(f"{root} has no latest_checkpointed_iteration.txt")
        self.iteration, self.base = iteration, iteration_dir(root, iteration)
        self.cells = find_cells(self.base)
        if not self.cells:
            raise CheckpointError(f"{self.base} holds no mp_rank_*/{MODEL_FILE}")
        self.tp = 1 + max(t for t, _ in self.cells)
        self.pp = 1 + max(p for _, p in self.cells)
        missing = [(t, p) for t in range(self.tp) for p in range(self.pp)
                   if (t, p) not in self.cells]
        if missing:
            raise CheckpointError(f"Megatron checkpoint {self.base} lacks the files of "
                                  f"(tp, pp) cells {missing}")
        self.file = cache(self._file)
        self.flat = cache(lambda t, p, chunk: flatten(self.file(t, p)[chunk]))
        first = self.file(0, 0)
        if first.get("args") is None:
            raise CheckpointError(f"Megatron checkpoint file {self.cells[0, 0]} holds no args: "
                                  "megazero takes the model's architecture from them")
        self.megatron_args = plain_args(first["args"])
        self.version = float(first.get("checkpoint_version", 0))
        if self.version < 2.0:
            raise CheckpointError(f"Megatron checkpoint {self.base} has checkpoint_version "
                                  f"{self.version}; megazero reads versions 2.0 and 3.0 (the "
                                  "[head, (q, k, v), head_dim] order of the fused QKV)")
        a = self.megatron_args
        for flag, n in (("tensor_model_parallel_size", self.tp),
                        ("pipeline_model_parallel_size", self.pp)):
            if a.get(flag) not in (None, n):
                raise CheckpointError(f"Megatron checkpoint {self.base}: args say {flag} "
                                      f"{a[flag]} but the folder holds {n} (files missing?)")
        self.chunks = sorted(k for k in first if re.fullmatch(r"model\d*", k))
        self.names = name_format(first[self.chunks[0]])
        self.model_args = model_args_from_megatron(a)
        self.padded_vocab = a.get("padded_vocab_size")
        self.vocab_size = vocab_size or a.get("vocab_size")
        iters = first.get("iteration", 0)
        self.saved_iteration = 0 if iteration == "release" else int(iters)
        self.layout = {"tp": self.tp, "pp": self.pp, "dp": int(a.get("data_parallel_size") or 1),
                       "virtual": len(self.chunks) if len(self.chunks) > 1 else None,
                       "zero_stage": 0}
        self._index = None
        self._optim: dict = {}
        self.full_tensor = lru_cache(maxsize=8)(self._full_tensor)  # ZeRO reads in fragments
        self._check_vocab_and_activation()

    def _check_vocab_and_activation(self) -> None:
        """Warn where megazero's model will differ from Megatron's: a vocabulary that
        Megatron's padding rule would not pad to the stored rows (another tokenizer?), and
        the exact (erf) GELU, where megazero's GPT-2 uses the tanh approximation."""
        a = self.megatron_args
        if self.vocab_size and self.padded_vocab:
            if self.vocab_size > self.padded_vocab:
                raise CheckpointError(f"the vocabulary of {self.vocab_size} tokens does not fit "
                                      f"the {self.padded_vocab} rows of {self.base}")
            rows = padded_vocab_size(self.vocab_size, a.get("make_vocab_size_divisible_by")
                                     or 128, self.tp)
            if rows != self.padded_vocab:
                logger.warning("a vocabulary of %d tokens pads to %d rows by the args of %s, "
                               "which holds %d: is the tokenizer the checkpoint's?",
                               self.vocab_size, rows, self.base, self.padded_vocab)
        tanh = a.get("openai_gelu") or (a.get("bias_gelu_fusion", True)
                                        and self.model_args["add_bias_linear"])
        if not self.model_args["swiglu"] and not tanh:
            logger.warning("the Megatron model of %s used the exact (erf) GELU; megazero's "
                           "uses the tanh approximation (Megatron's --openai-gelu): outputs "
                           "differ slightly", self.base)

    def _file(self, t: int, p: int) -> dict:
        state = load_megatron_file(self.cells[t, p])
        if not looks_megatron(state):
            raise CheckpointError(foreign_file_error(self.cells[t, p], state))
        return state

    @property
    def description(self) -> str:
        return (f"Megatron-LM checkpoint (version {self.version}, tp {self.tp}, pp {self.pp}, "
                f"{self.names} names)")

    @property
    def args(self) -> dict:
        """The model shape as megazero's checkpoints store it (``check_model_shape``)."""
        return {"model": dict(self.model_args), "megatron": self.megatron_args}

    def training_state(self) -> dict:
        """Iteration, consumed samples and the lr schedule (as megazero's scheduler state)."""
        first = self.file(0, 0)
        return {"iteration": self.saved_iteration,
                "consumed_train_samples": int(self.megatron_args.get("consumed_train_samples")
                                              or 0),
                "opt_param_scheduler": scheduler_state(first.get("opt_param_scheduler"))}

    # ---- files, as the loader checks them ------------------------------------------------
    def files(self, shards: bool = True) -> list[tuple[str, tuple]]:
        return [(self.cells[t, p], (t, p)) for p in range(self.pp) for t in range(self.tp)]

    def verify_files(self, files) -> None:
        """Unpickle the files (allow-listed classes only) and check that they belong together:
        the same version, iteration, name layout and parallel sizes as the first."""
        first = self.file(0, 0)
        for path, (t, p) in files:
            state = self.file(t, p)
            a = plain_args(state.get("args"))
            diffs = [k for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                 "num_layers", "hidden_size")
                     if a.get(k) != self.megatron_args.get(k)]
            diffs += [k for k in ("checkpoint_version", "iteration")
                      if state.get(k) != first.get(k)]
            if name_format(state.get(self.chunks[0], {})) != self.names:
                diffs.append("name layout")
            if diffs:
                raise CheckpointError(f"Megatron checkpoint file {path} does not belong with "
                                      f"{self.cells[0, 0]}: {', '.join(diffs)} differ")

    def mark_verified(self, paths) -> None:
        """Nothing to skip: Megatron files have no checksums."""

    # ---- where each megazero tensor lives ------------------------------------------------
    def index(self) -> dict[str, dict]:
        """megazero name -> {"dim", "pp", "chunk", "key"}: the Megatron key holding it."""
        if self._index is not None:
            return self._index
        tied = not self.model_args["untie_embeddings_and_output_weights"]
        layers, entries = {}, []
        for p in range(self.pp):
            for c, chunk in enumerate(self.chunks):
                for key in self.flat(0, p, chunk):
                    hit = megazero_name(key, self.names, tied)
                    if hit is not None:
                        entries.append((c, p, key, *hit))
                        if hit[1] is not None:
                            layers[c, p] = max(layers.get((c, p), 0), hit[1] + 1)
        offsets, total = {}, 0  # layers numbered chunk by chunk, stage by stage (Megatron's)
        for c in range(len(self.chunks)):
            for p in range(self.pp):
                offsets[c, p] = total
                total += layers.get((c, p), 0)
        index = {}
        for c, p, key, name, local, dim in entries:
            name = name.format(offsets[c, p] + local) if local is not None else name
            if name not in index:  # a tied embedding's first copy
                index[name] = {"dim": dim, "pp": p, "chunk": self.chunks[c], "key": key}
        want = expected_shapes(self.model_args, self.vocab_size or 1)
        extra, lacking = sorted(set(index) - set(want)), sorted(set(want) - set(index))
        if extra or lacking:
            raise CheckpointError(f"Megatron checkpoint {self.base} does not hold the model its "
                                  f"args describe: unexpected {extra[:6]}, missing "
                                  f"{lacking[:6]}")
        self._index = index
        return index

    def param_names(self) -> list[str]:
        return list(self.index())

    def _full_tensor(self, name: str, kind: str = "model") -> torch.Tensor:
        """The full logical tensor of megazero parameter ``name``: model values, or the
        optimizer's ``main`` fp32 values / a state (``kind``)."""
        where = self.index()[name]
        ranks = range(self.tp) if where["dim"] is not None else [0]
        pieces = [self._piece(t, where, kind) for t in ranks]
        if where["dim"] is None:  # replicated: tp rank 0's
            full = pieces[0]
        elif name.startswith("layers.") and name.split(".", 2)[2].startswith("mlp.fc1") \
                and self.model_args["swiglu"]:  # tp x [2 f/tp, h] ([gate; up]) -> [2 f, h]
            full = torch.cat([interleave_swiglu(x) for x in pieces])
        else:  # tp x [rows/tp, cols] -> [rows, cols] (dim 0) or [rows, cols/tp] -> (dim 1)
            full = torch.cat(pieces, dim=where["dim"])
        if name in VOCAB_PARALLEL:  # [Vp, h] -> [V, h]
            full = full[:self._vocab(full.shape[0])]
        shape = expected_shapes(self.model_args, self.vocab_size or full.shape[0])[name]
        if tuple(full.shape) != shape:
            raise CheckpointError(f"Megatron checkpoint {self.base}: {name} assembles to "
                                  f"{list(full.shape)}, the args describe {list(shape)}")
        return full

    def _vocab(self, rows: int) -> int:
        if self.vocab_size is None:
            raise CheckpointError(f"Megatron checkpoint {self.base} records its vocabulary "
                                  f"padded ({rows} rows) but not its true size: pass it "
                                  "(--vocab-size, or the tokenizer's)")
        if self.vocab_size > rows:
            raise CheckpointError(f"the vocabulary of {self.vocab_size} tokens does not fit the "
                                  f"{rows} rows of Megatron checkpoint {self.base}")
        return self.vocab_size

    def _piece(self, t: int, where: dict, kind: str) -> torch.Tensor:
        value = self.flat(t, where["pp"], where["chunk"])[where["key"]]  # tp rank t's shard
        if kind == "model":
            return value
        from_opt = self.optimizer_states(t, where["pp"])[0].get((where["chunk"], where["key"]))
        if from_opt is None:
            raise CheckpointError(f"Megatron checkpoint {self.base}: no optimizer state for "
                                  f"{where['key']}")
        if kind == "main" and "main" not in from_opt:
            return value.float()
        return from_opt[kind]

    def read_flat(self, name: str, kind: str, shard, local_shape, start: int = 0,
                  end: int | None = None) -> torch.Tensor:
        """Flat positions [start, end) of ``name``'s local tensor in the layout ``shard`` /
        ``local_shape`` describe (padding as zero)."""
        full = self.full_tensor(name, kind)
        if tuple(shard.full_shape) != tuple(full.shape):
            raise CheckpointError(f"{name}: the Megatron checkpoint holds full shape "
                                  f"{list(full.shape)}, the current model "
                                  f"{list(shard.full_shape)}")
        local = cut(full, shard, tuple(local_shape)).reshape(-1)
        return local[start:end]

    # ---- optimizer -----------------------------------------------------------------------
    def optimizer_states(self, t: int, p: int) -> tuple[dict, dict]:
        """({(chunk, key): {state name: tensor, "main": fp32 copy}}, {"step", "scaler",
        "state_names"}) of cell (t, p); ``NoOptimizerState`` when it cannot be mapped."""
        if (t, p) not in self._optim:
            try:
                self._optim[t, p] = map_optimizer(self, t, p)
            except NoOptimizerState as exc:
                self._optim[t, p] = exc
        found = self._optim[t, p]
        if isinstance(found, NoOptimizerState):
            raise found
        return found

    def optimizer_meta(self) -> dict | None:
        """step, scaler and state names of the optimizer, when every cell's maps onto the
        model (None otherwise: ``no_optimizer_reason`` says why)."""
        try:
            metas = [self.optimizer_states(t, p)[1] for p in range(self.pp)
                     for t in range(self.tp)]
        except NoOptimizerState:
            return None
        names = {tuple(m["state_names"]) for m in metas}
        if len(names) > 1:
            self._optim[0, 0] = NoOptimizerState(f"the cells hold different states {names}")
            return None
        return metas[0]

    def no_optimizer_reason(self) -> str:
        if self.optimizer_meta() is not None:
            return ""
        return "; ".join(sorted({str(e) for e in self._optim.values()
                                 if isinstance(e, NoOptimizerState)}))

    def has_optimizer(self) -> bool:
        return self.optimizer_meta() is not None


class NoOptimizerState(CheckpointError):
    """A Megatron optimizer state megazero cannot map (the message says why)."""


def _parameters(reader: MegatronReader, t: int, p: int) -> list[tuple[str, str, torch.Tensor]]:
    """(chunk, key, tensor) of every parameter of a file, in Megatron's parameter order (its
    state dicts list them in module order; ``_extra_state`` entries are no parameters)."""
    return [(chunk, key, v) for chunk in reader.chunks
            for key, v in reader.flat(t, p, chunk).items()
            if isinstance(v, torch.Tensor) and not key.endswith("_extra_state")]


def _embedding_or_output(key: str) -> bool:
    return key.endswith(("word_embeddings.weight", "output_layer.weight"))


def _group_kinds(groups: list[dict]) -> list[tuple[bool, bool]] | None:
    """(no weight decay, decoupled lr) of each param group, or None when the groups do not
    say (a single group takes every parameter)."""
    out = []
    decays = {g.get("weight_decay") for g in groups}
    for g in groups:
        if "wd_mult" in g:
            no_wd = float(g["wd_mult"]) == 0.0
        elif len(decays) > 1:  # older Megatron: weight_decay 0 marks the no-decay group
            no_wd = float(g.get("weight_decay") or 0.0) == 0.0
        else:
            return None
        out.append((no_wd, bool(g.get("is_decoupled_lr", False))))
    return out


def _assign(params, groups) -> list[list]:
    """The parameters of each group, in order (Megatron's ``_get_param_groups``)."""
    kinds = _group_kinds(groups)
    if kinds is None:
        if len(groups) != 1:
            raise NoOptimizerState("its param groups do not say which parameters they hold")
        return [list(params)]
    decoupled = any(d for _, d in kinds)
    queues: dict = {}
    for item in params:
        _, key, v = item
        kind = (key.endswith(".bias") or v.dim() == 1,
                decoupled and _embedding_or_output(key))
        queues.setdefault(kind, []).append(item)
    out = []
    for kind, g in zip(kinds, groups):
        queue, n = queues.get(kind, []), len(g["params"])
        if len(queue) < n:
            raise NoOptimizerState(f"a param group holds {n} parameters, the model has "
                                   f"{len(queue)} of its kind")
        out.append(queue[:n])
        queues[kind] = queue[n:]
    left = sum(len(q) for q in queues.values())
    if left:
        raise NoOptimizerState(f"{left} parameters are in no param group")
    return out


def map_optimizer(reader: MegatronReader, t: int, p: int) -> tuple[dict, dict]:
    """Map cell (t, p)'s optimizer state onto its parameters (see the module docstring)."""
    path = reader.cells[t, p]
    state = reader.file(t, p)
    opt = state.get("optimizer")
    if os.path.exists(os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILE)) or \
            reader.megatron_args.get("use_distributed_optimizer"):
        raise NoOptimizerState(
            f"{path} was saved by Megatron's distributed optimizer, whose states "
            f"({DISTRIB_OPTIM_FILE}, sharded over its dp ranks) megazero does not map")
    if opt is None:
        raise NoOptimizerState(f"{path} holds no optimizer (saved with --no-save-optim)")
    if isinstance(opt, list):  # ChainedOptimizer
        if len(opt) != 1:
            raise NoOptimizerState(f"{path} holds {len(opt)} chained optimizers (MoE?)")
        opt = opt[0]
    inner, fp32, scaler = opt, None, None
    if "state" not in opt and isinstance(opt.get("optimizer"), dict):  # 16-bit params
        inner, fp32, scaler = opt["optimizer"], opt.get("fp32_from_fp16_params"), \
            opt.get("grad_scaler")
    if "state" not in inner or "param_groups" not in inner:
        raise NoOptimizerState(f"{path}: optimizer entry with keys {sorted(inner)[:8]}, not "
                               "a torch optimizer's state")
    groups = inner["param_groups"]
    out, names, step = {}, None, None
    for gi, (g, members) in enumerate(zip(groups, _assign(_parameters(reader, t, p),
                                                          groups))):
        for j, (idx, (chunk, key, value)) in enumerate(zip(g["params"], members)):
            st = inner["state"].get(idx)
            if not st:
                raise NoOptimizerState(f"{path}: no optimizer state for {key}")
            tensors = {k: v for k, v in st.items() if k != "step"}
            if any(tuple(v.shape) != tuple(value.shape) for v in tensors.values()):
                raise NoOptimizerState(f"{path}: the optimizer state of {key} does not have "
                                       f"its shape {list(value.shape)}")
            names = names or sorted(tensors)
            step = st.get("step", step)
            if fp32 is not None:
                tensors["main"] = fp32[gi][j]
            out[chunk, key] = tensors
    scale = {"scale": 1.0}
    if isinstance(scaler, dict) and "scale" in scaler:
        scale = {"scale": float(scaler["scale"]),
                 "growth_tracker": int(scaler.get("growth_tracker", 0)),
                 "hysteresis_tracker": int(scaler.get("hysteresis_tracker",
                                                      reader.megatron_args.get("hysteresis", 2)))}
    step = int(step.item() if isinstance(step, torch.Tensor) else step or 0)
    return out, {"step": step, "scaler": scale, "state_names": names or []}


__all__ = ["DISTRIB_OPTIM_FILE", "MegatronReader", "NoOptimizerState", "find_cells",
           "is_megatron_checkpoint", "map_optimizer"]
