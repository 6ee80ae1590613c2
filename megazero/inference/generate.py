"""Text generation from a megazero checkpoint: greedy, temperature, top-k and top-p sampling.

    python -m megazero.inference.generate --load CKPT --prompt "def main(" --greedy
    python -m megazero.inference.generate --load CKPT --temperature 0.8 --top-k 40 --seed 1
    torchrun --nproc-per-node 2 -m megazero.inference.generate --load CKPT --prompt "import os"

One process runs at tp=1; under torchrun the world is the tensor-parallel group (tp = world
size unless ``--tensor-model-parallel-size`` says; dp ranks, if any, generate the same text).
Pipeline parallelism is not used: the model is always loaded at pp=1. The checkpoint may be
saved at any tp/pp/dp/ZeRO layout (``checkpoint.load_checkpoint``, the one load path).

The prompt runs once and fills a KV cache (each rank keeps the keys and values of its own
heads); every later step runs only the new token against the cache, so a step costs one
token's forward instead of the whole context's (``--no-kv-cache`` recomputes the whole context
at every step, for comparison). The vocab-parallel logits of the last position
are all-gathered over tp, the padded vocabulary ids are masked, then temperature, top-k and
top-p (nucleus) filtering apply to the full logits and the token is drawn from a generator
seeded with ``--seed``: every tp rank computes the same logits and draws the same token (tp
rank 0's token is broadcast as well, so the ranks can never drift). The context is cut from
the left to ``max_position_embeddings`` tokens when it grows longer (noted once); positions
then shift, so from there on each step recomputes the cut context without the cache.

The tokenizer is the checkpoint's (``data.tokenizer_type`` and its files, e.g. the default
corpus's SentencePiece model in the cache; ids separated by spaces for --mock-data runs);
``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file`` and ``--merge-file`` override it.
Without ``--prompt`` generation starts from the end-of-document token.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys

import torch
import torch.distributed as dist

from megazero.checkpoint import CheckpointReader, load_checkpoint
from megazero.config import SEED_LIMIT, MegazeroConfig
from megazero.distributed import comm
from megazero.distributed.init import (
    destroy_distributed,
    init_distributed,
    launched_by_torchrun,
)
from megazero.distributed.parallel_state import ParallelState
from megazero.model import KVCache, build_gpt_model_chunks
from megazero.tensor_parallel.mappings import gather_from_tp_region
from megazero.tokenizer import build_tokenizer
from megazero.tokenizer.null import NullTokenizer

logger = logging.getLogger("megazero.inference.generate")


# ---- sampling --------------------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits ``[b, V]`` with every id outside the top-k and outside the nucleus set to -inf.

    top-k keeps the ``top_k`` largest (0: all). top-p keeps the smallest set of the most
    likely ids whose probabilities sum to at least ``top_p`` (the most likely id always stays).
    """
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [b, 1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely ids
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample(logits: torch.Tensor, *, greedy: bool = False, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next ids ``[b]`` from full logits ``[b, V]`` (padded ids already masked)."""
    logits = logits.float()
    if greedy:
        return logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"--temperature must be positive, got {temperature}")
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---- model -----------------------------------------------------------------------------------
def _generation_config(args: dict, tp: int, world: int, root: str) -> MegazeroConfig:
    d = copy.deepcopy(args)
    d["parallel"].update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                         virtual_pipeline_model_parallel_size=None, world_size=world,
                         sequence_parallel=False)
    d["optimizer"].update(zero_stage=0, cpu_offload=False)
    d["model"].update(recompute_activations=False, partition_activations=False)
    t = d["train"]
    t.update(load=root, no_load_rng=True, no_load_optim=True, finetune=False,
             global_batch_size=t["micro_batch_size"] * (world // tp))
    return MegazeroConfig.from_dict(d)


def load_model(root: str, *, iteration=None, tp: int | None = None, device=None):
    """(model at pp=1, config, ParallelState): one process at tp=1, or this rank's tp shard
    when torch.distributed is up (torchrun), loaded from any saved layout."""
    reader = CheckpointReader(root, iteration)
    if dist.is_initialized():
        world = dist.get_world_size()
    elif launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = 1
    distributed = world > 1 or dist.is_initialized()
    tp = tp or world
    config = _generation_config(reader.args, tp, world, root)
    if distributed:
        ps = init_distributed(config.parallel)
    else:
        ps = ParallelState.build(tp, 1, device=device)
    model = build_gpt_model_chunks(config.model, ps, device=ps.device)[0]
    load_checkpoint(root, model_chunks=[model], optimizer=None, lr_scheduler=None,
                    config=config, ps=ps, iteration=reader.iteration)
    model.eval()
    return model, config, ps


def build_generation_tokenizer(config: MegazeroConfig, overrides: dict | None = None):
    """The checkpoint's tokenizer (``--mock-data``: ids as text), with flag overrides."""
    d = config.data
    o = {k: v for k, v in (overrides or {}).items() if v is not None}
    if d.mock_data and not o:
        return NullTokenizer(config.model.vocab_size)
    kind = o.get("tokenizer_type") or d.tokenizer_type
    if kind is None:
        kind = "SentencePieceTokenizer" if o.get("tokenizer_model") else \
            "GPT2BPETokenizer" if o.get("vocab_file") else None
    if kind is None:
        raise ValueError("the checkpoint names no tokenizer: pass --tokenizer-model or "
                         "--vocab-file and --merge-file")
    return build_tokenizer(kind, vocab_file=o.get("vocab_file", d.vocab_file),
                           merge_file=o.get("merge_file", d.merge_file),
                           tokenizer_model=o.get("tokenizer_model", d.tokenizer_model))


@torch.no_grad()
def next_logits(model, ps: ParallelState, ids: torch.Tensor, vocab_size: int,
                kv_cache: KVCache | None = None) -> torch.Tensor:
    """Full logits ``[b, V]`` (padded ids masked to -inf) of the last position of ``ids``;
    with ``kv_cache``, ``ids`` are the positions after the cached ones."""
    s, start = ids.shape[1], kv_cache.offset if kv_cache is not None else 0
    position_ids = torch.arange(start, start + s, device=ids.device).unsqueeze(0).expand_as(ids)
    logits = model(ids, position_ids, kv_cache=kv_cache)[:, -1, :]  # [b, Vp/tp]
    logits = gather_from_tp_region(logits.contiguous(), ps.tp_group).float()  # [b, Vp]
    logits[:, vocab_size:] = float("-inf")
    return logits


@torch.no_grad()
def generate(model, ps: ParallelState, config: MegazeroConfig, prompt_ids: list[int], *,
             max_new_tokens: int, greedy: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 1234,
             eod: int | None = None, use_kv_cache: bool = True) -> list[int]:
    """The generated ids (without the prompt); stops early at ``eod`` when given."""
    max_pos = config.model.max_position_embeddings
    vocab = config.model.vocab_size
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    noted = False
    cache = KVCache(max_pos) if use_kv_cache else None
    for _ in range(max_new_tokens):
        if cache is not None and len(ids) <= max_pos:
            new = ids[cache.offset:]  # the prompt first, then one token per step
            x = torch.tensor([new], dtype=torch.long, device=ps.device)
            logits = next_logits(model, ps, x, vocab, cache).cpu()
        else:
            context = ids[-max_pos:]
            if len(context) < len(ids) and not noted:
                noted = True
                logger.warning("note: the context exceeds max_position_embeddings (%d); "
                               "keeping its last %d tokens", max_pos, max_pos)
            x = torch.tensor([context], dtype=torch.long, device=ps.device)
            logits = next_logits(model, ps, x, vocab).cpu()
        token = sample(logits, greedy=greedy, temperature=temperature, top_k=top_k,
                       top_p=top_p, generator=generator)
        if ps.tp_size > 1:  # identical on every rank already; keep it so whatever happens
            token = token.to(ps.device)
            comm.broadcast(token, ps.tp_src_rank, ps.tp_group)
            token = token.cpu()
        t = int(token[0])
        if eod is not None and t == eod:
            break
        ids.append(t)
        out.append(t)
    return out


# ---- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megazero.inference.generate",
                                description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint folder (a --save folder)")
    p.add_argument("--iteration", default=None, help="default: the tracker's")
    p.add_argument("--prompt", default=None, help="default: start from end-of-document")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true",
                   help="argmax at every step (temperature, top-k and top-p unused)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filtering")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus filtering")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ignore-eod", action="store_true",
                   help="keep generating after an end-of-document token")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute the whole context at every step")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="under torchrun; default: the world size")
    p.add_argument("--device", default=None, help="one process: cpu or cuda (default: cpu)")
    g = p.add_argument_group("tokenizer overrides")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    return p


