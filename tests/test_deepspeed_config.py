"""DeepSpeed's ds_config.json through both entry points: strict checking (every invalid config
of a table of cases fails naming its key), DeepSpeed's batch arithmetic, its three warmup
schedules, the engine built DeepSpeed's way (the 4-tuple) against the engine built directly,
and pretrain_gpt2.py --deepspeed --deepspeed_config against the same run by flags."""

import json
import math

import pytest
import torch

from megazero.config.deepspeed import DeepSpeedConfigError, parse_ds_config
from megazero.optim.ds_schedulers import DeepSpeedScheduler
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, assert_same_run, run_training

# the ZeRO tutorial's config (stage 2, overlapped reduction, 5e8 buckets)
ZERO2 = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
         "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 1,
         "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                      "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 3,
                                                      "warmup_type": "linear"}},
         "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                               "reduce_bucket_size": 500_000_000,
                               "allgather_bucket_size": 500_000_000,
                               "allgather_partitions": True, "reduce_scatter": True}}
# the ZeRO-Offload tutorial's
OFFLOAD = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                   "pin_memory": True}}}
# ZeRO-3
ZERO3 = {"train_batch_size": 4, "bf16": {"enabled": False},
         "optimizer": {"type": "Adam", "params": {"lr": 5e-4}},
         "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                                                            "warmup_num_steps": 10}},
         "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                               "stage3_param_persistence_threshold": 100,
                               "offload_param": {"device": "none"}}}
# the 1-bit Adam tutorial's
ONEBIT = {"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {
    "lr": 1e-4, "freeze_step": 100, "cuda_aware": False, "comm_backend_name": "gloo"}}}
# the 0/1 Adam tutorial's
ZEROONE = {"train_batch_size": 8, "optimizer": {"type": "ZeroOneAdam", "params": {
    "lr": 1e-4, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000,
    "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16,
    "cuda_aware": False, "comm_backend_name": "gloo"}}}
# the ZeRO-Infinity tutorial's as it is published (NVME: a directory of the test's): megazero
# refuses its swapper and libaio tuning keys, all named in one error
INFINITY_PUBLISHED = {
    "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 5e-4}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "NVME",
                                          "pin_memory": True, "buffer_count": 4,
                                          "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
            "single_submit": False, "overlap_events": True}}
INFINITY_REFUSED = ("zero_optimization.offload_optimizer.fast_init",
                    "zero_optimization.offload_param.buffer_count",
                    "zero_optimization.offload_param.buffer_size",
                    "zero_optimization.offload_param.max_in_cpu", "aio.queue_depth",
                    "aio.single_submit", "aio.overlap_events")
INFINITY = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 5e-4}},
            "zero_optimization": {
                "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "NVME",
                                                  "pin_memory": True, "buffer_count": 4},
                "offload_param": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True}},
            "aio": {"block_size": 1048576, "thread_count": 1}}
# 1-bit LAMB's (refused: megazero has none)
ONEBITLAMB = {"train_batch_size": 8, "optimizer": {"type": "OneBitLamb", "params": {
    "lr": 1e-4, "freeze_step": 100}}}


def _with(base, path, value):
    cfg = json.loads(json.dumps(base))
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return cfg


