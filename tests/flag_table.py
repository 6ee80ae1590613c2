"""The classification of every pretrain_gpt2.py flag that ``tests/test_flag_effects.py``
proves: which config field it sets, what it restates, where it is refused, or which test runs
it (the kinds are described there)."""

from __future__ import annotations

from dataclasses import dataclass

from megazero import arguments_compat

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2")
UNSET = object()


@dataclass
class Sets:
    path: str
    args: str = ""
    want: object = UNSET
    mode: str = ""  # flags the effect needs, given with and without the flag
    with_: str = ""  # flags that must come with the flag (given only with it)
    outside: tuple = ()  # each: flags after which the flag is refused


@dataclass
class Same:
    why: str
    args: str = ""
    mode: str = ""
    opposite: str = ""  # the flag that changes what this one restates (path: the field)
    path: str = ""
    outside: tuple = ()


@dataclass
class Restricted:
    ok: str  # the value megazero honours (the config is the one without the flag)
    refused: str  # a value it refuses
    outside: tuple = ()


@dataclass
class Refused:
    args: str = "x"
    outside: tuple = ("",)


@dataclass
class EntryPoint:
    test: str  # "tests/file.py::test_name" that runs it
    args: str = ""
    outside: tuple = ()


ROPE = "--position-embedding-type rope"
FULL = "--recompute-granularity full"
Z3 = "--zero-stage 3"
NVME = "--zero-stage 1 --offload-optimizer nvme --nvme-path /tmp/mz-nvme"
OFFLOAD_CPU = "--zero-stage 1 --offload-optimizer cpu"
PARAM_NVME = "--zero-stage 3 --offload-optimizer cpu --offload-param nvme --nvme-path /tmp/mz-n"
MOCK = "--mock-data --vocab-size 96"
SPM = "--tokenizer-type SentencePieceTokenizer --tokenizer-model /tmp/mz.model"
INTERLEAVED = ("--world-size 2 --pipeline-model-parallel-size 2 --global-batch-size 4 "
               "--num-layers-per-virtual-pipeline-stage 1")
DS = "--deepspeed_config {ds}"  # a ds_config with a scheduler (WarmupLR)
ADAM_ONLY = ("--optimizer sgd", "--optimizer lamb")
DRYRUN = "tests/test_dryrun.py::test_dry_run_on_fake_cuda"

