"""One contender's training step, timed in this process: the child side of bench_gpu_step.py.

Every contender is timed by the same ``IterationClock``: iteration i runs between
``clock.start(i)`` and ``clock.end(i)``, each of which synchronizes the device before reading
the wall clock. The first ``warmup`` iterations are left out of the median (the first one's
time, compilation included, is reported), then ``iters`` are timed, then one more runs under
``torch.profiler``: on CUDA its kernels, memcpys and memsets are the launches, and the union of
their intervals over the median iteration time is the GPU-busy fraction; on a CPU (the smoke
run) the top-level ATen ops stand in for both. The peak is ``max_memory_allocated`` from the
first iteration on (CUDA only).

Jobs (``run_job``): ``megazero`` (``pretrain()`` of pretrain_gpt2.py's providers with Megatron's
flags, bf16, synthetic data; the clock rides on its monitor's iteration hooks), ``plain-gpt2``
(gpt2_plain.py, eager or under torch.compile) and ``megatron-core`` (megatron_core_gpt.py, CUDA
only). A job tries its micro-batch sizes in order and keeps the first that does not run out
of memory.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import pretrain_gpt2  # the repository root's entry point: its providers
from benchmarks import gpt2_plain, megatron_core_gpt
from megazero.arguments import parse_args
from megazero.distributed import destroy_distributed


class IterationClock:
    """Times iterations 1..warmup+iters and profiles iteration warmup+iters+1."""

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters
        self.total = warmup + iters + 1
        self.times: list[float] = []
        self.profiler = None
        self.launches = None
        self.busy_s = None
        self._t0 = 0.0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, i: int) -> None:
        if i == 1 and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if i == self.total:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                             if self.device.type == "cuda" else [])
            self.profiler = profile(activities=acts)
            self.profiler.__enter__()
        self._sync()
        self._t0 = time.perf_counter()

    def end(self, i: int) -> None:
        self._sync()
        elapsed = time.perf_counter() - self._t0
        if i == self.total:
            self.profiler.__exit__(None, None, None)
            self.launches, self.busy_s = device_work(self.profiler, self.device.type)
            self.profiler = None
        else:
            self.times.append(elapsed)

    def result(self) -> dict:
        """What the parent needs: per-iteration seconds, first, profile, peak."""
        peak = torch.cuda.max_memory_allocated(self.device) \
            if self.device.type == "cuda" else None
        return {"times": self.times, "warmup": self.warmup,
                "first_iter_s": self.times[0] if self.times else None,
                "launches": self.launches, "busy_s": self.busy_s, "peak_mem_bytes": peak}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def device_work(prof, device_type: str) -> tuple[int, float]:
    """(launches, busy seconds) of a profiled iteration: CUDA kernels, memcpys and memsets on
    a GPU; the top-level ATen ops on a CPU."""
    events = prof.events()
    if device_type == "cuda":
        work = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        work = [e for e in events if e.name.startswith("aten::") and not _under_aten(e)]
    spans = [(e.time_range.start, e.time_range.end) for e in work]  # microseconds
    return len(work), union_length(spans) / 1e6


def _under_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _micro_batches(spec: dict, mb: int, device: torch.device) -> list:
    """(tokens, labels) ``[mb, s]`` on the host (page-locked for a GPU), gbs / mb of them."""
    g = torch.Generator().manual_seed(1234)
    size = (mb, spec["seq_length"])
    batches = [(torch.randint(0, spec["vocab_size"], size, generator=g),
                torch.randint(0, spec["vocab_size"], size, generator=g))
               for _ in range(spec["global_batch_size"] // mb)]
    if device.type == "cuda":
        batches = [(t.pin_memory(), y.pin_memory()) for t, y in batches]
    return batches


def megazero_args(spec: dict, mb: int, compile_layers: bool) -> list[str]:
    """pretrain_gpt2.py's flags for the job: Megatron's, bf16, synthetic tokens, no eval, one
    log line after the last iteration."""
    n = spec["warmup"] + spec["iters"] + 1
    args = [f"--num-layers={spec['num_layers']}", f"--hidden-size={spec['hidden_size']}",
            f"--num-attention-heads={spec['num_attention_heads']}",
            f"--seq-length={spec['seq_length']}",
            f"--max-position-embeddings={spec['seq_length']}", f"--micro-batch-size={mb}",
            f"--global-batch-size={spec['global_batch_size']}",
            f"--vocab-size={spec['vocab_size']}", "--make-vocab-size-divisible-by=128",
            "--attention-dropout=0", "--hidden-dropout=0", "--lr=3e-4", "--min-lr=3e-5",
            "--weight-decay=0.1", "--clip-grad=1.0", "--bf16", "--mock-data",
            f"--train-iters={n}", f"--log-interval={n}", "--eval-iters=0"]
    return args + (["--compile"] if compile_layers else [])


def run_megazero(spec: dict, mb: int, device: torch.device) -> dict:
    config = parse_args(megazero_args(spec, mb, spec["variant"] == "compile"))
    clock = IterationClock(device, spec["warmup"], spec["iters"])

    def on_ready(trainer):
        monitor = trainer.monitor
        start, end = monitor.iteration_start, monitor.iteration_end

        def timed_start(i):
            start(i)
            clock.start(i)

        def timed_end(i):
            clock.end(i)
            end(i)
        monitor.iteration_start, monitor.iteration_end = timed_start, timed_end

    try:
        pretrain_gpt2.pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                               pretrain_gpt2.model_provider, pretrain_gpt2.forward_step, config,
                               zero3_unit_policy=pretrain_gpt2.zero3_unit_policy,
                               on_ready=on_ready)
    finally:
        destroy_distributed()
    return clock.result()


def _loop(step, clock: IterationClock) -> dict:
    for i in range(1, clock.total + 1):
        clock.start(i)
        step()
        clock.end(i)
    return clock.result()


def run_plain(spec: dict, mb: int, device: torch.device) -> dict:
    cfg = gpt2_plain.GPT2Config(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
        num_heads=spec["num_attention_heads"], seq_length=spec["seq_length"],
        vocab_size=spec["vocab_size"])
    model = gpt2_plain.GPT2(cfg, device=device)
    optimizer = gpt2_plain.make_optimizer(model)
    if spec["variant"] == "compile":
        model = gpt2_plain.compile_model(model)
    batches = _micro_batches(spec, mb, device)
    clock = IterationClock(device, spec["warmup"], spec["iters"])
    return _loop(lambda: gpt2_plain.train_step(model, optimizer, batches, device=device), clock)


def run_megatron_core(spec: dict, mb: int, device: torch.device) -> dict:
    why = megatron_core_gpt.import_error()
    if why:
        return {"status": f"skipped: {why}"}
    if device.type != "cuda":
        return {"status": "skipped: Megatron-core's local attention allocates its buffer on "
                          "torch.cuda.current_device(): needs a CUDA device"}
    shape = megatron_core_gpt.Shape(
        spec["num_layers"], spec["hidden_size"], spec["num_attention_heads"],
        spec["seq_length"], spec["vocab_size"], mb, spec["global_batch_size"])
    megatron_core_gpt.init_parallel_state(fake=False)
    runner = megatron_core_gpt.MegatronCoreGPT(shape)
    batches = _micro_batches(spec, mb, device)
    clock = IterationClock(device, spec["warmup"], spec["iters"])
    return _loop(lambda: runner.step(batches), clock)


RUNNERS = {"megazero": run_megazero, "plain-gpt2": run_plain,
           "megatron-core": run_megatron_core}


def run_job(spec: dict) -> dict:
    """The job of ``spec`` at the first of its micro-batch sizes that fits: the clock's
    result with ``status`` and ``micro_batch_size`` (status "oom" when none fits)."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tried = []
    for mb in spec["micro_batch_sizes"]:
        try:
            out = RUNNERS[spec["contender"]](spec, mb, device)
        except torch.OutOfMemoryError:
            tried.append(mb)
            out = None
        if out is not None:
            out.setdefault("status", "ok")
            return {**out, "micro_batch_size": mb, "oom_micro_batch_sizes": tried}
        gc.collect()  # the failed attempt's tensors, freed with its frames
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return {"status": "oom", "micro_batch_size": tried[-1] if tried else None,
            "oom_micro_batch_sizes": tried}


def median_ms(times: list[float], warmup: int) -> float | None:
    timed = times[warmup:]
    return statistics.median(timed) * 1e3 if timed else None
