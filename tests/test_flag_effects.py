"""Every flag of pretrain_gpt2.py's parser (``megazero.arguments.build_parser``) changes the
config, or is refused by name where it would do nothing; none is parsed and ignored (issue
28). ``FLAGS`` (``tests/flag_table.py``) classifies each parser action; a flag added
without an entry fails here.

* ``Sets(path, args)``: ``BASE + mode`` with ``with_ flag args`` sets config field ``path``
  (section.field) to ``want`` (by default ``args`` read as a Python literal), and without
  them leaves it otherwise. Each of the flag's spellings is tried.
* ``Same(why)``: the flag states what megazero does anyway (Megatron's compatibility flags
  in ``ALWAYS_SO``, a flag restating its default whose ``opposite`` changes the field): the
  config is the one without it. ``Restricted(ok, refused)``: the same for the one value
  megazero has Megatron's meaning for; another value is refused.
* ``refused`` (any kind): given after ``BASE + outside`` for each ``outside``, parsing exits
  2 naming the flag (one of its spellings) and not as an unknown argument; a valued flag is
  refused at its default value too (given is given). ``Refused`` flags always are.
* ``EntryPoint(test)``: acts outside the config (help, the dry run); ``test`` runs it.

Every flag of the config's mode tables (``megazero.config.MODES``, ``Needs``) must have an
``outside`` here, and those checked by value are refused by the dataclasses too.
"""

from __future__ import annotations

import ast
import json
import os
import shlex

import pytest

from megazero.arguments import build_parser, parse_args
from megazero.config import MODES, ConfigError, MegazeroConfig
from tests.flag_table import (
    BASE,
    FLAGS,
    SPM,
    UNSET,
    EntryPoint,
    Refused,
    Restricted,
    Same,
    Sets,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}))
    return str(path)


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _actions():
    return build_parser()._actions


def _entry(action):
    return FLAGS.get(action.option_strings[0])


def _parse(flags: str, ds: str = ""):
    return parse_args(shlex.split(BASE + " " + flags.format(ds=ds)), world_size=None)


def _at(config, path):
    section, name = path.split(".")
    return getattr(getattr(config, section), name)


def _refused(flags: str, spellings, capsys, ds: str = "") -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(flags, ds)
    assert exc.value.code == 2, flags
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err, err
    assert any(s in err.split(": error: ", 1)[1] for s in spellings), (flags, err)
    return err


def test_every_flag_is_classified():
    """A flag added to the parser without an entry here fails: say what it does."""
    missing = [a.option_strings for a in _actions() if _entry(a) is None]
    assert not missing, f"flags without an entry in FLAGS: {missing}"
    known = {o for a in _actions() for o in a.option_strings}
    assert not set(FLAGS) - known, f"entries for flags the parser lacks: {set(FLAGS) - known}"


IDS = [a.option_strings[0] for a in build_parser()._actions]


@pytest.mark.parametrize("option", IDS)
def test_flag_changes_the_config_or_states_what_megazero_does(option, ds, capsys):
    action = next(a for a in _actions() if a.option_strings[0] == option)
    entry = FLAGS[option]
    for spelling in action.option_strings:
        if isinstance(entry, Sets):
            without = _parse(entry.mode, ds)
            given = _parse(f"{entry.mode} {entry.with_} {spelling} {entry.args}", ds)
            want = entry.want
            if want is UNSET:
                try:
                    want = ast.literal_eval(entry.args)
                except (ValueError, SyntaxError):
                    want = entry.args
            assert _at(given, entry.path) == want, (spelling, _at(given, entry.path))
            assert _at(without, entry.path) != want, spelling
        elif isinstance(entry, Same):
            assert entry.why
            without = _parse(entry.mode, ds)
            assert _parse(f"{entry.mode} {spelling} {entry.args}", ds).to_dict() \
                == without.to_dict(), spelling
            if entry.opposite:
                flipped = _parse(f"{entry.mode} {entry.opposite}", ds)
                assert _at(flipped, entry.path) != _at(without, entry.path)
        elif isinstance(entry, Restricted):
            assert _parse(f"{spelling} {entry.ok}").to_dict() == _parse("").to_dict()
            err = _refused(f"{spelling} {entry.refused}", [spelling], capsys)
            assert any(w in err for w in ("use ", "drop ", "only ", "megazero")), err
        elif isinstance(entry, Refused):
            err = _refused(f"{spelling} {entry.args}", [spelling], capsys)
            assert any(w in err for w in ("use ", "drop ")), err
        else:
            assert isinstance(entry, EntryPoint)
            path, _, name = entry.test.partition("::")
            assert f"def {name}(" in open(os.path.join(ROOT, path)).read(), entry.test


