"""Train a custom model on tp x pp x dp through megazero's DeepSpeed-style engine.

    python scripts/train_custom_3d.py                                   # one process
    torchrun --nproc-per-node 8 scripts/train_custom_3d.py --tp 2 --pp 2  # tp2 x pp2 x dp2

The model is user code: a tied token embedding, pre-norm residual MLP blocks built from
megazero's ``ColumnParallelLinear``/``RowParallelLinear``, a final LayerNorm, and the
embedding again as the output projection (``TiedLayerSpec``), with the vocab-parallel cross
entropy as the loss. It is written as DeepSpeed users write theirs: ``LayerSpec``s in a
``PipelineModule``, a ds_config dict, ``initialize`` returning the 4-tuple, and
``engine.train_batch(data_iter)``. Every layout prints the same losses as one process (same
seed, same global batch), up to fp32 rounding. ``--save``/``--load`` write and read
DeepSpeed-style tagged checkpoints at any layout.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megazero  # noqa: E402
from megazero.config import ParallelConfig  # noqa: E402
from megazero.distributed import destroy_distributed, init_distributed  # noqa: E402
from megazero.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402
from megazero.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    vocab_parallel_cross_entropy,
)

VOCAB, HIDDEN, FFN, SEQ, BLOCKS = 64, 32, 128, 16, 4


class Embedding(nn.Module):
    """Token ids [b, s] -> [b, s, h]; its weight is split over tp by vocabulary rows."""

    def __init__(self, vocab, hidden, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.word = VocabParallelEmbedding(vocab, hidden, tp_group=tp_group,
                                           make_vocab_size_divisible_by=8)

    def forward(self, ids):
        return self.word(ids)


def output_logits(embedding: Embedding, x):
    """The tied output projection: [b, s, h] -> this rank's vocabulary slice [b, s, V/tp]."""
    return F.linear(copy_to_tp_region(x, embedding.tp_group), embedding.word.weight)


class Block(nn.Module):
    """x + W2 gelu(W1 norm(x)), W1 split by columns and W2 by rows over tp."""

    def __init__(self, hidden, ffn, tp_group):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = ColumnParallelLinear(hidden, ffn, tp_group=tp_group, gather_output=False)
        self.fc2 = RowParallelLinear(ffn, hidden, tp_group=tp_group, input_is_parallel=True)

    def forward(self, x):
        h, _ = self.fc1(self.norm(x))
        h, _ = self.fc2(F.gelu(h))
        return x + h


def build_model(ps, *, virtual_stages=1, partition_method="type:Block",
                activation_checkpoint_interval=0) -> PipelineModule:
    tp = ps.tp_group

    def loss_fn(logits, labels):  # [b, s, V/tp], [b, s]
        return vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=VOCAB).mean()

    layers = [TiedLayerSpec("embed", Embedding, VOCAB, HIDDEN, tp,
                            tied_weight_attr="word.weight"),
              *[LayerSpec(Block, HIDDEN, FFN, tp) for _ in range(BLOCKS)],
              LayerSpec(nn.LayerNorm, HIDDEN),
              TiedLayerSpec("embed", Embedding, VOCAB, HIDDEN, tp, forward_fn=output_logits,
                            tied_weight_attr="word.weight")]
    return PipelineModule(layers, num_stages=ps.pp_size, loss_fn=loss_fn, parallel_state=ps,
                          partition_method=partition_method, virtual_stages=virtual_stages,
                          activation_checkpoint_interval=activation_checkpoint_interval)


def ds_config(zero_stage: int, global_batch: int = 16, micro_batch: int = 2) -> dict:
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                         "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 3}},
            "zero_optimization": {"stage": zero_stage}}


def batches(step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int):
    """This dp rank's micro-batches of global batch ``step``: (ids, labels) pairs [b, s].

    The sequences follow t[i+1] = (5 t[i] + 3) mod VOCAB from a random start, a pattern the
    model can learn; every layout sees the same global batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (global_batch, 1), generator=gen)
    seq = [start]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    tokens = torch.cat(seq, dim=1)  # [B, s + 1]
    mine = tokens.chunk(dp_size)[dp_rank]
    for mb in mine.split(micro_batch):
        yield mb[:, :-1].contiguous(), mb[:, 1:].contiguous()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--partition-method", default="type:Block")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0)
    parser.add_argument("--save", help="save a tagged checkpoint here at the end")
    parser.add_argument("--load", help="resume from the latest tag here first")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    ps = init_distributed(ParallelConfig(tensor_model_parallel_size=args.tp,
                                         pipeline_model_parallel_size=args.pp,
                                         world_size=world))
    model = build_model(ps, virtual_stages=args.virtual_stages,
                        partition_method=args.partition_method,
                        activation_checkpoint_interval=args.activation_checkpoint_interval)
    config = ds_config(args.zero_stage)
    engine, _, _, _ = megazero.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
    first = 1
    if args.load:
        _, client_state = engine.load_checkpoint(args.load)
        first = client_state["next_step"]
    for step in range(first, first + args.steps):
        data = batches(step, config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
                       ps.dp_rank, ps.dp_size)
        loss = engine.train_batch(data)
        if ps.rank == 0:
            print(f"step {step:4d} | loss {loss.item():.6E} | grad norm "
                  f"{engine.last_grad_norm:.6E} | lr {engine.get_lr()[0]:.3E}", flush=True)
    if args.save:
        engine.save_checkpoint(args.save, tag=f"step{first + args.steps - 1}",
                               client_state={"next_step": first + args.steps})
    destroy_distributed()  # join the process groups' threads before the interpreter exits


if __name__ == "__main__":
    main()
