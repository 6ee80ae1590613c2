"""Fake CUDA on a CPU-only torch, so the dry run can execute one rank's GPU code here.

``FakeTensorMode`` makes ``cuda`` tensors (shapes, dtypes, devices; no memory) on any build,
but backward over them needs a CUDA device guard and ATen's CUDA hooks, which a CPU build
lacks. ``csrc/fake_cuda/fake_cuda.cpp`` provides both as no-ops; this module compiles it once
per torch version (about 5 s, with the C++ compiler that builds megazero's kernels, against
torch's headers) into ``$MEGAZERO_CACHE`` (default ``~/.cache/megazero``) and loads it.

ATen reads its CUDA hooks once, at ``import torch``: the library must be loaded first. A
process that has already imported torch re-executes itself with the library in
``LD_PRELOAD`` (``reexec_with_fake_cuda``). Nothing here imports torch at module level.

On a torch built with CUDA nothing is loaded: its own guard serves fake CUDA tensors.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

SOURCE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc", "fake_cuda",
                      "fake_cuda.cpp")
ENV_FLAG = "MEGAZERO_FAKE_CUDA"


class FakeCudaError(RuntimeError):
    """The fake CUDA runtime could not be built or loaded."""


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise FakeCudaError("torch is not installed")
    return spec.submodule_search_locations[0]


def _torch_has_cuda(torch_dir: str) -> bool:
    """Whether this torch was built with CUDA (read from torch/version.py, no import)."""
    with open(os.path.join(torch_dir, "version.py")) as f:
        for line in f:
            if line.startswith("cuda"):
                return "None" not in line
    return False


def library_path() -> str:
    """The compiled library for this torch (built on first use)."""
    torch_dir = _torch_dir()
    source = os.path.abspath(SOURCE)
    if not os.path.exists(source):
        raise FakeCudaError(f"missing {source}: the dry run's fake CUDA runtime source")
    with open(source, "rb") as f:
        digest = hashlib.sha256(f.read() + torch_dir.encode()).hexdigest()[:16]
    cache = os.environ.get("MEGAZERO_CACHE") or os.path.expanduser("~/.cache/megazero")
    path = os.path.join(cache, f"fake_cuda-{digest}.so")
    if not os.path.exists(path):
        _compile(source, path, torch_dir)
    return path


def _compile(source: str, path: str, torch_dir: str) -> None:
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    cxx = cxx.split()[0]
    if shutil.which(cxx) is None:
        raise FakeCudaError(f"no C++ compiler ({cxx}) to build the fake CUDA runtime")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lib = os.path.join(torch_dir, "lib")
    tmp = f"{path}.tmp.{os.getpid()}"
    cmd = [cxx, "-O1", "-std=c++20", "-shared", "-fPIC", "-w",
           "-I", os.path.join(torch_dir, "include"), source, "-o", tmp,
           f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise FakeCudaError(f"building the fake CUDA runtime failed: {' '.join(cmd)}\n"
                            f"{done.stderr[-2000:]}")
    os.replace(tmp, path)


def active() -> bool:
    """Whether fake CUDA tensors can run autograd in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return torch.version.cuda is not None or (
        torch.accelerator.current_accelerator() is not None
        and torch.accelerator.current_accelerator().type == "cuda")


def load() -> bool:
    """Load the library into this process if torch is not imported yet; True on success."""
    torch_dir = _torch_dir()
    if _torch_has_cuda(torch_dir):
        return True
    if "torch" in sys.modules:
        return active()
    lib = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
    return bool(lib.megazero_fake_cuda_installed())


def reexec_with_fake_cuda() -> None:
    """Replace this process by the same command with the library preloaded (never returns)."""
    if os.environ.get(ENV_FLAG) == "1":
        raise FakeCudaError("the fake CUDA runtime was preloaded but CUDA is still not torch's "
                            "accelerator; is another accelerator backend registered?")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library_path(), env.get("LD_PRELOAD")) if p)
    env[ENV_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


def preload_env() -> dict:
    """Environment for a child process that will run a fake-CUDA dry run."""
    env = dict(os.environ)
    if not _torch_has_cuda(_torch_dir()):
        env["LD_PRELOAD"] = " ".join(p for p in (library_path(), env.get("LD_PRELOAD")) if p)
        env[ENV_FLAG] = "1"
    return env