def flag_errors(a: argparse.Namespace) -> list[str]:
    """What is wrong with the numeric flags, each naming the flag, the value and the range."""
    errors = []
    if a.max_new_tokens < 1:
        errors.append(f"--max-new-tokens must be an integer >= 1, got {a.max_new_tokens}")
    if a.greedy:  # unused, but never nonsense
        if not (math.isfinite(a.temperature) and a.temperature >= 0):
            errors.append(f"--temperature must be a finite number >= 0, got {a.temperature}")
    elif not (math.isfinite(a.temperature) and a.temperature > 0):
        errors.append("--temperature must be a finite number > 0 (or use --greedy), got "
                      f"{a.temperature}")
    if a.top_k < 0:
        errors.append(f"--top-k must be an integer >= 0 (0: no top-k filtering), got {a.top_k}")
    if not 0.0 < a.top_p <= 1.0:
        errors.append(f"--top-p must be in (0, 1], got {a.top_p}")
    if not 0 <= a.seed < SEED_LIMIT:
        errors.append(f"--seed must be an integer in [0, 2^63), got {a.seed}")
    if a.tensor_model_parallel_size is not None and a.tensor_model_parallel_size < 1:
        errors.append("--tensor-model-parallel-size must be an integer >= 1, got "
                      f"{a.tensor_model_parallel_size}")
    if a.iteration not in (None, "release") and \
            not (a.iteration.isascii() and a.iteration.isdigit()):
        errors.append(f"--iteration must be an integer >= 0 or 'release', got {a.iteration!r}")
    return errors


