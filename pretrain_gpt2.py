"""Pretrain GPT-2 with megazero: Megatron-LM's entry point, flags and log line.

    python pretrain_gpt2.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 \
        --seq-length 256 --micro-batch-size 4 --global-batch-size 16 --train-iters 200
    torchrun --nproc-per-node 4 pretrain_gpt2.py --tensor-model-parallel-size 2 ...

With no --data-path, the built-in default corpus (the Python standard library, tokenized with
a SentencePiece BPE trained on it) is built once and cached. See scripts/ for launchers.
"""

import sys
from functools import partial

import torch

from megazero import dryrun
from megazero.arguments import dry_run_args, parse_args
from megazero.distributed import destroy_distributed
from megazero.model import build_gpt_model_chunks, gpt_zero3_units
from megazero.training import pretrain
from megazero.training.data import default_datasets_provider


def model_provider(config, ps, tracker):
    """This rank's GPT-2 chunks (one per virtual pipeline stage).

    With ZeRO-3 the chunks are built on the meta device: the optimizer materialises each
    rank's partition directly, so the full model never exists on one rank.
    """
    zero3 = config.optimizer.zero_stage == 3
    return build_gpt_model_chunks(config.model, ps, tracker=tracker,
                                  seed=None if zero3 else config.train.seed,
                                  sequence_parallel=config.parallel.sequence_parallel,
                                  device="meta" if zero3 else ps.device)


# ZeRO-3 gathers an embedding, a transformer layer or the final LayerNorm at a time.
zero3_unit_policy = gpt_zero3_units


def train_valid_test_datasets_provider(config, tokenizer, train_val_test_num_samples, ps):
    """GPT datasets from --data-path (a prefix or a weighted blend), split by --split."""
    return default_datasets_provider(config, tokenizer, train_val_test_num_samples, ps)


def loss_func(loss_mask, output_tensor):
    """Mean of the per-token losses over the tokens the mask keeps."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    """One micro-batch through this rank's model chunk."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    dry = dry_run_args()
    if dry is not None:  # one rank of a larger job, on fake tensors (megazero.dryrun)
        report = dryrun.main(parse_args(world_size=dry["world_size"]), dry,
                             datasets_provider=train_valid_test_datasets_provider,
                             model_provider=model_provider, forward_step_func=forward_step,
                             zero3_unit_policy=zero3_unit_policy)
        print(report.table(), flush=True)
        sys.exit(0 if report.ok else 1)
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, parse_args(),
             zero3_unit_policy=zero3_unit_policy)
    # Join the process groups' threads before the interpreter exits: left to the atexit
    # teardown, gloo's threads are sometimes destroyed while joinable (SIGABRT, rc != 0).
    destroy_distributed()
