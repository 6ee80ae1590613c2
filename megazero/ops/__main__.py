"""``python -m megazero.ops [--json]``: which compiled ops are built, the SIMD level each
runs, why any is missing, and the environment (torch/CUDA versions, CPU features, threads,
OpenMP runtimes loaded) -- megazero's ``ds_report``.

Ops are discovered from ``megazero.ops.registry.OP_MODULES``; every module listed there
registers its ops on import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys

import torch

from megazero.ops import _cpu_ext, registry
from megazero.ops.fused_step import fused_step_status

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def cpu_info() -> dict:
    """Model name and the SIMD flags the kernels care about (Linux /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def openmp_runtimes() -> list[str]:
    """OpenMP runtime libraries mapped into this process (one is right; two oversubscribe)."""
    libs = set()
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if any(name in os.path.basename(path) for name in ("libgomp", "libiomp", "libomp")):
                    libs.add(path)
    except OSError:
        pass
    return sorted(libs)


def collect() -> dict:
    import_errors = registry.import_op_modules()
    ops = [registry.op_status(spec) for spec in registry.registered_ops()]
    env = {k: os.environ.get(k) for k in ("MEGAZERO_DISABLE_OPS", "MEGAZERO_SIMD",
                                          "MEGAZERO_BUILD_OPS", "OMP_NUM_THREADS")}
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu": cpu_info(),
        "simd_levels_supported": _cpu_ext.supported_simd_levels("adam"),
        "torch_threads": torch.get_num_threads(),
        "openmp_runtimes": openmp_runtimes(),
        "env": env,
        "ops": ops,
        "import_errors": import_errors,
        "default_update": default_update(),
    }


def default_update() -> str:
    """The Adam update a run gets with the default flags (DeepSpeed's "Using ... optimizer";
    the run itself logs the one its flags chose)."""
    status = fused_step_status()
    if status["built"]:
        return f"AdamW: megazero's fused step ({status['simd']})"
    return f"AdamW: megazero's step, PyTorch reference ({status['reason']})"


def print_report(info: dict) -> None:
    line = "-" * 96
    print(line)
    print("megazero ops report")
    print(line)
    cuda = info["torch_cuda"] or "none (CPU build)"
    rows = [
        ("python", info["python"]),
        ("torch", f"{info['torch']} (CUDA {cuda}; GPU available: {info['cuda_available']}"
                  + (f", {', '.join(info['cuda_devices'])}" if info["cuda_devices"] else "")
                  + ")"),
        ("cpu", f"{info['cpu']['model']} [{' '.join(info['cpu']['flags']) or 'no AVX'}]"),
        ("simd levels", ", ".join(info["simd_levels_supported"]) or "unknown (_adam not built)"),
        ("threads", f"torch.get_num_threads() = {info['torch_threads']} (kernels use the same)"),
        ("openmp runtimes", ", ".join(info["openmp_runtimes"]) or "none loaded"),
        ("environment", ", ".join(f"{k}={v}" for k, v in info["env"].items() if v) or "-"),
        ("default update", f"{info['default_update']} (--cpu-torch-adam: torch.optim.AdamW)"),
    ]
    for key, value in rows:
        print(f"{key:.<18} {value}")
    print(line)
    w_op = max([len("op")] + [len(op["name"]) for op in info["ops"]]) + 2
    w_ext = max([len("extension")] + [len(op["extension"]) for op in info["ops"]]) + 2
    w_simd = max([len("simd")] + [len(op["simd"] or "-") for op in info["ops"]]) + 2
    print(f"{'op':<{w_op}}{'extension':<{w_ext}}{'built':<7}{'simd':<{w_simd}}notes")
    print(line)
    for op in info["ops"]:
        notes = op["description"] if op["built"] else op["reason"]
        print(f"{op['name']:<{w_op}}{op['extension']:<{w_ext}}{'yes' if op['built'] else 'NO':<7}"
              f"{op['simd'] or '-':<{w_simd}}{notes}")
    for module, err in info["import_errors"].items():
        print(f"{'(import failed)':<{w_op}}{module} {err}")
    print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megazero.ops", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    # Missing extensions are listed in the table; no warning lines for each.
    logging.getLogger("megazero.ops._loader").setLevel(logging.ERROR)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_report(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