_DELETE = object()
INVALID = [  # (config, the text the message must hold)
    (_with(ZERO2, "train_batch_sise", 8), "train_batch_sise"),
    (_with(ZERO2, "train_batch_size", 12), "train_batch_size"),
    (_with(ZERO2, "train_batch_size", "8"), "train_batch_size"),
    (_with(ZERO2, "train_micro_batch_size_per_gpu", 0), "train_micro_batch_size_per_gpu"),
    (_with(ZERO2, "gradient_clipping", -1), "gradient_clipping"),
    (_with(ZERO2, "fp16.enabled", "yes"), "fp16.enabled"),
    (_with(_with(ZERO2, "fp16.enabled", True), "bf16.enabled", True), "fp16 and bf16"),
    (_with(ZERO2, "fp16.auto_cast", True), "fp16.auto_cast"),
    (_with(ZERO2, "optimizer.type", "SGDX"), "optimizer.type"),
    (ONEBITLAMB, "optimizer.type"),
    (_with(ZERO2, "optimizer.params.betas", [0.9]), "optimizer.params.betas"),
    (_with(ZERO2, "optimizer.params.lr", float("nan")), "optimizer.params.lr"),
    (_with(ZERO2, "optimizer.params.amsgrad", True), "optimizer.params.amsgrad"),
    (_with(ZERO2, "optimizer.params.momentum", 0.9), "optimizer.params.momentum"),
    (_with(ZERO2, "scheduler.type", "OneCycle"), "scheduler.type"),
    (_with(ZERO2, "scheduler.params.warmup_type", "exp"), "scheduler.params.warmup_type"),
    (_with(ZERO2, "scheduler", {"type": "WarmupDecayLR", "params": {}}),
     "scheduler.params.total_num_steps"),
    (_with(ZERO2, "zero_optimization.stage", 4), "zero_optimization.stage"),
    (_with(ZERO2, "zero_optimization.offload_optimizer", {"device": "nvme"}),
     "zero_optimization.offload_optimizer.device"),  # nvme without nvme_path
    (_with(ZERO2, "zero_optimization.offload_param", {"device": "cpu"}),
     "zero_optimization.offload_param.device"),
    (_with(ZERO2, "zero_optimization.allgather_bucket_size", 1000),
     "zero_optimization.allgather_bucket_size"),
    (_with(ZERO2, "zero_optimization.contiguous_gradients", False),
     "zero_optimization.contiguous_gradients"),
    (_with(ZERO2, "zero_optimization.stage3_max_live_parameters", 0),
     "zero_optimization.stage3_max_live_parameters"),
    (_with(ZERO2, "zero_optimization.sub_group_size", 0), "zero_optimization.sub_group_size"),
    (_with(ZERO3, "zero_optimization.offload_param", {"device": "nvme"}),
     "zero_optimization.offload_param.device"),  # nvme without nvme_path
    (_with(ZERO2, "aio", {"thread_count": 0}), "aio.thread_count"),
    (_with(ZERO2, "aio", {"block_size": 1000}), "aio.block_size"),
    (_with(ZERO2, "aio", {"block_size": 4096 * 3 + 1}), "aio.block_size"),
    (_with(INFINITY, "zero_optimization.offload_optimizer.buffer_count", 1),
     "zero_optimization.offload_optimizer.buffer_count"),
    (_with(INFINITY, "zero_optimization.offload_optimizer.pipeline_read", False),
     "zero_optimization.offload_optimizer.pipeline_read"),
    (_with(OFFLOAD, "zero_optimization.offload_optimizer.pin_memory", False),
     "zero_optimization.offload_optimizer.pin_memory"),
    (_with(ONEBIT, "optimizer.params.comm_backend_name", "mpi"),
     "optimizer.params.comm_backend_name"),
    (_with(ZERO2, "activation_checkpointing", {"contiguous_memory_optimization": True}),
     "activation_checkpointing.contiguous_memory_optimization"),
    (_with(ZERO2, "amp", {"enabled": True}), "amp"),
    (_with(ZERO2, "communication_data_type", "fp16"), "communication_data_type"),
    (_with(ZERO2, "flops_profiler", {"enabled": True}), "flops_profiler"),
    (_with(ZERO2, "wandb", {"enabled": True, "team": "x"}), "wandb.team"),
    ({"gradient_accumulation_steps": 2}, "train_batch_size"),
]


@pytest.mark.parametrize("cfg,key", INVALID, ids=[k for _, k in INVALID])
def test_invalid_configs_fail_naming_the_key(cfg, key):
    with pytest.raises(DeepSpeedConfigError, match="ds_config") as exc:
        parse_ds_config(cfg, world_size=2)
    assert key in str(exc.value), str(exc.value)


