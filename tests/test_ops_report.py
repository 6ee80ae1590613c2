"""``python -m megazero.ops``: the ops report and the registry it reads."""

import json
import os
import subprocess
import sys

from megazero.ops import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MY_OPS = {"cpu_adam", "fused_adam_step", "grad_norm_sq", "cpu_lamb", "fused_lamb_stages"}
MY_MODULES = {"megazero.ops.cpu_adam", "megazero.ops.fused_step", "megazero.ops.cpu_lamb"}


def run_report(*args, **env):
    full_env = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-m", "megazero.ops", *args], cwd=ROOT, env=full_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_report_lists_every_registered_op():
    text = run_report()
    assert "megazero ops report" in text and "torch" in text
    for name in MY_OPS:
        assert name in text
    info = json.loads(run_report("--json"))
    names = {op["name"] for op in info["ops"]}
    assert MY_OPS <= names
    assert MY_MODULES <= set(registry.OP_MODULES)
    assert not MY_MODULES & set(info["import_errors"])
    for op in info["ops"]:
        assert op["built"] or op["reason"]
    assert info["default_update"].startswith("AdamW: megazero's") and "default update" in text


def test_report_says_why_an_op_is_missing():
    info = json.loads(run_report("--json", MEGAZERO_DISABLE_OPS="adam,lamb"))
    mine = [op for op in info["ops"] if op["name"] in MY_OPS]
    assert mine and all(not op["built"] and "MEGAZERO_DISABLE_OPS" in op["reason"]
                        for op in mine)
    assert "PyTorch reference" in info["default_update"]


def test_registry_register_and_status():
    registry.import_op_modules()
    assert MY_OPS <= {spec.name for spec in registry.registered_ops()}
    registry.register_op("test_missing_op", "no_such_ext_for_test", "a test entry")
    try:
        status = registry.op_status(registry._REGISTRY["test_missing_op"])
        assert status["built"] is False and status["reason"]
        errors = registry.import_op_modules(("megazero.ops.no_such_module",))
        assert "megazero.ops.no_such_module" in errors
    finally:
        registry._REGISTRY.pop("test_missing_op")


def test_every_cpu_kernel_the_readme_promises_is_built_on_x86_64():
    """CI on x86-64 builds every CPU extension (`pip install -e .`): a missing build fails
    here instead of letting the kernel tests skip. Opting out is explicit: the build and
    run-time switches of README's Kernels section."""
    import platform

    import pytest

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the CPU kernels are promised on x86-64 (this is {platform.machine()})")
    for var in ("MEGAZERO_BUILD_OPS", "MEGAZERO_BUILD_ONLY", "MEGAZERO_DISABLE_OPS"):
        if os.environ.get(var):
            pytest.skip(f"{var}={os.environ[var]} opts out of building or using kernels")
    info = json.loads(run_report("--json"))
    missing = [f"{op['name']} ({op['reason']})" for op in info["ops"]
               if not op["name"].startswith("cuda_") and not op["built"]]
    assert not missing, "CPU kernels not built: " + "; ".join(missing)
    from megazero.ops import _data  # noqa: F401  (the data pipeline's helpers)
