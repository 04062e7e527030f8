"""The package layout of DESIGN.md §1, checked: imports go one way only, the wire layer imports only
the engine's sampling params, nothing imports ``bench``, the router and the HTTP layer load no torch,
and no module cycles.

Imports are read from the source (every ``import``, including those inside functions and under
``TYPE_CHECKING``), so a lazy import cannot hide an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages of ours it may import (DESIGN.md §1; the data flows cli -> deploy -> ingress
# -> router -> workers -> worker -> engine, kv_transfer, registry -> proto).
ALLOWED = {
    "settings": set(),
    "engine": set(),
    "loadgen": {"settings"},
    "proto": {"engine"},
    "kv_transfer": {"engine"},
    "registry": {"proto", "engine", "settings"},
    "worker": {"engine", "kv_transfer", "proto", "registry", "settings"},
    "prefill_worker": {"worker", "engine", "kv_transfer", "proto", "registry", "settings"},
    "decode_worker": {"worker", "engine", "kv_transfer", "proto", "registry", "settings"},
    "router": {"proto", "registry", "engine", "settings"},
    "ingress": {"router", "proto", "engine", "settings"},
    "planner": {"router", "registry", "engine", "kv_transfer", "proto", "settings"},
    "deploy": {
        "ingress",
        "router",
        "prefill_worker",
        "decode_worker",
        "worker",
        "engine",
        "kv_transfer",
        "registry",
        "proto",
        "settings",
    },
    "cli": {
        "deploy",
        "ingress",
        "router",
        "prefill_worker",
        "decode_worker",
        "worker",
        "engine",
        "kv_transfer",
        "registry",
        "proto",
        "settings",
        "loadgen",
        "planner",
    },
}
# Torch-free modules of the engine that the light layers may use.
TORCH_FREE_ENGINE = {
    "engine.sampling_params",
    "engine.block_hash",
    "engine.detokenizer",
    "engine.bad_words",
    "engine.chat_format",  # chat messages as templates take them (LLM.chat and the HTTP API)
    "engine.json_schema_support",  # (through sampling_params)
    "engine.model_names",  # imports the zero-cost model (torch) only to create its checkpoint
}
LIGHT = {"proto", "registry", "router", "ingress"}
PACKAGES = set(ALLOWED) | {"bench"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts).removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in PACKAGES and (m := _resolve(name)) is not None:
                found.add(m)
    return found


EDGES = {mod: _imports(path) - {mod} for mod, path in MODULES.items()}


def test_packages_import_only_what_the_layout_allows():
    bad = []
    for mod, targets in EDGES.items():
        pkg = mod.split(".")[0]
        if pkg == "bench":
            continue  # benchmarks may use everything
        for t in targets:
            tpkg = t.split(".")[0]
            if tpkg != pkg and tpkg not in ALLOWED[pkg]:
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports against the layout:\n" + "\n".join(sorted(bad))


def test_nothing_imports_bench():
    bad = [
        f"{m} -> {t}"
        for m, ts in EDGES.items()
        if not m.startswith("bench")
        for t in ts
        if t.startswith("bench")
    ]
    assert not bad, bad


def test_light_layers_use_only_torch_free_engine_modules():
    """proto: only the sampling params (the wire's value types); registry, router, ingress: the
    torch-free value types and hashing."""
    bad = []
    for mod, targets in EDGES.items():
        pkg = mod.split(".")[0]
        if pkg not in LIGHT:
            continue
        allowed = {"engine.sampling_params"} if pkg == "proto" else TORCH_FREE_ENGINE
        bad += [f"{mod} -> {t}" for t in targets if t.startswith("engine") and t not in allowed]
    assert not bad, bad


def test_no_module_cycles():
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(EDGES.get(u, ())):
            if state.get(v) == 1:
                cycles.append([*stack[stack.index(v) :], v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for u in sorted(EDGES):
        if u not in state:
            visit(u, [])
    assert not cycles, [" -> ".join(c) for c in cycles]


@pytest.mark.parametrize(
    "modules",
    [
        "router.router router.service router.policies router.client router.__main__",
        "registry.cluster_view registry.publisher registry.schema registry.prefix_index",
        "ingress.http_app ingress.openai_serving ingress.generation ingress.metrics",
        "proto.convert",
    ],
)
def test_light_layers_load_no_torch(modules: str):
    """Importing them (in a fresh interpreter) pulls in neither torch nor Ray."""
    code = (
        f"import sys\nfor m in {modules.split()!r}: __import__(m)\n"
        "heavy = sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'ray', 'triton', 'nixl'})\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{modules} imported {out.stdout.strip()}"


def test_environment_is_read_in_one_module():
    """Every environment variable is read through settings.environment (STYLE.md: no hidden globals)."""
    readers = sorted(
        str(path.relative_to(ROOT))
        for mod, path in MODULES.items()
        if not mod.startswith(("settings", "bench"))
        and any(s in path.read_text() for s in ("os.environ", "os.getenv", "getenv("))
    )
    assert readers == [], readers


def test_modules_stay_small():
    """STYLE.md: a file of code under about 400 lines (the same 450-line bound as DESIGN.md's import
    map; generated protobuf code excepted)."""
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := p.read_text().count("\n")) > 450}
    assert not big, big


def test_every_package_is_installed_and_shipped_in_the_image():
    """A new top-level package must be in pyproject's package list and copied by the Dockerfile."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = {p.rstrip("*") for p in include["include"]}
    copied = {
        line.split()[-1]
        for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY") and "pyproject" not in line
    }
    assert installed >= PACKAGES, PACKAGES - installed
    assert copied >= PACKAGES, PACKAGES - copied


def test_the_image_pins_a_cuda_torch_before_installing_pdserve_and_sends_no_local_venv():
    """Ray's CUDA images carry no torch: without its own install, ``pip install -e .`` would take
    PyPI's default build. The local .venv (GBs) stays out of the build context."""
    lines = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    torch = next(i for i, line in enumerate(lines) if line.startswith("RUN") and '"torch==' in line)
    pdserve = next(i for i, line in enumerate(lines) if line.startswith("RUN") and "-e ." in line)
    assert torch < pdserve and "--index-url" in lines[torch]
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert {".venv", ".git"} <= set(ignored)


def test_the_scripts_run_what_setup_installed_where_pdserve_venv_says():
    """setup.sh installs into ``PDSERVE_VENV`` (default .venv): run.sh and test.sh use that one too."""
    for name in ("run.sh", "test.sh"):
        text = (ROOT / "scripts" / name).read_text()
        assert "VENV=${PDSERVE_VENV:-.venv}" in text and ".venv/bin" not in text, name


def test_test_module_names_are_unique():
    """tests/ has no packages: pytest imports test modules by basename, so two alike break collection."""
    from collections import Counter

    names = Counter(p.name for p in (ROOT / "tests").rglob("*.py") if p.name != "conftest.py")
    assert [n for n, c in names.items() if c > 1] == []