def test_batch_sizes_as_deepspeed_resolves_them():
    for cfg, dp, want in [({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2,
                           (4, 2, 16)),
                          ({"train_micro_batch_size_per_gpu": 3}, 4, (3, 1, 12)),
                          ({"train_batch_size": 8}, 2, (4, 1, 8)),
                          ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, 3,
                           (2, 4, 24))]:
        s = parse_ds_config(cfg, world_size=dp)
        assert (s.micro_batch, s.accumulation, s.train_batch) == want, cfg
    s = parse_ds_config(ZERO2, world_size=4, tp=2)  # dp = 2
    assert (s.micro_batch, s.accumulation) == (2, 2)
    with pytest.raises(DeepSpeedConfigError, match="data-parallel size \\(4\\)"):
        parse_ds_config(ZERO2, world_size=4)


def test_tutorial_configs_translate():
    s = parse_ds_config(ZERO2, world_size=2)
    f = s.fields
    assert f["optimizer.zero_stage"] == 2 and f["optimizer.overlap_grad_reduce"]
    assert f["optimizer.zero_reduce_bucket_size"] == 500_000_000
    assert (f["optimizer.adam_beta1"], f["optimizer.adam_beta2"]) == (0.9, 0.95)
    assert f["optimizer.adam_w_mode"] and f["optimizer.clip_grad"] == 1.0
    assert s.scheduler[0] == "WarmupLR"
    assert parse_ds_config(OFFLOAD, world_size=2).fields["optimizer.cpu_offload"]
    z3 = parse_ds_config(ZERO3, world_size=2).fields
    assert z3["optimizer.zero_stage"] == 3 and z3["optimizer.zero_prefetch"]
    assert z3["optimizer.zero_param_persistence_threshold"] == 100
    onebit = parse_ds_config(ONEBIT, world_size=2).fields
    assert onebit["optimizer.optimizer"] == "onebitadam" and onebit["optimizer.freeze_step"] == 100
    nvme = parse_ds_config(_with(ZERO2, "zero_optimization.offload_optimizer",
                                 {"device": "nvme", "nvme_path": "/local_nvme"}),
                           world_size=2).fields
    assert nvme["optimizer.offload_optimizer"] == "nvme"
    assert nvme["optimizer.nvme_path"] == "/local_nvme"
    # ZeRO-Infinity: states and parameters on NVMe, the I/O sized as the config says
    infinity = parse_ds_config(_with(INFINITY, "aio.thread_count", 2), world_size=2).fields
    assert infinity["optimizer.offload_param"] == "nvme"
    assert infinity["optimizer.nvme_path"] == "NVME" and infinity["optimizer.nvme_threads"] == 2
    assert infinity["optimizer.nvme_buffer_count"] == 4
    assert infinity["optimizer.nvme_block_size"] == 1 << 20
    # as DeepSpeed's tutorial publishes it: every key megazero has no counterpart of, at once
    with pytest.raises(DeepSpeedConfigError) as exc:
        parse_ds_config(INFINITY_PUBLISHED, world_size=2)
    for key in INFINITY_REFUSED:
        assert key in str(exc.value), key
    with pytest.raises(DeepSpeedConfigError, match="differs from offload_optimizer.nvme_path"):
        parse_ds_config(_with(_with(ZERO3, "zero_optimization.offload_optimizer",
                                    {"device": "nvme", "nvme_path": "/a"}),
                              "zero_optimization.offload_param",
                              {"device": "nvme", "nvme_path": "/b"}), world_size=2)
    sub = parse_ds_config(_with(ZERO2, "zero_optimization.sub_group_size", 10**9),
                          world_size=2).fields
    assert sub["optimizer.nvme_sub_group_size"] == 10**9
    zo = parse_ds_config(ZEROONE, world_size=2).fields
    assert zo["optimizer.optimizer"] == "zerooneadam" and zo["optimizer.var_freeze_step"] == 1000
    assert zo["optimizer.local_step_clipper"] == 16
    live = parse_ds_config(_with(ZERO3, "zero_optimization.stage3_max_live_parameters", 10**6),
                           world_size=2).fields
    assert live["optimizer.zero_max_live_parameters"] == 10**6


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(DeepSpeedConfigError, match="ds.json is not valid JSON"):
        parse_ds_config(str(bad), world_size=1)
    with pytest.raises(DeepSpeedConfigError, match="cannot read"):
        parse_ds_config(str(tmp_path / "missing.json"), world_size=1)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_schedules_follow_deepspeed(kind, warmup_type):
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
              "warmup_type": warmup_type, "total_num_steps": 30, "warmup_min_ratio": 0.1,
              "cos_min_ratio": 0.01}
    if kind != "WarmupCosineLR":
        params = {k: v for k, v in params.items() if "ratio" not in k}
    else:  # DeepSpeed's cosine schedule scales the optimizer's lr by ratios
        params = {k: v for k, v in params.items() if k not in ("warmup_min_lr", "warmup_max_lr")}
    if kind == "WarmupLR":
        params.pop("total_num_steps")
    ours = DeepSpeedScheduler(kind, params, base_lr=2e-3)

    def expected(i):  # DeepSpeed's formulas, at step index i (-1: before the first step)
        frac = (math.log(max(i, 0) + 1) / math.log(10) if warmup_type == "log" else i / 10)
        if kind == "WarmupCosineLR":
            if i < 0:
                return 0.0
            if i < 10:
                return 2e-3 * (0.1 + frac * 0.9)
            prog = min(1.0, (i - 10 + 1) / 20)
            return 2e-3 * max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * prog)) / 2)
        if i < 0:
            return 1e-5
        gamma = frac if i < 10 else (1.0 if kind == "WarmupLR" else max(0.0, (30 - i) / 20))
        return 1e-5 + gamma * (1e-3 - 1e-5)

    for i in range(-1, 40):
        assert ours.get_lr() == pytest.approx(expected(i), rel=1e-12, abs=1e-15), i
        ours.step(1)
    state = ours.state_dict()
    again = DeepSpeedScheduler(kind, params, base_lr=2e-3)
    again.load_state_dict(state)
    assert again.get_lr() == ours.get_lr()


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_schedules_equal_deepspeeds_own_classes(kind):
    """Against deepspeed.runtime.lr_schedules itself: DeepSpeed is not a dependency (its sdist
    builds against torch), so this skips, saying so, where it is not installed."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules",
                                       reason="DeepSpeed is not installed")
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
              "warmup_type": "log", "total_num_steps": 30}
    if kind == "WarmupCosineLR":
        params = {"warmup_num_steps": 10, "total_num_steps": 30, "warmup_min_ratio": 0.1,
                  "cos_min_ratio": 0.01}
    elif kind == "WarmupLR":
        params.pop("total_num_steps")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    real = getattr(lr_schedules, kind)(opt, **params)
    mine = DeepSpeedScheduler(kind, params, base_lr=2e-3)
    for _ in range(40):
        assert mine.get_lr() == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9)
        real.step()
        mine.step(1)


def _engine_worker(cfg, way):
    import megazero
    from megazero.config import OptimizerConfig
    from megazero.distributed.parallel_state import ParallelState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ps = ParallelState.build()
    if way == "deepspeed":
        engine, optimizer, loader, scheduler = megazero.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, parallel_state=ps)
        assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
        assert loader is None and engine.train_batch_size() == cfg["train_batch_size"]
    else:  # the same, spelled as megazero's own engine
        from megazero.engine import Engine
        from megazero.optim.ds_schedulers import DeepSpeedScheduler

        oc = OptimizerConfig(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             weight_decay=0.1, clip_grad=1.0, zero_stage=2,
                             zero_reduce_bucket_size=500_000_000, lr_decay_style="constant",
                             min_lr=0.0)
        sched = DeepSpeedScheduler("WarmupLR", cfg["scheduler"]["params"], base_lr=1e-3)
        engine = Engine(model, oc, ps, gradient_accumulation_steps=2, lr_scheduler=sched)
    g = torch.Generator().manual_seed(100 + ps.dp_rank)
    losses = []
    for _ in range(8):  # 4 optimizer steps of 2 micro-batches
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()], engine.get_lr()


def test_engine_built_deepspeeds_way_matches_the_direct_engine():
    ds = run_distributed(_engine_worker, 2, ZERO2, "deepspeed")
    direct = run_distributed(_engine_worker, 2, ZERO2, "direct")
    for (la, pa, lra), (lb, pb, lrb) in zip(ds, direct):
        assert la == lb and lra == lrb
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert ds[0][2] == [pytest.approx(1e-3 * 3 / 3)]  # 4 steps: warmup of 3 done


def test_pretrain_takes_the_ds_config(tmp_path):
    """--deepspeed --deepspeed_config gives the run its flags would (dp 2, ZeRO-2, AdamW,
    clipping, batch sizes), and a contradicting flag fails naming both."""
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
           "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95],
                                                     "weight_decay": 0.05}},
           "zero_optimization": {"stage": 2}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    base = TINY.replace("--clip-grad 1.0 --weight-decay 0.1", "") \
        .replace("--micro-batch-size 2 --global-batch-size 8 ", "").replace("--lr 1e-3 ", "")
    run = run_training(base + f" --train-iters 4 --deepspeed --deepspeed_config {path}", 2)
    flags = run_training(base + " --train-iters 4 --micro-batch-size 2 --global-batch-size 8 "
                         "--clip-grad 0.5 --lr 2e-3 --adam-beta2 0.95 --weight-decay 0.05 "
                         "--zero-stage 2", 2)
    assert_same_run(run, flags, rtol=0, what="ds_config vs flags")
    from megazero.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args((base + f" --lr 0.5 --deepspeed --deepspeed_config {path}").split(),
                   world_size=2)


def test_initialize_returns_deepspeeds_dataloader():
    import megazero

    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 2))
    engine, _, loader, scheduler = megazero.initialize(
        model=model, model_parameters=model.parameters(), training_data=data,
        config={"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "Adam"}})
    assert scheduler is None and engine.gradient_accumulation_steps() == 1
    assert [len(x) for x, _ in loader] == [3, 3, 3, 1]
    with pytest.raises(DeepSpeedConfigError, match="optimizer=None"):
        megazero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                            config={"train_batch_size": 1})
    with pytest.raises(DeepSpeedConfigError, match="activation checkpointing"):
        megazero.initialize(model=model, config={"train_batch_size": 1,
                            "activation_checkpointing": {"partition_activations": True}})


def _ckpt_worker(cfg, folder, phase):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ps = ParallelState.build()
    engine, _, _, _ = megazero.initialize(model=model, config=cfg, parallel_state=ps)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g))
               for _ in range(12)]

    def train(n):
        for x, y in batches[:n]:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()

    if phase == "save":
        train(6)  # 3 optimizer steps
        engine.save_checkpoint(folder, tag="mid", client_state={"epoch": 3, "seen": [1, 2]})
        train(6)
        engine.save_checkpoint(folder, tag="end", client_state={"epoch": 6}, save_latest=False)
        return [p.detach().clone() for p in model.parameters()], engine.get_lr()
    path, client = engine.load_checkpoint(folder, tag="mid")
    assert engine.global_steps == 3 and client == {"epoch": 3, "seen": [1, 2]}
    train(6)
    return [p.detach().clone() for p in model.parameters()], engine.get_lr(), path


def test_checkpoint_api_with_tags_at_another_layout(tmp_path):
    """save_checkpoint(dir, tag, client_state) at dp 2 with ZeRO-2, load_checkpoint(dir, tag)
    at dp 1 with ZeRO-0: the client state comes back, the step count and the scheduler (in
    optimizer steps) continue, and the continued run ends where the uninterrupted one did."""
    folder = str(tmp_path / "ckpt")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupDecayLR", "params": {
               "warmup_num_steps": 2, "total_num_steps": 10, "warmup_type": "linear"}},
           "zero_optimization": {"stage": 2}}
    full = run_distributed(_ckpt_worker, 2, cfg, folder, "save")
    assert open(f"{folder}/latest").read().strip() == "mid"
    # at dp 1 the same global batch is 2 micro-batches of 2 x 2 accumulation steps: use the
    # micro-batches of rank 0 only, so compare the schedule and the state, not the values
    cfg1 = {**cfg, "zero_optimization": {"stage": 0}}
    params, lr, path = run_distributed(_ckpt_worker, 1, cfg1, folder, "load")[0]
    assert path.endswith("mid")
    assert lr == full[0][1]  # 6 optimizer steps counted either way
    assert all(torch.isfinite(p).all() for p in params)


def test_the_chosen_update_is_named():
    from megazero.config import OptimizerConfig
    from megazero.distributed.parallel_state import ParallelState
    from megazero.optim.rules import build_rule, describe_rule

    ps = ParallelState.build()
    name = lambda **kw: describe_rule(build_rule(OptimizerConfig(**kw), ps))  # noqa: E731
    assert name().startswith("AdamW: megazero's")
    assert name(adam_w_mode=False).startswith("Adam (L2 weight decay)")
    assert name(use_fused_step=False).endswith("(--no-fused-optimizer-step)")
    assert name(cpu_torch_adam=True) == "torch.optim.AdamW (fused)"
    assert name(optimizer="lamb").startswith("LAMB") and name(optimizer="sgd").startswith("SGD")


def _tutorial_engine_worker(cfg):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    engine, _, _, _ = megazero.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg, parallel_state=ParallelState.build())
    g = torch.Generator().manual_seed(7 + engine.ps.dp_rank)
    mb = engine.train_micro_batch_size_per_gpu()
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        x, y = torch.randn(mb, 8, generator=g), torch.randn(mb, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, engine.global_steps, engine.config.optimizer.zero_stage


@pytest.mark.parametrize("name", ["ZERO2", "OFFLOAD", "ZERO3", "ONEBIT", "ZEROONE",
                                  "INFINITY"])
def test_tutorial_configs_run_through_both_entry_points(tmp_path, name):
    """The ZeRO, ZeRO-Offload, ZeRO-3, 1-bit Adam, 0/1 Adam and ZeRO-Infinity tutorial
    configs (the 1-bit ones naming gloo, which a CPU's exchange runs on; ZeRO-Infinity's less
    the keys megazero refuses): two optimizer steps through megazero.initialize on two ranks, and
    three iterations of pretrain_gpt2's loop."""
    cfg = {"ZERO2": ZERO2, "OFFLOAD": OFFLOAD, "ZERO3": ZERO3, "ONEBIT": ONEBIT,
           "ZEROONE": ZEROONE, "INFINITY": INFINITY}[name]
    cfg = json.loads(json.dumps(cfg).replace('"NVME"', json.dumps(str(tmp_path))))
    for losses, steps, stage in run_distributed(_tutorial_engine_worker, 2, cfg):
        assert steps == 2 and stage == cfg.get("zero_optimization", {}).get("stage", 0)
        assert all(math.isfinite(v) for v in losses)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    base = TINY.replace("--clip-grad 1.0 --weight-decay 0.1", "") \
        .replace("--micro-batch-size 2 --global-batch-size 8 ", "").replace("--lr 1e-3 ", "")
    if "scheduler" in cfg:  # the ds_config's schedule replaces megazero's
        base = base.replace("--lr-warmup-iters 2 ", "")
    losses, _, _ = run_training(base + f" --train-iters 3 --deepspeed --deepspeed_config {path}",
                                2)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
