"""The architecture docs/ARCHITECTURE.md describes, checked on the code: who may import whom
(function-local imports count), no import cycles, the folder tree, and the one
parameter-metadata contract."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megazero"

# (modules under this prefix) may not import (these prefixes): DESIGN.md's dependency rules.
LOWER = ("megazero.model", "megazero.data", "megazero.tokenizer", "megazero.checkpoint",
         "megazero.training", "megazero.inference", "megazero.tools", "megazero.engine",
         "megazero.arguments", "megazero.dryrun")
FORBIDDEN = {
    "megazero.config": ("megazero.",),
    "megazero.ops": tuple(f"megazero.{p}" for p in (
        "config", "distributed", "tensor_parallel", "pipeline_parallel", "data_parallel",
        "optim", "model", "data", "tokenizer", "checkpoint", "training", "inference", "tools",
        "engine", "arguments", "dryrun")),
    "megazero.distributed": ("megazero.tensor_parallel", "megazero.pipeline_parallel",
                             "megazero.data_parallel", "megazero.optim", "megazero.ops",
                             *LOWER),
    # the layers never import the model (a user takes tensor_parallel alone into a model)
    "megazero.tensor_parallel": ("megazero.pipeline_parallel", "megazero.data_parallel",
                                 "megazero.optim", *LOWER),
    # the schedules never import the model
    "megazero.pipeline_parallel": ("megazero.data_parallel", "megazero.optim", *LOWER),
    # the optimizer never imports the model
    "megazero.data_parallel": ("megazero.pipeline_parallel", *LOWER),
    "megazero.optim": ("megazero.tensor_parallel", "megazero.pipeline_parallel",
                       "megazero.data_parallel", *LOWER),
    "megazero.model": ("megazero.pipeline_parallel", "megazero.data_parallel",
                       "megazero.optim", "megazero.data", "megazero.tokenizer",
                       "megazero.checkpoint", "megazero.training", "megazero.inference",
                       "megazero.tools", "megazero.engine", "megazero.arguments",
                       "megazero.dryrun"),
    # data and tokenizers know parallelism only as integers passed in
    "megazero.data": ("megazero.distributed", "megazero.tensor_parallel",
                      "megazero.pipeline_parallel", "megazero.data_parallel", "megazero.optim",
                      "megazero.model", "megazero.checkpoint", "megazero.training",
                      "megazero.inference", "megazero.tools", "megazero.engine",
                      "megazero.dryrun"),
    "megazero.tokenizer": ("megazero.distributed", "megazero.tensor_parallel",
                           "megazero.pipeline_parallel", "megazero.data_parallel",
                           "megazero.optim", "megazero.model", "megazero.data",
                           "megazero.checkpoint", "megazero.training", "megazero.inference",
                           "megazero.tools", "megazero.engine", "megazero.dryrun"),
    # checkpoints reach the optimizer through its methods, never its classes
    "megazero.checkpoint": ("megazero.pipeline_parallel", "megazero.data_parallel",
                            "megazero.optim", "megazero.model", "megazero.data",
                            "megazero.tokenizer", "megazero.training", "megazero.inference",
                            "megazero.tools", "megazero.engine", "megazero.dryrun"),
}
OLD_PARAM_ATTRIBUTES = ("mz_init", "mz_shard", "mz_name", "mz_local_shape", "mz_on_meta",
                        "_mz_zero3", "tensor_model_parallel", "partition_stride")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, modules) -> list[tuple[str, int, bool]]:
    """(imported megazero module, line, inside a function) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = pkg.split(".")[:len(pkg.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in child.names]
            for t in targets:
                if t.startswith("megazero"):
                    out.append((t, child.lineno, inner))
            visit(child, inner)

    visit(tree, False)
    return out


@pytest.fixture(scope="module")
def graph():
    modules = package_modules()
    return modules, {m: imports_of(m, p, modules) for m, p in modules.items()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_import_rules(graph):
    _, edges = graph
    broken = []
    for mod, targets in edges.items():
        for prefix, forbidden in FORBIDDEN.items():
            if not _under(mod, prefix):
                continue
            for target, line, _ in targets:
                if _under(target, prefix):
                    continue
                if any(_under(target, f.rstrip(".")) or (f.endswith(".") and
                       target.startswith(f)) for f in forbidden):
                    broken.append(f"{mod}:{line} imports {target}")
    assert not broken, "imports against docs/ARCHITECTURE.md:\n" + "\n".join(broken)


def test_nothing_imports_the_planner(graph):
    """``megazero.plan`` is a tool over the whole package: nothing in megazero imports it."""
    _, edges = graph
    broken = [f"{mod}:{line} imports {target}" for mod, targets in edges.items()
              if not _under(mod, "megazero.plan")
              for target, line, _ in targets if _under(target, "megazero.plan")]
    assert not broken, "\n".join(broken)


def test_no_import_cycles(graph):
    modules, edges = graph
    adj = {m: {t for t, _, _ in targets if t in modules and t != m
               and not m.startswith(t + ".")} for m, targets in edges.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_function_local_imports_of_megazero(graph):
    """A lazy import hides a circle; only optional dependencies may be imported late."""
    _, edges = graph
    local = [f"{m}:{line} imports {t}" for m, targets in edges.items()
             for t, line, inner in targets if inner and m != "megazero"]
    assert not local, "\n".join(local)


def documented_tree() -> dict[str, set[str]]:
    """Folder -> .py files, from the tree block of docs/ARCHITECTURE.md."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text.split("```text\nmegazero/\n", 1)[1].split("```", 1)[0]
    tree: dict[str, set[str]] = {"": set()}
    for line in block.splitlines():
        m = re.match(r"^  (\w+\.py)\b", line)
        if m:
            tree[""].add(m.group(1))
            continue
        m = re.match(r"^  (\w+)/\s+(.*)$", line)
        if m:
            tree[m.group(1)] = set(re.findall(r"\b(\w+\.py)\b", m.group(2)))
            continue
        m = re.match(r"^\s{16,}(.*)$", line)  # continuation of the previous folder's files
        if m and len(tree) > 1:
            tree[list(tree)[-1]] |= set(re.findall(r"\b(\w+\.py)\b", m.group(1)))
    return tree


def test_folder_tree_matches_the_architecture_doc():
    actual: dict[str, set[str]] = {"": {p.name for p in PACKAGE.glob("*.py")}}
    for folder in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and
                         not p.name.startswith(("_", "."))):
        actual[folder.name] = {p.name for p in folder.glob("*.py")}
    assert actual[""] == {"__init__.py", "arguments.py", "arguments_compat.py",
                          "arguments_model.py", "arguments_optim.py", "arguments_run.py",
                          "arguments_train.py", "engine.py"}
    assert documented_tree() == actual


def test_parameter_metadata_only_through_the_contract():
    hits = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for attr in OLD_PARAM_ATTRIBUTES:
            for m in re.finditer(rf"\b{attr}\b", text):
                line = text[:m.start()].count("\n") + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {attr}")
    assert not hits, "\n".join(hits)
