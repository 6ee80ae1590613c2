"""Every key the ds_config schema accepts changes a setting, or states megazero's fixed
behaviour and refuses the other values; every refused key is refused by name.

The walk goes over ``deepspeed_schema``'s tables leaf by leaf (the optimizer's and scheduler's
params per type). A key has an effect when two of its valid values, or a value and its
absence, translate into different settings (batch sizes, config fields, the scheduler; a
scheduler's params by the learning rates the schedule gives). A key accepted with one value
only (``_choice(True)``) must leave the settings as its absence does, and every other value
must fail naming the key.
"""

from __future__ import annotations

import json

import pytest

from megazero.config import deepspeed_schema as S
from megazero.config.deepspeed import parse_ds_config
from megazero.optim.ds_schedulers import DeepSpeedScheduler

BATCH = {"train_batch_size": 8}
# section prefix -> the config a key of that section is set in (the longest prefix wins)
BASES = {
    "": BATCH,
    "fp16.": {**BATCH, "fp16": {"enabled": True}},
    "zero_optimization.": {**BATCH, "zero_optimization": {"stage": 3}},
    "zero_optimization.offload_optimizer.": {**BATCH, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
    "zero_optimization.offload_param.": {**BATCH, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
    "tensorboard.": {**BATCH, "tensorboard": {"enabled": True}},
    "wandb.": {**BATCH, "wandb": {"enabled": True}},
}


def _leaves(schema: dict, prefix: str = ""):
    for key, spec in schema.items():
        if isinstance(spec, dict):
            yield from _leaves(spec, prefix + key + ".")
        elif spec != S._DICT:  # optimizer.params / scheduler.params: walked by type below
            yield prefix + key, spec, None


def all_leaves():
    yield from _leaves(S.SCHEMA)
    for section, tables in (("optimizer", S.OPTIMIZER_PARAMS),
                            ("scheduler", S.SCHEDULER_PARAMS)):
        for kind, table in tables.items():
            for path, spec, _ in _leaves(table, f"{section}.params."):
                yield path, spec, kind


def _candidates(spec) -> list:
    if spec == S._BOOL:
        return [True, False]
    if spec == S._STR:
        return ["/y", "z"]
    if spec == "betas":
        return [[0.8, 0.9], [0.5, 0.99]]
    if spec[0] == "int":
        return [spec[1], spec[1] + 1, 8192, 12288, 10**6]
    if spec[0] == "float":
        return [0.5, 2.0, 1e-3]
    return list(spec[1])  # choice


def _base(path: str, kind: str | None) -> dict:
    if path.startswith("optimizer.params."):
        return {**BATCH, "optimizer": {"type": kind, "params": {}}}
    if path.startswith("scheduler.params."):
        required = {k: 100 for k in S.REQUIRED.get(kind, ())}
        return {**BATCH, "scheduler": {"type": kind, "params": required}}
    prefix = max((p for p in BASES if path.startswith(p)), key=len)
    return BASES[prefix]


def _set(cfg: dict, path: str, value) -> dict:
    cfg = json.loads(json.dumps(cfg))
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        if value is _ABSENT and p not in node:
            return cfg
        node = node.setdefault(p, {})
    if value is _ABSENT:
        node.pop(last, None)
    else:
        node[last] = value
    return cfg


_ABSENT = object()


def _outcome(cfg: dict):
    """What the config sets, or None when it is refused."""
    try:
        s = parse_ds_config(cfg, world_size=1)
    except S.DeepSpeedConfigError:
        return None
    sched = None
    if s.scheduler is not None:
        kind, params = s.scheduler
        sched = tuple(DeepSpeedScheduler(kind, params, base_lr=1e-3).get_lr(i)
                      for i in (0, 1, 2, 4, 51, 100, 151, 1100, 3000, 9000, 20000))
    return (s.micro_batch, s.accumulation, s.train_batch,
            json.dumps(s.fields, sort_keys=True, default=str), sched)


LEAVES = list(all_leaves())
IDS = [f"{path}[{kind}]" if kind else path for path, _, kind in LEAVES]


@pytest.mark.parametrize("path,spec,kind", LEAVES, ids=IDS)
def test_every_accepted_key_changes_a_setting_or_states_fixed_behaviour(path, spec, kind):
    base = _base(path, kind)
    absent = _outcome(_set(base, path, _ABSENT))
    valid = {}
    for value in _candidates(spec):
        out = _outcome(_set(base, path, value))
        if out is not None:
            valid[json.dumps(value)] = out
    assert valid, f"{path}: no candidate value is accepted"
    outcomes = set(valid.values()) | ({absent} if absent is not None else set())
    if spec[0] == "choice" and len(spec[1]) == 1:  # megazero's fixed behaviour
        assert outcomes == {absent}, f"{path}: its one accepted value changed a setting"
        other = {True: False, False: True}.get(spec[1][0], "other")
        if isinstance(spec[1][0], float):
            other = spec[1][0] * 2
        with pytest.raises(S.DeepSpeedConfigError, match=path.split(".")[-1]):
            parse_ds_config(_set(base, path, other), world_size=1)
    else:
        assert len(outcomes) >= 2, f"{path} is accepted and changes nothing"


@pytest.mark.parametrize("key", sorted(S.REFUSED))
def test_every_refused_key_is_refused_by_name(key):
    path, _, value = key.partition("=")
    section = path.split(".")[0]
    if section in ("optimizer", "scheduler") and path.count(".") == 1:  # a type
        cfg = {**BATCH, section: {"type": json.loads(json.dumps(value))}}
    else:
        if value:
            value = {"False": False, "True": True}.get(value, value)
        else:
            value = {} if path.split(".")[-1] in ("amp", "flops_profiler", "compile",
                                                     "pipeline") else 1
        cfg = _set(_base(path, "Adam"), path, value)
        if path.startswith("optimizer.params."):
            cfg["optimizer"]["type"] = "OneBitAdam"
    with pytest.raises(S.DeepSpeedConfigError, match="does not support") as exc:
        parse_ds_config(cfg, world_size=1)
    assert path in str(exc.value) and S.REFUSED[key] in str(exc.value)


def test_refusals_are_named_together():
    cfg = _set(_set(BATCH, "aio.queue_depth", 8), "amp", {"enabled": True})
    with pytest.raises(S.DeepSpeedConfigError) as exc:
        parse_ds_config(cfg, world_size=1)
    assert "aio.queue_depth" in str(exc.value) and "amp" in str(exc.value)


def test_the_block_size_alignment_is_the_io_engines():
    from megazero.config.optimizer import IO_ALIGN
    from megazero.ops.aio import ALIGN

    assert IO_ALIGN == ALIGN


def _cli(tmp_path, zero: dict):
    from megazero.arguments import parse_args

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 1, "zero_optimization": zero}))
    return parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--seq-length", "16", "--mock-data", "--vocab-size", "96",
                       "--train-iters", "2", "--deepspeed", "--deepspeed_config", str(path)],
                      world_size=1)


