"""Megatron-LM checkpoints, both directions, at any layout (``checkpoint.megatron``).

Without megatron-core: Megatron's files are built here by hand (``_build_megatron``: its own
name tables and tp/pp cutting, independent of megazero's reader and writer) from the full
tensors of a megazero run saved after 4 of 8 iterations, with Megatron's optimizer state
(torch Adam, Megatron-core's param groups) and an ``args`` Namespace holding enums and numpy
RNG state; ``--load`` of them at other layouts must continue with the losses and parameters of
the uninterrupted run. Also: to-megatron -> from-megatron gives the tensors back bit for bit,
``--use-checkpoint-args`` and a refused resume with another model shape, the distributed
optimizer's message, and the messages for foreign files.

With megatron-core (``pip install --no-deps megatron-core==0.16.1``; skipped otherwise): its
``GPTModel`` (local layer spec, CPU, gloo; the CPU shims of ``benchmarks/bench_megatron.py``)
is built Llama-like and GPT-2-like, saved in Megatron-LM's file layout (with a torch AdamW
state after a few training steps, in Megatron's param groups), loaded by megazero at another
tp/pp, and the logits compared with Megatron-core's (fp32, 1e-5); a megazero model exported
with to-megatron loads into ``GPTModel`` (strict) and gives megazero's logits; a loaded
Megatron checkpoint trains on in megazero with its optimizer state.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import random
import signal
import sys
import types

import numpy as np
import pytest
import torch

from megazero.checkpoint import (
    CheckpointError,
    CheckpointReader,
    MegatronReader,
    checkpoint_model_args,
)
from megazero.checkpoint.megatron_format import interleave_swiglu, split_swiglu
from megazero.tools.checkpoint import main as tool
from tests.train_helper import TINY, assert_same_run, run_training

LLAMA = (" --position-embedding-type rope --normalization RMSNorm --swiglu "
         "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
         "--disable-bias-linear")
ITERS = " --train-iters 8"
VOCAB, MEGATRON_DIVISIBLE_BY = 96, 128  # Megatron pads to 128 x tp: 256 rows at tp 2

# ---- Megatron's files, by hand ---------------------------------------------------------------
# (Megatron-core suffix, legacy suffix, megazero suffix, tp split: 0 column, 1 row, None)
LAYER = [("input_layernorm", "input_norm", "input_layernorm", None),
         ("self_attention.linear_proj", "self_attention.dense", "attention.proj", 1),
         ("self_attention.linear_qkv", "self_attention.query_key_value", "attention.qkv", 0),
         ("pre_mlp_layernorm", "post_attention_norm", "post_attention_layernorm", None),
         ("mlp.linear_fc1", "mlp.dense_h_to_4h", "mlp.fc1", 0),
         ("mlp.linear_fc2", "mlp.dense_4h_to_h", "mlp.fc2", 1)]


def _enum(module: str, qualname: str, member: str):
    """A member of Megatron's enum ``module.qualname`` (a look-alike in a stand-in module
    when megatron-core is not installed), to be pickled into args as Megatron does."""
    try:
        return getattr(getattr(importlib.import_module(module), qualname), member)
    except ImportError:
        pass
    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # pickle imports the module, parents first
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    mod = sys.modules[module]
    cls = getattr(mod, qualname, None) or enum.Enum(qualname, {member: 1}, module=module)
    setattr(mod, qualname, cls)
    return cls[member]


def _cut(full, dim, tp, *, swiglu=False, rows=None):
    """Each tp rank's piece of a full tensor, cut as Megatron holds it."""
    if rows is not None:  # vocabulary padding
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    if dim is None:
        return [full.clone() for _ in range(tp)]
    if swiglu:  # per rank [gate_r; up_r]; megazero interleaves (gate, up) rows
        gate, up = full[0::2], full[1::2]
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return [c.clone() for c in full.chunk(tp, dim=dim)]


