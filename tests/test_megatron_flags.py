"""Every flag of Megatron-LM's GPT/Llama example scripts (tests/megatron_flags.txt) either has
Megatron's meaning in megazero (it parses and sets the config field named) or is refused with
a message naming the flag and an alternative; none is parsed and ignored."""

import ast
import os
import shlex

import pytest

from megazero.arguments import build_parser, parse_args

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4")
DATA = "--mock-data --vocab-size 96"
LIST = os.path.join(os.path.dirname(__file__), "megatron_flags.txt")


def _entries():
    out = []
    with open(LIST) as f:
        for line in f:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = [p.strip() for p in line.split("|")]
            flags, status = parts[0], parts[1]
            check = parts[2] if len(parts) > 2 else "-"
            out.append((flags, status, check))
    return out


ENTRIES = _entries()


def _argv(flags):
    """BASE, the mock data (unless the entry sets data flags itself), and the entry."""
    own_data = any(f in flags for f in ("--tokenizer-type", "--vocab-size", "--mock-data"))
    base = BASE.replace("--train-iters 4", "") if "--train-samples" in flags else BASE
    return shlex.split(base) + ([] if own_data else shlex.split(DATA)) + shlex.split(flags)


def test_the_list_covers_megatron_scripts():
    assert len(ENTRIES) >= 120
    assert {s for _, s, _ in ENTRIES} == {"same", "refused"}


@pytest.mark.parametrize("flags,check", [(f, c) for f, s, c in ENTRIES if s == "same"])
def test_same_meaning(flags, check):
    config = parse_args(_argv(flags), world_size=1)
    if check == "-":
        return
    path, _, value = check.partition("=")
    section, field = path.split(".")
    got = getattr(getattr(config, section), field)
    try:
        want = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        want = value
    assert got == want, f"{flags}: {path} is {got!r}, expected {want!r}"


@pytest.mark.parametrize("flags", [f for f, s, _ in ENTRIES if s == "refused"])
def test_refused_with_an_alternative(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(_argv(flags), world_size=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    flag = shlex.split(flags)[0].split("=")[0]
    assert flag in err, err
    assert "unrecognized arguments" not in err, err  # refused by name, not unknown
    assert any(w in err for w in ("use ", "drop ", "only ")), err  # an alternative


def test_no_flag_is_parsed_and_ignored():
    """Every parser destination is a config field, a dry-run option, or a compatibility flag
    that apply_compat reads (so nothing is silently dropped)."""
    import dataclasses

    from megazero import arguments_compat
    from megazero.config import (
        DataConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        TrainConfig,
    )

    fields = {f.name for cls in (ModelConfig, ParallelConfig, OptimizerConfig, DataConfig,
                                 TrainConfig) for f in dataclasses.fields(cls)}
    package = os.path.dirname(arguments_compat.__file__)
    source = "".join(open(os.path.join(package, name)).read() for name in os.listdir(package)
                     if name.startswith("arguments") and name.endswith(".py"))
    for action in build_parser()._actions:
        dest = action.dest
        if dest == "help" or dest in fields or dest.startswith("dry_run_"):
            continue
        if dest in ("num_layers_per_virtual_pipeline_stage", "world_size"):
            continue  # turned into ParallelConfig fields by namespace_to_config
        if dest.startswith("compat_"):
            continue  # refused or restricted: refusals() reads every one
        if any(o in arguments_compat.ALWAYS_SO for o in action.option_strings):
            continue  # megazero always does what the flag asks
        assert f"ns.{dest}" in source, f"flag {action.option_strings} is parsed but not read"


def test_recompute_flags_mean_what_their_frameworks_mean(capsys):
    """Megatron-LM's --recompute-activations is the selective recompute; Megatron-DeepSpeed's
    (and Megatron v2's) --checkpoint-activations recomputes whole layers."""
    selective = parse_args(_argv("--recompute-activations"), world_size=1).model
    assert selective.recompute_granularity == "selective"
    assert not selective.recompute_activations
    full = parse_args(_argv("--checkpoint-activations"), world_size=1).model
    assert full.recompute_granularity == "full" and full.recompute_activations
    for other in ("--recompute-granularity full", "--checkpoint-activations"):
        with pytest.raises(SystemExit):
            parse_args(_argv(f"--recompute-activations {other}"), world_size=1)
        assert ("--recompute-activations is Megatron-LM's selective recompute: it contradicts "
                f"{other}") in capsys.readouterr().err