@pytest.mark.parametrize("option", [o for o in IDS if getattr(FLAGS.get(o), "outside", ())])
def test_flag_outside_its_mode_is_refused_by_name(option, ds, capsys):
    """Given where it would do nothing, the flag is refused naming it; a valued flag given
    at its default value too."""
    action = next(a for a in _actions() if a.option_strings[0] == option)
    entry = FLAGS[option]
    args = entry.ok if isinstance(entry, Restricted) else entry.args
    default = action.default
    defaults = [] if action.nargs == 0 or default in (None, []) else \
        [" ".join(map(str, default)) if isinstance(default, list) else str(default)]
    for outside in entry.outside:
        for spelling in action.option_strings:
            for value in [args, *defaults]:
                _refused(f"{outside} {spelling} {value}", action.option_strings, capsys, ds)


def test_every_mode_table_flag_has_a_refusal_here():
    """The config's ``Needs`` tables and FLAGS agree: each flag there is refused here
    outside its mode."""
    for table in MODES.values():
        for needs in table:
            for flag in needs.flags:
                action = build_parser()._option_string_actions[flag]
                entry = FLAGS[action.option_strings[0]]
                assert entry.outside, flag


def test_values_outside_the_mode_are_refused_by_the_dataclasses_too(ds):
    """A ``by_value`` entry refuses its field set away from the default outside the mode
    when the config is built without a command line (API, ds_config, saved args)."""
    checked = 0
    for name, table in MODES.items():
        for needs in (n for n in table if n.by_value):
            entry = FLAGS[build_parser()._option_string_actions[needs.flags[0]]
                          .option_strings[0]]
            value = _at(_parse(f"{entry.mode} {entry.with_} {needs.flags[0]} {entry.args}",
                               ds), f"{name}.{needs.field}")
            for outside in entry.outside:
                d = _parse(outside, ds).to_dict()
                d[name][needs.field] = value
                with pytest.raises(ConfigError, match=needs.flags[0]):
                    MegazeroConfig.from_dict(d)
                checked += 1
    assert checked >= 5


def test_virtual_stages_at_one_pipeline_stage_are_refused(capsys):
    """One virtual stage per stage at pp 1 (--num-layers-per-virtual-pipeline-stage equal to
    --num-layers) interleaves nothing: refused, not dropped."""
    _refused("--num-layers-per-virtual-pipeline-stage 4", ["--num-layers-per-virtual"], capsys)


def test_dry_run_flags_go_together(capsys):
    _refused("--dry-run-world-size 2", ["--dry-run-rank"], capsys)
    _refused("--dry-run-rank 0 --dry-run-world-size 2 --world-size 4", ["--world-size"], capsys)
    config = _parse("--dry-run-rank 1 --dry-run-world-size 2 --dry-run-iters 2")
    assert config.parallel.world_size == 2
    # a dry run plays the job on synthetic tokens of --vocab-size (megazero.dryrun)
    config = _parse(f"{SPM} --vocab-size 500 --dry-run-rank 0 --dry-run-world-size 1")
    assert config.data.vocab_size == 500


def test_help_exits_0_with_every_group(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for group in ("model:", "parallelism:", "ZeRO:", "dry run:", "checkpointing:"):
        assert group in out