def _stage_entries(model: dict, fmt: str, p: int, pp: int, c: int = 0, vp: int = 1):
    """(Megatron key, megazero name, split, vocab-padded) of virtual chunk c of stage p, in
    Megatron's parameter order (legacy registers qkv before dense). Chunk c of stage p holds
    layers ``[(c pp + p) L / (pp vp), ...)``, numbered from 0."""
    per = model["num_layers"] // (pp * vp)
    first, last = p == 0 and c == 0, p == pp - 1 and c == vp - 1
    tied, ln = not model["untied"], ("weight",) if model["rms"] else ("weight", "bias")
    bias = ("weight", "bias") if model["bias"] else ("weight",)
    emb = "language_model.embedding." if fmt == "legacy" else "embedding."
    out = []
    if first:
        out.append((emb + "word_embeddings.weight", "embedding.word_embeddings.weight", 0, True))
        if model["learned"]:
            out.append((emb + "position_embeddings.weight",
                        "embedding.position_embeddings.weight", None, False))
    order = LAYER if fmt == "mcore" else [LAYER[0], LAYER[2], LAYER[1], *LAYER[3:]]
    for local in range(per):
        for mcore, legacy, ours, dim in order:
            for w in (ln if "norm" in ours else bias):
                key = f"decoder.layers.{local}.{mcore}.{w}" if fmt == "mcore" else \
                    f"language_model.encoder.layers.{local}.{legacy}.{w}"
                split = dim if w == "weight" or dim == 0 else None
                out.append((key, f"layers.{(c * pp + p) * per + local}.{ours}.{w}", split,
                            False))
    if last:
        norm = "decoder.final_layernorm." if fmt == "mcore" else \
            "language_model.encoder.final_norm."
        out += [(norm + w, f"final_layernorm.{w}", None, False) for w in ln]
        if not tied:
            out.append(("output_layer.weight" if fmt == "mcore" else
                        "language_model.output_layer.weight", "output_layer.weight", 0, True))
        elif not first:
            out.append(("output_layer.weight" if fmt == "mcore" else
                        "word_embeddings_for_head.weight", "embedding.word_embeddings.weight",
                        0, True))
    return out


def _nest(flat: dict, fmt: str) -> dict:
    if fmt == "mcore":
        return flat
    tree = {}
    for key, v in flat.items():
        if key.startswith("language_model.encoder."):
            tree.setdefault("language_model", {}).setdefault("encoder", {})[key[23:]] = v
            continue
        node, parts = tree, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = v
    return tree


