"""Build megazero: the Python package plus optional compiled kernels.

Every folder of ``csrc/`` that holds ``.cpp`` files becomes one plain pybind11 extension,
``megazero.ops._<folder>`` (no libtorch link, so it survives torch upgrades). A folder's
``*_simd.cpp`` (its vector kernels) is compiled once per SIMD level (SIMD_LEVEL_FLAGS: scalar,
AVX2+FMA, AVX-512, AVX-512+BF16; scalar only off x86-64) and the level is picked at run time,
so one build serves every x86 CPU; its other ``.cpp`` files (the bindings) once, baseline ISA.

Environment knobs:
  MEGAZERO_BUILD_OPS=0    build no extension at all (pure PyTorch reference paths are used).
  MEGAZERO_BUILD_ONLY=a,b build only these csrc/ folders (quick rebuilds while developing).
  MEGAZERO_BUILD_CUDA=0/1 the CUDA kernels (``csrc/<folder>/*.cu`` + ``*_cuda.cc`` ->
                          ``megazero.ops._<folder>_cuda``), built with torch's extension builder;
                          needs a CUDA torch in the build environment, so install with
                          ``pip install --no-build-isolation -e .``. Default: on when torch is a
                          CUDA build matching nvcc's major version and a GPU is visible (or
                          TORCH_CUDA_ARCH_LIST names the targets), else off with the reason.
A failing extension build never fails the install: it is reported and skipped, and
``python -m megazero.ops`` says which ops are built and why any is missing.
"""

import os
import platform
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.modified import newer_group
except ImportError:  # setuptools < 69
    from distutils.dep_util import newer_group

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"

# Compiler flags of each SIMD level; csrc/include/megazero/simd.h checks them against MZ_ISA.
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
SIMD_LEVEL_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": _AVX512,
    "avx512bf16": [*_AVX512, "-mavx512bf16"],
}


# csrc/ folders that are no extension of their own: compiled when needed, at run time
RUN_TIME_COMPILED = {"fake_cuda"}  # megazero.dryrun.fake_cuda, for a CPU-only torch's dry run


def _env_flag(name, default):
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


def _kernel_folders():
    """The folders of csrc/ to build (all, or those named by MEGAZERO_BUILD_ONLY)."""
    if not CSRC.is_dir():
        return []
    only = {v.strip() for v in os.environ.get("MEGAZERO_BUILD_ONLY", "").split(",") if v.strip()}
    return [p for p in sorted(CSRC.iterdir()) if p.is_dir() and (not only or p.name in only)]


