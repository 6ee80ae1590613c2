"""The flags that choose how a run is set up rather than what it trains: DeepSpeed's
``--deepspeed``/``--deepspeed_config`` (a ds_config.json applied over the command line) and
the dry run's ``--dry-run-*`` (one rank of an N-rank job on fake tensors). Part of
``megazero.arguments``' parser."""

from __future__ import annotations

from megazero.config import ConfigError, MegazeroConfig
from megazero.config.deepspeed import parse_ds_config


def add_config_arguments(parser):
    """DeepSpeed's ``deepspeed.add_config_arguments(parser)``: ``--deepspeed`` and
    ``--deepspeed_config`` on the user's own parser (``initialize(args=...)`` reads them)."""
    add_deepspeed_args(parser)
    return parser


def add_deepspeed_args(parser):
    g = parser.add_argument_group("DeepSpeed (Megatron-DeepSpeed's flags)")
    g.add_argument("--deepspeed", action="store_true",
                   help="take batch sizes, optimizer, ZeRO, precision, clipping, scheduler "
                        "and logging from --deepspeed_config")
    g.add_argument("--deepspeed_config", "--deepspeed-config", default=None,
                   help="a ds_config.json (strict: unknown or unsupported keys fail by name; "
                        "a value that contradicts a flag given on the command line fails)")


def apply_deepspeed_config(config: MegazeroConfig, ns, argv, parser) -> MegazeroConfig:
    """``config`` with the ds_config's settings; a flag given on the command line must agree
    with the ds_config's value for it."""
    if ns.deepspeed and not ns.deepspeed_config:
        raise ConfigError("--deepspeed needs --deepspeed_config ds_config.json")
    if not ns.deepspeed_config:
        return config
    p = config.parallel
    settings = parse_ds_config(ns.deepspeed_config, p.world_size, p.tensor_model_parallel_size,
                               p.pipeline_model_parallel_size)
    given = list(argv)
    explicit = {}
    for action in parser._actions:
        if any(a == opt or a.startswith(opt + "=") for opt in action.option_strings
               for a in given):
            for path in settings.fields:
                if path.split(".")[1] == action.dest:
                    explicit[path] = action.option_strings[0]
    config = settings.apply(config, explicit)
    if settings.scheduler is not None:
        kind, params = settings.scheduler
        d = config.to_dict()
        d["optimizer"].update(ds_scheduler=kind, ds_scheduler_params=params)
        config = MegazeroConfig.from_dict(d)
    return config


def add_dry_run_args(parser):
    g = parser.add_argument_group(
        "dry run", "execute rank R of an N-rank job in this one CPU process on fake tensors "
                   "and a fake process group, and report its memory and collectives "
                   "(megazero.dryrun)")
    g.add_argument("--dry-run-rank", type=int, default=None, help="the global rank to play")
    g.add_argument("--dry-run-world-size", type=int, default=None,
                   help="the job's world size (needed with --dry-run-rank)")
    g.add_argument("--dry-run-device", choices=["cuda", "cpu"], default="cuda",
                   help="the job's device (cuda works on a CPU-only torch)")
    g.add_argument("--dry-run-iters", type=int, default=1, help="training iterations to run")
    g.add_argument("--dry-run-report", default=None, help="also write the report as JSON here")
    g.add_argument("--no-dry-run-check-peers", dest="dry_run_check_peers",
                   action="store_false", default=True,
                   help="skip dry-running a peer rank of each group to compare collectives")


DRY_RUN_FIELDS = ("rank", "world_size", "device", "iters", "report", "check_peers")


def check_dry_run(ns, given) -> None:
    """The dry-run flags act in a dry run only: ``--dry-run-rank`` and ``--dry-run-world-size``
    come together, the others need them, and ``--world-size`` must agree with the dry run's."""
    rank, world = ns.dry_run_rank is not None, ns.dry_run_world_size is not None
    if rank != world:
        raise ConfigError("--dry-run-rank and --dry-run-world-size go together")
    others = sorted(f for f in given if f.startswith(("--dry-run-", "--no-dry-run-"))
                    and f not in ("--dry-run-rank", "--dry-run-world-size"))
    if others and not rank:
        raise ConfigError("; ".join(f"{f} sets up a dry run: it needs --dry-run-rank and "
                                    "--dry-run-world-size" for f in others))
    if world and ns.world_size is not None and ns.world_size != ns.dry_run_world_size:
        raise ConfigError(f"--world-size ({ns.world_size}) contradicts --dry-run-world-size "
                          f"({ns.dry_run_world_size}), the world size the dry run plays")