def _build_megatron(root, src: CheckpointReader, *, fmt: str, tp: int, pp: int, vp: int = 1,
                    optimizer: str = "adam"):
    """Megatron-LM files of the megazero checkpoint ``src`` (its full tensors), at (tp, pp):
    args Namespace, model, and (``optimizer``) Megatron-core's torch-format optimizer state,
    ``"distributed"``: a distrib_optim.pt instead, ``None``: none."""
    m = src.args["model"]
    model = {"num_layers": m["num_layers"], "untied": m["untie_embeddings_and_output_weights"],
             "rms": m["normalization"] == "RMSNorm", "bias": m["add_bias_linear"],
             "learned": m["position_embedding_type"] == "learned_absolute"}
    rows = -(-VOCAB // (MEGATRON_DIVISIBLE_BY * tp)) * MEGATRON_DIVISIBLE_BY * tp
    state = src.training_state()
    opt_meta = src.optimizer_meta()
    sched = state["opt_param_scheduler"]
    args = argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        ffn_hidden_size=m["ffn_hidden_size"], num_attention_heads=m["num_attention_heads"],
        group_query_attention=m["group_query_attention"],
        num_query_groups=m["num_query_groups"] or 1, kv_channels=m["hidden_size"] // 4,
        max_position_embeddings=m["max_position_embeddings"], seq_length=16,
        position_embedding_type=m["position_embedding_type"], rotary_base=m["rotary_base"],
        rotary_percent=m["rotary_percent"], normalization=m["normalization"],
        norm_epsilon=1e-5, swiglu=m["swiglu"], openai_gelu=True,
        untie_embeddings_and_output_weights=model["untied"], add_bias_linear=model["bias"],
        padded_vocab_size=rows, make_vocab_size_divisible_by=MEGATRON_DIVISIBLE_BY,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        consumed_train_samples=state["consumed_train_samples"], params_dtype=torch.float32,
        use_distributed_optimizer=optimizer == "distributed", exit_signal=signal.SIGTERM,
        model_type=_enum("megatron.core.enums", "ModelType", "encoder_or_decoder"),
        attention_backend=_enum("megatron.core.transformer.enums", "AttnBackend", "auto"),
        lr=1e-3, min_lr=0.0, weight_decay=0.1, micro_batch_size=2, global_batch_size=8)
    kinds = ["model"] + (["main", "exp_avg", "exp_avg_sq"] if optimizer == "adam" else [])
    full = {(n, k): src.full_tensor(n, k) for n in src.param_names() for k in kinds}
    iteration = int(state["iteration"])
    for p in range(pp):
        chunks = [_stage_entries(model, fmt, p, pp, c, vp) for c in range(vp)]
        entries = [e for chunk in chunks for e in chunk]  # the optimizer's order
        pieces = {}
        for _, name, dim, vocab in entries:
            for k in kinds:
                cut = _cut(full[name, k], dim, tp, rows=rows if vocab else None,
                           swiglu=m["swiglu"] and ".mlp.fc1." in name)
                for t in range(tp):  # a megazero name is one tensor of a stage's file
                    pieces[t, name, k] = cut[t]
        for t in range(tp):
            models = {}
            for c, chunk in enumerate(chunks):
                flat = {key: pieces[t, name, "model"] for key, name, *_ in chunk}
                if fmt == "mcore":  # Megatron-core's linear layers add an empty _extra_state
                    for key in list(flat):
                        if key.endswith("linear_fc2.weight"):
                            flat[key[:-6] + "_extra_state"] = None
                models["model" if vp == 1 else f"model{c}"] = _nest(flat, fmt)
            state_t = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                       **models,
                       "rng_state": [{"random_rng_state": random.getstate(),
                                      "np_rng_state": np.random.get_state(),
                                      "torch_rng_state": torch.get_rng_state(),
                                      "rng_tracker_states": {}}]}
            if optimizer == "adam":
                decay = [name for key, name, *_ in entries if not key.endswith(".bias")
                         and pieces[t, name, "model"].dim() > 1]
                no_decay = [name for _, name, *_ in entries if name not in decay]
                order = decay + no_decay  # Megatron-core 0.16: the default group first
                st = {i: {"step": torch.tensor(float(opt_meta["step"])),
                          "exp_avg": pieces[t, name, "exp_avg"],
                          "exp_avg_sq": pieces[t, name, "exp_avg_sq"]}
                      for i, name in enumerate(order)}
                groups = [{"params": list(range(len(decay))), "wd_mult": 1.0, "lr": 1e-3,
                           "weight_decay": 0.1},
                          {"params": list(range(len(decay), len(order))), "wd_mult": 0.0,
                           "lr": 1e-3, "weight_decay": 0.0}]
                state_t["optimizer"] = {"state": st, "param_groups": groups}
                state_t["opt_param_scheduler"] = {
                    "max_lr": sched["max_lr"], "lr_warmup_steps": sched["warmup_steps"],
                    "num_steps": sched["num_steps"], "lr_decay_style": sched["decay_style"],
                    "lr_decay_steps": sched["decay_steps"], "min_lr": sched["min_lr"],
                    "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
                    "wd_incr_steps": 0}
            folder = root / f"iter_{iteration:07d}" / (
                f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(state_t, folder / "model_optim_rng.pt")
            if optimizer == "distributed":
                torch.save({"param_state": {}}, folder / "distrib_optim.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return root


# ---- no megatron-core needed -----------------------------------------------------------------
def test_swiglu_layouts_are_inverse():
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)  # [ffn=8, (gate, up)]
    for tp in (1, 2, 4):
        shards = split_swiglu(full, tp)
        assert torch.equal(torch.cat([interleave_swiglu(s) for s in shards]), full)
        assert torch.equal(shards[0][:8 // tp], full[0::2][:8 // tp])  # gate rows first


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The uninterrupted 8-iteration Llama-like run and the same run saved after 4."""
    root = tmp_path_factory.mktemp("llama")
    full = run_training(TINY + LLAMA + ITERS, 1)
    run_training(TINY + LLAMA + ITERS + f" --exit-interval 4 --save {root / 'mz'}", 1)
    return root, full


def _continues(run, reference, what):
    losses, params, _ = reference
    assert_same_run(run, (losses[4:], params, None), what=what, kv_groups=2)


@pytest.mark.parametrize("fmt,tp,pp,vp,layout,world", [
    ("mcore", 2, 2, 1, " --pipeline-model-parallel-size 2 --zero-stage 1", 2),
    ("legacy", 2, 2, 1, " --tensor-model-parallel-size 2 --sequence-parallel", 2),
    ("mcore", 1, 2, 2, " --zero-stage 3", 2),
])
def test_megatron_files_resume_exactly_at_another_layout(llama, fmt, tp, pp, vp, layout,
                                                         world):
    """Megatron files (GQA, SwiGLU, untied, RMSNorm, RoPE, no biases; tp2 pp2, or pp2 with 2
    virtual chunks per stage) with Megatron's optimizer state: megazero continues as if never
    stopped."""
    root, reference = llama
    src = CheckpointReader(str(root / "mz"))
    meg = _build_megatron(root / f"meg-{fmt}-{tp}{pp}{vp}", src, fmt=fmt, tp=tp, pp=pp, vp=vp)
    reader = MegatronReader(str(meg), vocab_size=VOCAB)
    assert reader.description == \
        f"Megatron-LM checkpoint (version 3.0, tp {tp}, pp {pp}, {fmt} names)"
    for name in src.param_names():
        for kind in ("model", "main", "exp_avg", "exp_avg_sq"):
            assert torch.equal(reader.full_tensor(name, kind), src.full_tensor(name, kind))
    run = run_training(TINY + LLAMA + ITERS + f" --load {meg}" + layout, world)
    assert run[2][-1]["history"]["consumed_train_samples"] == 64
    _continues(run, reference, f"Megatron {fmt} tp{tp} pp{pp} vp{vp} -> megazero{layout}")


def test_args_enums_and_rng_arrays_load_as_inert_records(llama, tmp_path):
    root, _ = llama
    meg = _build_megatron(tmp_path / "meg", CheckpointReader(str(root / "mz")), fmt="mcore",
                          tp=1, pp=1)
    reader = MegatronReader(str(meg), vocab_size=VOCAB)
    a = reader.megatron_args
    assert a["model_type"] == 1 and a["exit_signal"] == signal.SIGTERM.value
    assert a["params_dtype"] is torch.float32 and reader.model_args["swiglu"]
    assert reader.optimizer_meta()["step"] == 4


def test_optimizer_layouts_of_other_megatron_versions(llama, tmp_path):
    """16-bit parameters (fp32 copies and the loss scaler around torch Adam's state) and the
    param groups of older Megatron (no wd_mult: weight decay 0 marks the no-decay group, here
    first) map as Megatron-core 0.16's plain fp32 optimizer does."""
    root, _ = llama
    src = CheckpointReader(str(root / "mz"))
    meg = _build_megatron(tmp_path / "meg", src, fmt="legacy", tp=2, pp=1)
    scaler = {"scale": 1024.0, "growth_tracker": 3, "hysteresis_tracker": 1}
    for t in range(2):
        path = meg / "iter_0000004" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)  # made by this test
        inner = state["optimizer"]
        inner["param_groups"] = [{k: v for k, v in g.items() if k != "wd_mult"}
                                 for g in inner["param_groups"]][::-1]
        fp32 = [[inner["state"][i]["exp_avg"] + 1.0 for i in g["params"]]
                for g in inner["param_groups"]]  # recognisable fp32 values
        state["optimizer"] = {"optimizer": inner, "fp32_from_fp16_params": fp32,
                              "grad_scaler": {**scaler, "scale": torch.tensor(1024.0)}}
        torch.save(state, path)
    reader = MegatronReader(str(meg), vocab_size=VOCAB)
    assert reader.optimizer_meta()["scaler"] == scaler
    for name in src.param_names():
        exp_avg = src.full_tensor(name, "exp_avg")
        assert torch.equal(reader.full_tensor(name, "exp_avg"), exp_avg), name
        assert torch.equal(reader.full_tensor(name, "main"), exp_avg + 1.0), name


def test_to_megatron_and_from_megatron(llama, tmp_path, capsys):
    """to-megatron (both name layouts, tp2 pp2) -> from-megatron gives every tensor back bit
    for bit; --load of the export needs --no-load-optim (it holds the model only) and starts
    from the saved weights; from-megatron of Megatron files with an optimizer resumes exactly."""
    root, (losses, params, _) = llama
    mz = str(root / "mz")
    src = CheckpointReader(mz)
    for fmt in ("mcore", "legacy"):
        out, back = str(tmp_path / f"meg-{fmt}"), str(tmp_path / f"back-{fmt}")
        assert tool(["to-megatron", mz, out, "--tp", "2", "--pp", "2", "--format", fmt]) == 0
        assert tool(["describe", out, "--vocab-size", str(VOCAB)]) == 0
        text = capsys.readouterr().out
        assert f"Megatron-LM checkpoint (version 3.0, tp 2, pp 2, {fmt} names)" in text
        assert "iteration 4" in text and "not loadable" in text
        assert tool(["from-megatron", out, back]) == 0  # the vocabulary is in its args
        again = CheckpointReader(back)
        assert again.layout["tp"] == again.layout["pp"] == 1 and again.iteration == 4
        for name in src.param_names():
            assert torch.equal(again.full_tensor(name, "model"), src.full_tensor(name, "model"))
    meg = str(tmp_path / "meg-mcore")
    with pytest.raises(RuntimeError, match="--no-load-optim"):
        run_training(TINY + LLAMA + ITERS + f" --load {meg}", 1)
    first, *_ = run_training(TINY + LLAMA + ITERS + f" --load {meg} --no-load-optim", 1)
    assert len(first) == 4 and first[0] == pytest.approx(losses[4], rel=1e-5)
    hand = _build_megatron(tmp_path / "hand", src, fmt="legacy", tp=2, pp=1)
    assert tool(["from-megatron", str(hand), str(tmp_path / "hand-mz"), "--pp", "2",
                 "--vocab-size", str(VOCAB)]) == 0
    run = run_training(TINY + LLAMA + ITERS + f" --load {tmp_path / 'hand-mz'} "
                       "--pipeline-model-parallel-size 2", 2)
    assert_same_run(run, (losses[4:], params, None), what="from-megatron", kv_groups=2)


def test_use_checkpoint_args_and_a_different_shape(llama, tmp_path):
    root, (losses, params, _) = llama
    meg = _build_megatron(tmp_path / "meg", CheckpointReader(str(root / "mz")), fmt="mcore",
                          tp=2, pp=1)
    with pytest.raises(RuntimeError, match="different model shape.*normalization: "
                                           "checkpoint RMSNorm vs current LayerNorm"):
        run_training(TINY + ITERS + f" --load {meg}", 1)
    run = run_training(TINY + ITERS + f" --load {meg} --use-checkpoint-args", 1)
    assert_same_run(run, (losses[4:], params, None), what="--use-checkpoint-args",
                    kv_groups=2)


def test_distributed_optimizer_state_asks_for_no_load_optim(llama, tmp_path):
    root, (losses, _, _) = llama
    meg = _build_megatron(tmp_path / "meg", CheckpointReader(str(root / "mz")), fmt="mcore",
                          tp=1, pp=2, optimizer="distributed")
    reader = MegatronReader(str(meg), vocab_size=VOCAB)
    assert not reader.has_optimizer() and "distrib_optim.pt" in reader.no_optimizer_reason()
    with pytest.raises(RuntimeError, match="distributed optimizer.*--no-load-optim"):
        run_training(TINY + LLAMA + ITERS + f" --load {meg}", 1)
    run, *_ = run_training(TINY + LLAMA + ITERS + f" --load {meg} --no-load-optim", 1)
    assert len(run) == 4 and run[0] == pytest.approx(losses[4], rel=1e-5)  # its iteration


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    full = run_training(TINY + ITERS, 1)
    run_training(TINY + ITERS + f" --exit-interval 4 --save {root / 'mz'}", 1)
    return root, full


@pytest.mark.parametrize("fmt,tp,pp,layout,world", [
    ("mcore", 1, 2, "", 1),
    ("legacy", 2, 2, " --pipeline-model-parallel-size 2", 2),
])
def test_tied_gpt2_with_the_heads_copy(gpt2, tmp_path, fmt, tp, pp, layout, world):
    """GPT-2 (LayerNorm, biases, learned positions, tied output layer): the last stage's copy
    of the tied embedding (output_layer / word_embeddings_for_head) is its optimizer's too."""
    root, (losses, params, _) = gpt2
    meg = _build_megatron(tmp_path / "meg", CheckpointReader(str(root / "mz")), fmt=fmt,
                          tp=tp, pp=pp)
    run = run_training(TINY + ITERS + f" --load {meg}" + layout, world)
    assert_same_run(run, (losses[4:], params, None), what=f"GPT-2 {fmt} tp{tp} pp{pp}")


class Foreign:
    """A class of this module, pickled into a file megazero must refuse to unpickle."""


def _file_in_checkpoint(root, obj):
    folder = root / "iter_0000001" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save(obj, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    return str(root)


def test_foreign_files_are_named_not_called_corrupt(tmp_path, capsys):
    plain = _file_in_checkpoint(tmp_path / "plain", torch.nn.Linear(2, 3).state_dict())
    other = _file_in_checkpoint(tmp_path / "other", {"model": Foreign(), "step": 3})
    for root, keys in ((plain, "top-level keys ['weight', 'bias']"),
                       (other, "top-level keys ['model', 'step']")):
        for command in (["inspect", root], ["to-hf", root, str(tmp_path / "hf")],
                        ["convert", root, str(tmp_path / "c"), "--tp", "1"],
                        ["from-megatron", root, str(tmp_path / "f")]):
            assert tool(command) == 1, command
            err = capsys.readouterr().err
            assert "this file is not a megazero/Megatron checkpoint: " + keys in err, err
            assert "corrupt" not in err and "KeyError" not in err
    assert "pickles classes megazero does not load: tests.test_megatron_checkpoint.Foreign" \
        in err
    with pytest.raises(RuntimeError, match=r"not a megazero/Megatron checkpoint: top-level "
                                           r"keys \['weight', 'bias'\]"):
        run_training(TINY + " --train-iters 4" + f" --load {plain}", 1)


def test_megatron_files_that_cannot_be_read_say_why(llama, tmp_path, capsys):
    root, _ = llama
    src = CheckpointReader(str(root / "mz"))
    meg = _build_megatron(tmp_path / "meg", src, fmt="mcore", tp=1, pp=1)
    assert tool(["to-hf", str(meg), str(tmp_path / "hf")]) == 1  # megazero-only tools
    err = capsys.readouterr().err
    assert "is a Megatron-LM file" in err and "from-megatron" in err and "corrupt" not in err
    path = meg / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].save_dir = __import__("pathlib").PurePosixPath("/elsewhere")
    torch.save(state, path)
    assert tool(["describe", str(meg)]) == 1
    assert "pickles classes megazero does not load: pathlib.PurePosixPath" in \
        capsys.readouterr().err
    del state["args"]
    torch.save(state, path)
    assert tool(["describe", str(meg)]) == 1
    assert "holds no args" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="holds no args"):  # --use-checkpoint-args
        checkpoint_model_args(str(meg))
    dist_ckpt = tmp_path / "dist" / "iter_0000004"
    dist_ckpt.mkdir(parents=True)
    (dist_ckpt / "metadata.json").write_text("{}")
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("4")
    assert tool(["describe", str(tmp_path / "dist")]) == 1
    assert "distributed (torch_dist) checkpoint" in capsys.readouterr().err


# ---- with megatron-core ----------------------------------------------------------------------
def _have_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


needs_mcore = pytest.mark.skipif(
    not _have_megatron_core(),
    reason="megatron-core is not installed: pip install --no-deps megatron-core==0.16.1 (the "
           "'megatron' extra of setup.py)")
SEQ, BATCH, HIDDEN, HEADS, LAYERS = 16, 2, 32, 4, 4
ARCHS = {  # TINY's shape; Megatron-core's TransformerConfig / GPTModel settings per family
    "llama": {"flags": LLAMA, "untied": True, "rope": True, "ffn": 64},
    "gpt2": {"flags": "", "untied": False, "rope": False, "ffn": 4 * HIDDEN},
}


def _tokens():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1).contiguous()


def _mcore_args(arch: str, tp: int, pp: int, padded: int, iteration: int, consumed: int):
    """The ``args`` of a Megatron-LM run of this model (what megazero reads)."""
    a = ARCHS[arch]
    llama = arch == "llama"
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=a["ffn"],
        num_attention_heads=HEADS, group_query_attention=llama, num_query_groups=2 if llama
        else HEADS, kv_channels=HIDDEN // HEADS, max_position_embeddings=SEQ, seq_length=SEQ,
        position_embedding_type="rope" if a["rope"] else "learned_absolute",
        normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=1e-5, swiglu=llama,
        openai_gelu=not llama, untie_embeddings_and_output_weights=a["untied"],
        add_bias_linear=not llama, padded_vocab_size=padded,
        make_vocab_size_divisible_by=MEGATRON_DIVISIBLE_BY, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, consumed_train_samples=consumed,
        iteration=iteration, params_dtype=torch.float32, use_distributed_optimizer=False,
        exit_signal=signal.SIGTERM, ckpt_format="torch",
        model_type=_enum("megatron.core.enums", "ModelType", "encoder_or_decoder"))