def parse_flags(argv=None) -> argparse.Namespace:
    """The command line, checked: a bad value exits with code 2 (argparse's error) before any
    checkpoint is opened."""
    parser = build_parser()
    a = parser.parse_args(argv)
    errors = flag_errors(a)
    if errors:
        parser.error("; ".join(errors))
    return a


def run(argv=None) -> dict:
    """Parse flags, load, generate; returns ``{"prompt_ids", "ids", "text", "full_text",
    "rank"}`` (``text``: the generated part; ``full_text``: prompt and generated part)."""
    a = parse_flags(argv)
    iteration = a.iteration if a.iteration in (None, "release") else int(a.iteration)
    model, config, ps = load_model(a.load, iteration=iteration,
                                   tp=a.tensor_model_parallel_size, device=a.device)
    tokenizer = build_generation_tokenizer(config, {
        "tokenizer_type": a.tokenizer_type, "tokenizer_model": a.tokenizer_model,
        "vocab_file": a.vocab_file, "merge_file": a.merge_file})
    prompt_ids = tokenizer.tokenize(a.prompt) if a.prompt else [tokenizer.eod]
    ids = generate(model, ps, config, prompt_ids, max_new_tokens=a.max_new_tokens,
                   greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                   seed=a.seed, eod=None if a.ignore_eod else tokenizer.eod,
                   use_kv_cache=a.kv_cache)
    full = tokenizer.detokenize(prompt_ids + ids) if a.prompt else tokenizer.detokenize(ids)
    return {"prompt_ids": prompt_ids, "ids": ids, "text": tokenizer.detokenize(ids),
            "full_text": full, "rank": ps.rank}


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        result = run(argv)
    except (ValueError, RuntimeError) as exc:  # CheckpointError, ConfigError, bad flags
        logger.error("error: %s", exc)
        return 1
    if result["rank"] == 0:  # the command's output: the text, on stdout
        sys.stdout.write(result["full_text"] + "\n")
    return 0


if __name__ == "__main__":
    rc = main()
    destroy_distributed()  # join the process groups' threads before the interpreter exits
    sys.exit(rc)