FLAGS = {
    "-h": EntryPoint("tests/test_flag_effects.py::test_help_exits_0_with_every_group"),
    # model
    "--num-layers": Sets("model.num_layers", "8"),
    "--hidden-size": Sets("model.hidden_size", "64"),
    "--ffn-hidden-size": Sets("model.ffn_hidden_size", "96"),
    "--num-attention-heads": Sets("model.num_attention_heads", "8"),
    "--seq-length": Sets("model.seq_length", "8"),
    "--max-position-embeddings": Sets("model.max_position_embeddings", "64"),
    "--make-vocab-size-divisible-by": Sets("model.make_vocab_size_divisible_by", "64"),
    "--layernorm-epsilon": Sets("model.layernorm_epsilon", "1e-6"),
    "--init-method-std": Sets("model.init_method_std", "0.01"),
    "--attention-dropout": Sets("model.attention_dropout", "0.0"),
    "--hidden-dropout": Sets("model.hidden_dropout", "0.0"),
    "--position-embedding-type": Sets("model.position_embedding_type", "rope"),
    "--rotary-base": Sets("model.rotary_base", "500", mode=ROPE,
                          outside=("", "--position-embedding-type none")),
    "--rotary-percent": Sets("model.rotary_percent", "0.5", mode=ROPE, outside=("",)),
    "--normalization": Sets("model.normalization", "RMSNorm"),
    "--use-rotary-position-embeddings": Sets("model.position_embedding_type", want="rope"),
    "--swiglu": Sets("model.swiglu", want=True),
    "--group-query-attention": Sets("model.group_query_attention", want=True,
                                    with_="--num-query-groups 2", outside=("",)),
    "--num-query-groups": Sets("model.num_query_groups", "2", with_="--group-query-attention",
                               outside=("",)),
    "--untie-embeddings-and-output-weights": Sets("model.untie_embeddings_and_output_weights",
                                                  want=True),
    "--disable-bias-linear": Sets("model.add_bias_linear", want=False),
    "--attention-backend": Sets("model.attention_backend", "unfused"),
    # the unfused attention's softmax at --bf16/--fp16; the flash and fused kernels always
    # accumulate it in fp32, as fp32 runs do (the request is fulfilled in every mode)
    "--attention-softmax-in-fp32": Sets("model.attention_softmax_in_fp32", want=True),
    "--checkpoint-activations": Sets("model.recompute_activations", want=True),
    "--recompute-granularity": Sets("model.recompute_granularity", "selective"),
    "--recompute-method": Sets("model.recompute_method", "block", mode=FULL,
                               outside=("", "--recompute-granularity selective")),
    "--checkpoint-num-layers": Sets("model.recompute_num_layers", "2", mode=FULL,
                                    outside=("", "--recompute-granularity selective")),
    "--partition-activations": Sets("model.partition_activations", want=True, mode=FULL,
                                    outside=("",)),
    "--checkpoint-in-cpu": Sets("model.checkpoint_in_cpu", want=True, mode=FULL,
                                outside=("",)),
    "--no-bias-gelu-fusion": Sets("model.bias_gelu_fusion", want=False,
                                  outside=("--swiglu",)),
    "--no-bias-dropout-fusion": Sets("model.bias_dropout_fusion", want=False),
    "--no-bias-swiglu-fusion": Sets("model.bias_swiglu_fusion", want=False, mode="--swiglu",
                                    outside=("",)),
    "--no-rope-fusion": Sets("model.apply_rope_fusion", want=False, mode=ROPE, outside=("",)),
    "--no-persist-layer-norm": Sets("model.fused_layernorm", want=False),
    "--compile": Sets("model.compile", want=True),
    # parallelism
    "--tensor-model-parallel-size": Sets("parallel.tensor_model_parallel_size", "2",
                                         mode="--world-size 2"),
    "--pipeline-model-parallel-size": Sets("parallel.pipeline_model_parallel_size", "2",
                                           mode="--world-size 2"),
    "--num-layers-per-virtual-pipeline-stage": Sets(
        "parallel.virtual_pipeline_model_parallel_size", "1", want=2,
        mode="--world-size 2 --pipeline-model-parallel-size 2 --global-batch-size 4",
        outside=("", "--num-layers 1")),
    "--overlap-p2p-communication": Same("the default", mode=INTERLEAVED,
                                        opposite="--no-overlap-p2p-communication",
                                        path="parallel.overlap_p2p_comm",
                                        outside=("", "--world-size 2 "
                                                     "--pipeline-model-parallel-size 2")),
    "--no-overlap-p2p-communication": Sets("parallel.overlap_p2p_comm", want=False,
                                           mode=INTERLEAVED, outside=("",)),
    "--sequence-parallel": Sets("parallel.sequence_parallel", want=True),
    "--distributed-backend": Sets("parallel.distributed_backend", "nccl"),
    "--distributed-timeout-minutes": Sets("parallel.distributed_timeout_minutes", "20",
                                          want=20.0),
    "--ring-collectives": Sets("parallel.ring_collectives", "ring",
                               outside=("--distributed-backend nccl",)),
    "--world-size": Sets("parallel.world_size", "2"),
    # optimizer and learning rate
    "--optimizer": Sets("optimizer.optimizer", "sgd"),
    **{f"--{name}": Sets(f"optimizer.{name.replace('-', '_')}", "5",
                         mode="--optimizer zerooneadam", outside=("", "--optimizer onebitadam"))
       for name in ("var-freeze-step", "var-update-scaler", "local-step-scaler",
                    "local-step-clipper")},
    "--freeze-step": Sets("optimizer.freeze_step", "5", mode="--optimizer onebitadam",
                          outside=("", "--optimizer zerooneadam")),
    "--lr": Sets("optimizer.lr", "0.01", outside=(DS,)),
    "--min-lr": Sets("optimizer.min_lr", "1e-5",
                     outside=("--lr-decay-style constant", DS)),
    "--lr-decay-style": Sets("optimizer.lr_decay_style", "linear", outside=(DS,)),
    "--lr-wsd-decay-style": Sets("optimizer.lr_wsd_decay_style", "linear",
                                 mode="--lr-decay-style WSD --lr-wsd-decay-iters 2",
                                 outside=("",)),
    "--lr-wsd-decay-iters": Sets("optimizer.lr_wsd_decay_iters", "2",
                                 with_="--lr-decay-style WSD",
                                 outside=("", "--lr-decay-style WSD --lr-wsd-decay-samples 8")),
    "--lr-wsd-decay-samples": Sets("optimizer.lr_wsd_decay_samples", "8",
                                   with_="--lr-decay-style WSD", outside=("",)),
    "--lr-warmup-fraction": Sets("optimizer.lr_warmup_fraction", "0.1", outside=(DS,)),
    "--lr-warmup-iters": Sets("optimizer.lr_warmup_iters", "1",
                              outside=("--lr-warmup-samples 4", DS)),
    "--lr-warmup-samples": Sets("optimizer.lr_warmup_samples", "4", outside=(DS,)),
    "--lr-decay-iters": Sets("optimizer.lr_decay_iters", "10",
                             outside=("--lr-decay-style constant",
                                      "--lr-decay-style inverse-square-root",
                                      "--lr-decay-samples 40", DS)),
    "--lr-decay-samples": Sets("optimizer.lr_decay_samples", "40",
                               outside=("--lr-decay-style constant", DS)),
    "--weight-decay": Sets("optimizer.weight_decay", "0.1"),
    "--adam-beta1": Sets("optimizer.adam_beta1", "0.8", outside=("--optimizer sgd",)),
    "--adam-beta2": Sets("optimizer.adam_beta2", "0.95", outside=("--optimizer sgd",)),
    "--adam-eps": Sets("optimizer.adam_eps", "1e-6", outside=("--optimizer sgd",)),
    "--adam-w-mode": Same("the default", opposite="--no-adam-w-mode",
                          path="optimizer.adam_w_mode", outside=ADAM_ONLY),
    "--no-adam-w-mode": Sets("optimizer.adam_w_mode", want=False, outside=ADAM_ONLY),
    "--no-adam-bias-correction": Sets("optimizer.adam_bias_correction", want=False,
                                      outside=("--optimizer lamb", "--cpu-torch-adam")),
    "--sgd-momentum": Sets("optimizer.sgd_momentum", "0.5", mode="--optimizer sgd",
                           outside=("",)),
    "--clip-grad": Sets("optimizer.clip_grad", "0.5"),
    # mixed precision
    "--fp16": Sets("optimizer.fp16", want=True),
    "--bf16": Sets("optimizer.bf16", want=True),
    "--loss-scale": Sets("optimizer.loss_scale", "1024", want=1024.0),
    **{f"--{name}": Sets(f"optimizer.{name.replace('-', '_')}", value, want=want,
                         mode="--fp16", outside=("", "--bf16", "--fp16 --loss-scale 1024"))
       for name, value, want in (("initial-loss-scale", "4096", 4096.0),
                                 ("min-loss-scale", "2", 2.0),
                                 ("loss-scale-window", "100", 100), ("hysteresis", "3", 3))},
    # ZeRO
    "--zero-stage": Sets("optimizer.zero_stage", "1"),
    "--zero-reduce-bucket-size": Sets("optimizer.zero_reduce_bucket_size", "1000",
                                      outside=(Z3,)),
    "--overlap-grad-reduce": Same("the default", opposite="--no-overlap-grad-reduce",
                                  path="optimizer.overlap_grad_reduce"),
    "--no-overlap-grad-reduce": Sets("optimizer.overlap_grad_reduce", want=False),
    "--overlap-param-gather": Same("the default", mode="--zero-stage 1",
                                   opposite="--no-overlap-param-gather",
                                   path="optimizer.overlap_param_gather", outside=("", Z3)),
    "--no-overlap-param-gather": Sets("optimizer.overlap_param_gather", want=False,
                                      mode="--zero-stage 2", outside=("", Z3)),
    "--zero-param-persistence-threshold": Sets("optimizer.zero_param_persistence_threshold",
                                               "100", mode=Z3,
                                               outside=("", "--zero-stage 2")),
    "--no-zero-prefetch": Sets("optimizer.zero_prefetch", want=False, mode=Z3,
                               outside=("", "--zero-stage 2")),
    "--zero-max-live-parameters": Sets("optimizer.zero_max_live_parameters", "1000", mode=Z3,
                                       outside=("--zero-stage 2", Z3 + " --no-zero-prefetch")),
    "--zero-prefetch-bucket-size": Sets("optimizer.zero_prefetch_bucket_size", "1000",
                                        mode=Z3, outside=("--zero-stage 1",
                                                          Z3 + " --no-zero-prefetch")),
    "--no-zero3-order-check": Sets("optimizer.zero3_order_check", want=False, mode=Z3,
                                   outside=("", "--zero-stage 2")),
    "--cpu-offload": Sets("optimizer.cpu_offload", want=True, mode="--zero-stage 1",
                          outside=("",)),
    "--offload-optimizer": Sets("optimizer.offload_optimizer", "cpu", mode="--zero-stage 1",
                                outside=("",)),
    "--offload-param": Sets("optimizer.offload_param", "nvme",
                            mode=Z3 + " --offload-optimizer cpu", with_="--nvme-path /tmp/n",
                            outside=("--zero-stage 2 --offload-optimizer cpu --nvme-path /t",
                                     Z3 + " --nvme-path /tmp/n")),
    "--nvme-path": Sets("optimizer.nvme_path", "/tmp/mz-nvme", mode="--zero-stage 1",
                        with_="--offload-optimizer nvme", outside=("--zero-stage 1",)),
    "--nvme-sub-group-size": Sets("optimizer.nvme_sub_group_size", "1000", mode=NVME,
                                  outside=(OFFLOAD_CPU, PARAM_NVME)),
    "--nvme-threads": Sets("optimizer.nvme_threads", "2", mode=NVME, outside=(OFFLOAD_CPU,)),
    "--nvme-block-size": Sets("optimizer.nvme_block_size", "8192", mode=NVME,
                              outside=(OFFLOAD_CPU,)),
    "--nvme-buffer-count": Sets("optimizer.nvme_buffer_count", "4", mode=NVME,
                                outside=(OFFLOAD_CPU, PARAM_NVME)),
    "--cpu-torch-adam": Sets("optimizer.cpu_torch_adam", want=True,
                             outside=(*ADAM_ONLY, "--optimizer onebitadam")),
    "--ds_fused_adam": Same("the default", opposite="--no-fused-optimizer-step",
                            path="optimizer.use_fused_step",
                            outside=("--optimizer lamb", "--cpu-torch-adam")),
    "--no-fused-optimizer-step": Sets("optimizer.use_fused_step", want=False,
                                      outside=("--optimizer sgd", "--cpu-torch-adam")),
    # data and tokenizer
    "--data-path": Sets("data.data_path", "/tmp/mz-data", want=["/tmp/mz-data"],
                        mode="--tokenizer-type NullTokenizer --vocab-size 96", outside=("",)),
    "--split": Sets("data.split", "90,5,5", want="90,5,5", outside=(MOCK,)),
    "--data-cache-path": Sets("data.data_cache_path", "/tmp/mz-cache", outside=(MOCK,)),
    "--tokenizer-type": Sets("data.tokenizer_type", "NullTokenizer", with_="--vocab-size 96"),
    "--vocab-file": Sets("data.vocab_file", "/tmp/v.json",
                         with_="--tokenizer-type GPT2BPETokenizer --merge-file /tmp/m.txt",
                         outside=("", SPM, MOCK)),
    "--merge-file": Sets("data.merge_file", "/tmp/m.txt",
                         with_="--tokenizer-type GPT2BPETokenizer --vocab-file /tmp/v.json",
                         outside=("", SPM, MOCK)),
    "--tokenizer-model": Sets("data.tokenizer_model", "/tmp/t.model",
                              with_="--tokenizer-type SentencePieceTokenizer",
                              outside=("", MOCK)),
    "--eod-mask-loss": Sets("data.eod_mask_loss", want=True),
    "--reset-position-ids": Sets("data.reset_position_ids", want=True),
    "--reset-attention-mask": Sets("data.reset_attention_mask", want=True),
    "--num-workers": Sets("data.num_workers", "2"),
    "--mock-data": Sets("data.mock_data", want=True, with_="--vocab-size 96", outside=("",)),
    "--vocab-size": Sets("data.vocab_size", "96", with_="--mock-data", outside=("", SPM)),
    "--default-corpus-dir": Sets("data.default_corpus_dir", "/tmp/mz-corpus",
                                 outside=(MOCK, "--tokenizer-type NullTokenizer --vocab-size 96"
                                                " --data-path /tmp/d")),
    # training
    "--micro-batch-size": Sets("train.micro_batch_size", "1"),
    "--global-batch-size": Sets("train.global_batch_size", "4"),
    "--train-iters": Sets("train.train_iters", "8"),
    "--train-samples": Sets("train.train_samples", "64"),
    "--rampup-batch-size": Sets("train.rampup_batch_size", "2 2 32", want=[2, 2, 32],
                                mode="--train-samples 64 --global-batch-size 8",
                                outside=("--train-iters 4 --global-batch-size 8",)),
    "--seed": Sets("train.seed", "7"),
    "--exit-interval": Sets("train.exit_interval", "5"),
    "--exit-duration-in-mins": Sets("train.exit_duration_in_mins", "5", want=5.0),
    "--exit-signal-handler": Sets("train.exit_signal_handler", want=True),
    "--exit-signal": Sets("train.exit_signal", "SIGUSR1", mode="--exit-signal-handler",
                          outside=("",)),
    "--max-consecutive-skipped-iterations": Sets("train.max_consecutive_skipped_iterations",
                                                 "5"),
    "--skip-train": Sets("train.skip_train", want=True),
    "--log-interval": Sets("train.log_interval", "5"),
    # with --eval-iters 0 it waits for nothing; the launch scripts (scripts/*.sh) always give
    # it and turn evaluation off with EVAL_ITERS=0, so it is accepted there
    "--eval-interval": Sets("train.eval_interval", "5"),
    "--eval-iters": Sets("train.eval_iters", "5"),
    "--tensorboard-dir": Sets("train.tensorboard_dir", "/tmp/mz-tb"),
    "--log-timers": Sets("train.log_timers", want=True),
    "--log-memory": Sets("train.log_memory", want=True),
    "--pipeline-trace": Sets("train.pipeline_trace", "/tmp/mz-trace"),
    "--log-throughput": Sets("train.log_throughput", want=True),
    "--log-validation-ppl-to-tensorboard": Sets("train.log_validation_ppl_to_tensorboard",
                                                want=True, mode="--tensorboard-dir /tmp/tb",
                                                outside=("",)),
    "--wandb-project": Sets("train.wandb_project", "p"),
    "--wandb-exp-name": Sets("train.wandb_exp_name", "run", mode="--wandb-project p",
                             outside=("",)),
    "--wandb-save-dir": Sets("train.wandb_save_dir", "/tmp/wb", mode="--wandb-project p",
                             outside=("",)),
    "--profile": Sets("train.profile", want=True),
    "--use-pytorch-profiler": Sets("train.profile", want=True),
    "--profile-step-start": Sets("train.profile_step_start", "11", mode="--profile",
                                 outside=("",)),
    "--profile-step-end": Sets("train.profile_step_end", "14", mode="--profile",
                               outside=("",)),
    "--profile-ranks": Sets("train.profile_ranks", "0 1", want=[0, 1], mode="--profile",
                            outside=("",)),
    "--profile-dir": Sets("train.profile_dir", "/tmp/prof", mode="--profile", outside=("",)),
    "--manual-gc": Sets("train.manual_gc", want=True),
    "--manual-gc-interval": Sets("train.manual_gc_interval", "10", mode="--manual-gc",
                                 outside=("",)),
    # returns the CUDA allocator's blocks: acts on CUDA devices (the dry run and GPU runs)
    "--empty-unused-memory-level": Sets("train.empty_unused_memory_level", "1"),
    # checkpointing
    "--save": Sets("train.save", "/tmp/mz-ckpt"),
    "--load": Sets("train.load", "/tmp/mz-ckpt"),
    "--save-interval": Sets("train.save_interval", "10", mode="--save /tmp/c", outside=("",)),
    "--no-verify-checkpoint": Sets("train.verify_checkpoint", want=False, mode="--load /c",
                                   outside=("",)),
    **{f"--{name}": Sets(f"train.{name.replace('-', '_')}", want=True,
                         mode="--save /c" if "save" in name else "--load /c", outside=("",))
       for name in ("no-save-optim", "no-save-rng", "no-load-optim", "no-load-rng", "finetune",
                    "use-checkpoint-args", "exit-on-missing-checkpoint")},
    # Megatron's flags with Megatron's meaning through megazero's settings
    **{flag: Same(why) for flag, why in arguments_compat.ALWAYS_SO.items()},
    "--use-distributed-optimizer": Sets("optimizer.zero_stage", want=1),
    "--num-key-value-heads": Sets("model.num_query_groups", "2", want=2),
    "--recompute-activations": Sets("model.recompute_granularity", want="selective",
                                    outside=("--checkpoint-activations", FULL)),
    "--no-position-embedding": Sets("model.position_embedding_type", want="none"),
    "--kv-channels": Restricted(ok="8", refused="16"),
    "--use-flash-attn": Sets("model.attention_backend", want="flash",
                             outside=("--attention-backend unfused",)),
    "--no-masked-softmax-fusion": Sets("model.attention_backend", want="unfused",
                                       outside=("--attention-backend flash",
                                                "--use-flash-attn")),
    "--no-create-attention-mask-in-dataloader": Same(
        "megazero builds no mask unless --reset-attention-mask",
        outside=("--reset-attention-mask",)),
    **{flag: Restricted(ok=values[0], refused="other")
       for flag, (values, _) in arguments_compat.RESTRICTED.items()},
    # refused, each naming an alternative
    **{flag: Refused() for flag in arguments_compat.REFUSED},
    # DeepSpeed
    "--deepspeed": Same("the ds_config applies with or without it", mode=DS, outside=("",)),
    "--deepspeed_config": Sets("optimizer.ds_scheduler", "{ds}", want="WarmupLR"),
    # the dry run (pretrain_gpt2.py runs it; parse_args takes its world size)
    "--dry-run-rank": EntryPoint(DRYRUN, "0", outside=("",)),
    "--dry-run-world-size": Sets("parallel.world_size", "2", with_="--dry-run-rank 0",
                                 outside=("",)),
    "--dry-run-device": EntryPoint("tests/test_dryrun.py::test_dry_run_rejects_an_impossible_"
                                   "layout", "cpu", outside=("",)),
    "--dry-run-iters": EntryPoint("tests/test_launches.py::test_gpt2_345m_on_fake_cuda_meets_"
                                  "the_launch_and_sync_targets", "2", outside=("",)),
    "--dry-run-report": EntryPoint(DRYRUN, "/tmp/mz-report.json", outside=("",)),
    "--no-dry-run-check-peers": EntryPoint(DRYRUN, outside=("",)),
}