def _mcore_model(arch: str, tp: int, pp: int):
    """Megatron-core's GPTModel stage of this rank (local spec, CPU shims, seeded)."""
    import warnings

    import torch.nn.functional as F
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.bench_megatron import _cpu_model_parallel_manual_seed, _megatron_cpu_shims

    warnings.filterwarnings("ignore", module=r"megatron\.")
    _megatron_cpu_shims()
    # the last stage's copy of a tied embedding is moved to CUDA before its all-reduce
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    mps.destroy_model_parallel()
    mps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp)
    _cpu_model_parallel_manual_seed(1234, mps.get_tensor_model_parallel_rank())
    a, llama = ARCHS[arch], arch == "llama"
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=2 if llama else None, ffn_hidden_size=a["ffn"],
        gated_linear_unit=llama,
        activation_func=F.silu if llama else (lambda x: F.gelu(x, approximate="tanh")),
        normalization="RMSNorm" if llama else "LayerNorm", layernorm_epsilon=1e-5,
        add_bias_linear=not llama, init_method_std=0.02, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, use_cpu_initialization=True)
    padded = -(-VOCAB // (MEGATRON_DIVISIBLE_BY * tp)) * MEGATRON_DIVISIBLE_BY * tp
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=padded, max_sequence_length=SEQ,
                     pre_process=mps.is_pipeline_first_stage(),
                     post_process=mps.is_pipeline_last_stage(), parallel_output=True,
                     share_embeddings_and_output_weights=not a["untied"],
                     position_embedding_type="rope" if a["rope"] else "learned_absolute")
    return model, padded