def _relative(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


def cpu_extensions():
    from pybind11.setup_helpers import Pybind11Extension

    is_x86 = platform.machine().lower() in ("x86_64", "amd64")
    exts = []
    for folder in _kernel_folders():
        if folder.name in RUN_TIME_COMPILED:
            continue
        simd_sources = _relative(folder.glob("*_simd.cpp"))
        sources = [s for s in _relative(folder.glob("*.cpp")) if s not in simd_sources]
        if not sources:
            continue
        # No FMA contraction: every SIMD level rounds each + - * / like the PyTorch references.
        compile_args = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c++17"]
        if is_x86:
            # Baseline ISA; the *_simd.cpp objects add their level's flags (SIMD_LEVEL_FLAGS).
            compile_args.append("-mtune=generic")
        # headers as dependencies, so editing one rebuilds the extension
        headers = _relative(h for d in (folder, CSRC / "include") for h in d.rglob("*.h"))
        ext = Pybind11Extension(
            f"megazero.ops._{folder.name}",
            sources,
            depends=headers + simd_sources,
            include_dirs=[str(CSRC), str(CSRC / "include")],
            extra_compile_args=compile_args,
            extra_link_args=["-fopenmp"],
            cxx_std=17,
        )
        ext.simd_sources = simd_sources
        ext.simd_levels = list(SIMD_LEVEL_FLAGS) if is_x86 else ["scalar"]
        exts.append(ext)
    return exts


def _nvcc_major(cuda_home):
    """Major CUDA version of ``cuda_home``'s nvcc, or None when it cannot be run."""
    import re
    import subprocess

    try:
        out = subprocess.check_output([os.path.join(cuda_home, "bin", "nvcc"), "--version"],
                                      text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def _cuda_skip_reason(torch, cuda_home):
    """Why the CUDA kernels cannot be built here (None: they can)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not cuda_home:
        return "nvcc/CUDA_HOME not found"
    nvcc = _nvcc_major(cuda_home)
    if nvcc is None:
        return f"cannot run {cuda_home}/bin/nvcc"
    if nvcc != int(torch.version.cuda.split(".")[0]):
        # torch's builder refuses a major-version mismatch (and would abort the whole build)
        return f"nvcc is CUDA {nvcc} but torch was built with CUDA {torch.version.cuda}"
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # without a GPU torch cannot pick the target architectures by itself
        return "no GPU visible and TORCH_CUDA_ARCH_LIST unset"
    return None


def cuda_extensions():
    """CUDA kernels: ``csrc/<folder>/*.cu`` (+ ``*_cuda.cc`` bindings) -> ``_<folder>_cuda``.

    Built by default only with a CUDA torch whose CUDA major version matches nvcc's and a GPU
    (or TORCH_CUDA_ARCH_LIST naming the targets); MEGAZERO_BUILD_CUDA=0 turns them off and
    =1 asks for them (still skipped, with the reason, when the build cannot work).
    """
    wanted = _env_flag("MEGAZERO_BUILD_CUDA", None)
    if wanted is False or not CSRC.is_dir():
        return [], None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as exc:  # noqa: BLE001 - no torch in an isolated build env
        print(f"megazero: CUDA kernels skipped (torch not importable at build time: {exc}; "
              "use pip install --no-build-isolation)")
        return [], None
    reason = _cuda_skip_reason(torch, CUDA_HOME)
    if reason:
        print(f"megazero: CUDA kernels skipped ({reason})")
        return [], None

    exts = []
    for folder in _kernel_folders():
        sources = _relative(folder.glob("*.cu"))
        if not sources:
            continue
        sources += _relative(folder.glob("*_cuda.cc"))
        exts.append(
            CUDAExtension(
                f"megazero.ops._{folder.name}_cuda",
                sources,
                include_dirs=[str(CSRC), str(CSRC / "include")],
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]},
            )
        )
    return exts, BuildExtension


class SimdObjects:
    """build_ext mixin: compiles an extension's ``simd_sources`` once per SIMD level (that
    level's flags and ``-DMZ_ISA=<level>``, one object folder per level) and links them in;
    a setuptools Extension compiles each source once with one set of flags."""

    def build_extension(self, ext):
        simd_sources = getattr(ext, "simd_sources", [])
        if simd_sources and (self.force or newer_group(
                ext.sources + ext.depends, self.get_ext_fullpath(ext.name), "newer")):
            ext.extra_objects = [obj for level in ext.simd_levels
                                 for obj in self._compile_level(ext, level)]
        super().build_extension(ext)

    def _compile_level(self, ext, level):
        return self.compiler.compile(
            ext.simd_sources, output_dir=os.path.join(self.build_temp, "simd", level),
            macros=[*ext.define_macros, ("MZ_ISA", level)], include_dirs=ext.include_dirs,
            debug=self.debug, extra_postargs=[*ext.extra_compile_args, *SIMD_LEVEL_FLAGS[level]],
            depends=ext.depends)


def _report(msg):
    sys.stderr.write(f"megazero: WARNING: {msg}\n")


class OptionalExtensions(SimdObjects):
    """build_ext mixin: build each extension on its own; a failure is reported, never fatal,
    and the extensions that did build are still copied in place (editable installs)."""

    failed: frozenset = frozenset()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self.failed = self.failed | {ext.name}
            _report(f"{ext.name} not built ({type(exc).__name__}: {exc}); "
                    "the PyTorch reference path will be used")

    def copy_extensions_to_source(self):
        every = self.extensions
        self.extensions = [e for e in every if e.name not in self.failed]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every


class OptionalBuildExt(OptionalExtensions, build_ext):
    """setuptools' build_ext with SIMD objects and optional extensions."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001
            _report(f"extension build step failed: {exc}")


def make_build_ext(base):
    if base is None:
        return OptionalBuildExt

    class OptionalTorchBuildExt(OptionalExtensions, base):
        """torch's BuildExtension (needed for .cu), with every failure reported, not fatal."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - e.g. a compiler/CUDA version check
                _report(f"torch extension builder failed ({exc}); "
                        "building the CPU kernels without it")
                self.extensions = [e for e in self.extensions if not e.name.endswith("_cuda")]
                build_ext.build_extensions(self)

    return OptionalTorchBuildExt


ext_modules = []
build_ext_cls = OptionalBuildExt
if _env_flag("MEGAZERO_BUILD_OPS", True):
    ext_modules = cpu_extensions()
    cuda_exts, torch_build_ext = cuda_extensions()
    if cuda_exts:
        ext_modules += cuda_exts
        build_ext_cls = make_build_ext(torch_build_ext)

setup(
    name="megazero",
    version="0.1.0",
    description="Megatron-style 3D parallelism (tensor, pipeline, ZeRO data) for GPT-2 pretraining",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8")
    if (ROOT / "README.md").exists()
    else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megazero", "megazero.*"]),
    install_requires=["torch>=2.3", "numpy", "regex", "sentencepiece"],
    extras_require={
        # transformers: tests/test_hf.py loads the HF export in GPT2LMHeadModel (it has no
        # torch requirement of its own, so the pinned CPU build stays)
        "test": ["pytest>=7", "pytest-timeout", "ruff", "matplotlib", "safetensors",
                 "tensorboard", "wandb", "transformers>=4.40"],
        "wandb": ["wandb"],
        "plot": ["matplotlib"],
        "hf": ["safetensors"],
        # benchmarks/bench_megatron.py's peer (pins the last release reachable here)
        "bench": ["megatron-core==0.16.1"],
        # tests/test_megatron_checkpoint.py's peer: Megatron-core's GPTModel on CPU, loading
        # and saving Megatron-LM checkpoints next to megazero's (skipped without it). Pure
        # Python; install it without its dependencies so pip leaves the torch build alone:
        #     pip install --no-deps "megatron-core==0.16.1"
        # (``pip install -e .[megatron]`` also works where the installed torch is >= 2.6)
        "megatron": ["megatron-core==0.16.1"],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext_cls},
    zip_safe=False,
)