@pytest.mark.parametrize("key,inside,outside", [
    ("reduce_bucket_size", 2, 3), ("allgather_bucket_size", 1, 3),
    ("stage3_max_live_parameters", 3, 2), ("stage3_prefetch_bucket_size", 3, 1),
    ("stage3_param_persistence_threshold", 3, 2)])
def test_a_key_outside_its_zero_stage_is_refused_by_name(tmp_path, capsys, key, inside,
                                                         outside):
    """A ZeRO key that does nothing at the stage the config ends at is refused naming the key
    (as its flag is), and taken at the stage where it acts (``deepspeed.MODE_KEYS``)."""
    assert _cli(tmp_path, {"stage": inside, key: 1000}).optimizer.zero_stage == inside
    with pytest.raises(SystemExit):
        _cli(tmp_path, {"stage": outside, key: 1000})
    err = capsys.readouterr().err
    assert key in err and ("do nothing in this configuration" in err or "needs" in err), err


@pytest.mark.parametrize("zero", [{"stage": 2, "sub_group_size": 1000},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                     "buffer_count": 4}}])
def test_nvme_keys_without_nvme_are_refused(tmp_path, capsys, zero):
    with pytest.raises(SystemExit):
        _cli(tmp_path, zero)
    assert "nvme" in capsys.readouterr().err


def test_the_engine_refuses_them_too():
    """``megazero.initialize`` (DeepSpeed's entry point) refuses the same keys by name."""
    import torch.nn as nn

    import megazero

    with pytest.raises(S.DeepSpeedConfigError, match="reduce_bucket_size"):
        megazero.initialize(model=nn.Linear(2, 2), config={
            "train_batch_size": 1, "zero_optimization": {"stage": 3,
                                                         "reduce_bucket_size": 1000}})