def _mcore_logits(model, tp: int, pp: int):
    """Full logits ``[b, s, VOCAB]`` on every rank: the stages run one after the other
    (activations sent forward), the last stage's vocab-parallel logits gathered over tp."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    tokens, pos = _tokens()
    with torch.no_grad():
        if pp > 1 and not mps.is_pipeline_first_stage():
            h = torch.empty(SEQ, BATCH, HIDDEN)
            dist.recv(h, src=dist.get_rank() - tp)
            model.set_input_tensor(h)
        out = model(tokens, pos, None)
        if pp > 1 and not mps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=dist.get_rank() + tp)
            out = None
    if out is not None:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=mps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)[..., :VOCAB]
    holder = [out]
    dist.broadcast_object_list(holder, src=dist.get_world_size() - 1)
    return holder[0]


def _mcore_save(model, root, arch, tp, pp, padded, iteration, consumed, extra=None):
    """Megatron-LM's files of this rank's stage (and the tracker, once all are written)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    t, p = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
    folder = root / f"iter_{iteration:07d}" / (
        f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"args": _mcore_args(arch, tp, pp, padded, iteration, consumed),
                "checkpoint_version": 3.0, "iteration": iteration,
                "model": model.state_dict_for_save_checkpoint(), **(extra or {}),
                "rng_state": [{"random_rng_state": random.getstate(),
                               "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state()}]},
               folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def _mcore_train(model, steps: int):
    """``steps`` AdamW steps (lr 1e-3, weight decay 0.1 by Megatron's param groups: none on
    biases and 1-D tensors) on random batches; the optimizer's state dict (torch format, as
    Megatron's FP32Optimizer saves it) and this rank's states by parameter name."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    groups = _get_param_groups([model], OptimizerConfig(lr=1e-3, weight_decay=0.1), None)
    opt = torch.optim.AdamW([{**g, "weight_decay": 0.1 * g["wd_mult"]} for g in groups],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
        opt.zero_grad()
        model(t[:, :-1], pos, None, labels=t[:, 1:]).mean().backward()
        opt.step()
    states = {n: {"main": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()
                                                  if k != "step"}}
              for n, p in model.named_parameters()}
    return opt.state_dict(), states


MCORE_CASES = [("llama", 2, 1), ("llama", 1, 2), ("gpt2", 1, 2), ("gpt2", 2, 1)]
SCHEDULE = {"max_lr": 1e-3, "lr_warmup_steps": 0, "num_steps": 24, "lr_decay_style": "constant",
            "lr_decay_steps": 56, "min_lr": 0.0, "start_wd": 0.1, "end_wd": 0.1,
            "wd_incr_style": "constant", "wd_incr_steps": 56}


def _mcore_session(root, exports):
    """On 2 ranks: each case of MCORE_CASES built, its logits taken and saved as Megatron-LM
    would; the Llama model at tp2 trained 3 steps and saved with its optimizer; each export
    (arch, tp, pp, folder) loaded into a GPTModel (strict) and its logits taken."""
    out = {}
    for arch, tp, pp in MCORE_CASES:
        model, padded = _mcore_model(arch, tp, pp)
        out[arch, tp, pp] = _mcore_logits(model, tp, pp)
        _mcore_save(model, root / f"{arch}-tp{tp}-pp{pp}", arch, tp, pp, padded, 5, 40)
    model, padded = _mcore_model("llama", 2, 1)
    opt_state, states = _mcore_train(model, 3)
    _mcore_save(model, root / "trained", "llama", 2, 1, padded, 3, 24,
                {"optimizer": opt_state, "opt_param_scheduler": SCHEDULE})
    out["trained"] = states
    for arch, tp, pp, folder in exports:
        model, _ = _mcore_model(arch, tp, pp)
        from megatron.core import parallel_state as mps

        t, p = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
        cell = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
        files = sorted((root / folder).glob(f"iter_*/{cell}/model_optim_rng.pt"))
        state = torch.load(files[0], map_location="cpu")  # as Megatron-LM loads it
        model.load_state_dict(state["model"], strict=True)
        out["export", arch] = _mcore_logits(model, tp, pp)
    return out


def _megazero_logits(root, argv):
    """megazero's full logits ``[b, s, VOCAB]`` of checkpoint ``root`` (megazero's or
    Megatron's) at the layout of ``argv``."""
    import torch.distributed as dist

    from megazero.arguments import parse_args
    from megazero.checkpoint import load_checkpoint
    from megazero.distributed.parallel_state import ParallelState
    from megazero.model import build_gpt_model_chunks

    config = parse_args((argv + f" --load {root} --no-load-rng").split(),
                        world_size=dist.get_world_size())
    ps = ParallelState.build(config.parallel.tensor_model_parallel_size)
    (model,) = build_gpt_model_chunks(config.model, ps, device=ps.device)
    load_checkpoint(str(root), model_chunks=[model], optimizer=None, lr_scheduler=None,
                    config=config, ps=ps)
    model.eval()
    tokens, pos = _tokens()
    with torch.no_grad():
        logits = model(tokens, pos)  # [b, s, Vp/tp]
    parts = [torch.empty_like(logits) for _ in range(ps.tp_size)]
    dist.all_gather(parts, logits, group=ps.tp_group)
    return torch.cat(parts, dim=-1)[..., :VOCAB]


@pytest.fixture(scope="module")
def mcore(llama, gpt2, tmp_path_factory):
    """Megatron-core's side, one 2-rank session; exports of the megazero runs first."""
    from tests.dist_helper import run_distributed

    root = tmp_path_factory.mktemp("mcore")
    pad = ["--make-vocab-size-divisible-by", str(MEGATRON_DIVISIBLE_BY)]
    assert tool(["to-megatron", str(llama[0] / "mz"), str(root / "export-llama"),
                 "--tp", "2", *pad]) == 0
    assert tool(["to-megatron", str(gpt2[0] / "mz"), str(root / "export-gpt2"),
                 "--pp", "2", *pad]) == 0
    exports = [("llama", 2, 1, "export-llama"), ("gpt2", 1, 2, "export-gpt2")]
    return root, run_distributed(_mcore_session, 2, root, exports, fresh=True,
                                 timeout=600)[0]


def _same_logits(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@needs_mcore
@pytest.mark.parametrize("arch,tp,pp,layout,world", [
    ("llama", 2, 1, "", 1),
    ("llama", 1, 2, " --tensor-model-parallel-size 2", 2),
    ("gpt2", 1, 2, " --tensor-model-parallel-size 2", 2),
    ("gpt2", 2, 1, "", 1),
])
def test_megatron_core_checkpoint_gives_its_logits(mcore, arch, tp, pp, layout, world):
    from tests.dist_helper import run_distributed

    root, out = mcore
    folder = root / f"{arch}-tp{tp}-pp{pp}"
    reader = MegatronReader(str(folder), vocab_size=VOCAB)
    assert reader.description == f"Megatron-LM checkpoint (version 3.0, tp {tp}, pp {pp}, " \
                                 "mcore names)"
    logits = run_distributed(_megazero_logits, world, folder,
                             TINY + ARCHS[arch]["flags"] + layout)[0]
    _same_logits(logits, out[arch, tp, pp], f"Megatron-core {arch} tp{tp} pp{pp} -> megazero"
                                            f"{layout or ' tp1'}")


@needs_mcore
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_to_megatron_loads_into_megatron_core(mcore, llama, gpt2, arch):
    from tests.dist_helper import run_distributed

    _, out = mcore
    src = (llama if arch == "llama" else gpt2)[0] / "mz"
    logits = run_distributed(_megazero_logits, 1, src, TINY + ARCHS[arch]["flags"])[0]
    _same_logits(out["export", arch], logits, f"megazero {arch} -> to-megatron -> GPTModel")


def _interleaved(pieces):
    """Megatron's per-rank fc1 [gate_r; up_r] -> megazero's [ffn, (gate, up)] (by hand)."""
    rows = []
    for piece in pieces:
        gate, up = piece.chunk(2)
        rows += [torch.stack([gate[i], up[i]]) for i in range(gate.shape[0])]
    return torch.cat(rows)


@needs_mcore
def test_megatron_core_training_state_continues_in_megazero(mcore):
    """Megatron-core's model after 3 AdamW steps at tp2, with its optimizer state: megazero
    reads the same fp32 values and moments, and continues 4 iterations alike at tp1 and at
    pp2 + ZeRO-1; without the optimizer state it continues differently."""
    root, out = mcore
    folder = root / "trained"
    reader = MegatronReader(str(folder), vocab_size=VOCAB)
    assert reader.optimizer_meta()["step"] == 3
    files = [torch.load(folder / "iter_0000003" / f"mp_rank_{t:02d}" / "model_optim_rng.pt",
                        weights_only=False) for t in range(2)]  # made by this test
    states = out["trained"]  # rank 0's, by Megatron's parameter name
    params = [n for n in files[0]["model"] if not n.endswith("_extra_state")]
    # Megatron-core 0.16's param groups: the decayed (2-D) weights first, in model order
    order = [n for n in params if files[0]["model"][n].dim() > 1]
    order += [n for n in params if n not in order]
    ids = [i for g in files[0]["optimizer"]["param_groups"] for i in g["params"]]
    for mcore_suffix, _, ours, dim in LAYER:
        key = f"decoder.layers.1.{mcore_suffix}.weight"
        saved = files[0]["optimizer"]["state"][ids[order.index(key)]]
        assert torch.equal(saved["exp_avg"], states[key]["exp_avg"])  # the right index
        for kind in ("exp_avg", "exp_avg_sq", "main"):
            pieces = [f["model"][key] if kind == "main" else
                      f["optimizer"]["state"][ids[order.index(key)]][kind] for f in files]
            want = pieces[0] if dim is None else _interleaved(pieces) if "fc1" in ours \
                else torch.cat(pieces, dim=dim)
            got = reader.full_tensor(f"layers.1.{ours}.weight", kind)
            assert torch.equal(got, want), (ours, kind)
    argv = TINY + LLAMA + f" --train-iters 7 --load {folder}"
    a = run_training(argv, 1)
    b = run_training(argv + " --pipeline-model-parallel-size 2 --zero-stage 1", 2)
    assert_same_run(a, b, what="Megatron-core's trained checkpoint at tp1 vs pp2", kv_groups=2)
    assert all(np.isfinite(a[0])) and len(a[0]) == 4
    fresh, *_ = run_training(argv + " --no-load-optim", 1)
    assert fresh[0] == pytest.approx(a[0][0], rel=1e-5) and fresh[1:] != a[0][1:]
