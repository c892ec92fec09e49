"""The shape of the code: stages in tasks/ are plain functions (no Prefect, MLflow, Hydra or flows), TensorRT and torch
load lazily, the import-linter contracts in pyproject.toml hold, and no module cycle hides behind a function-local
import. Files are found from this file, not the working directory."""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("prefect", "mlflow", "flows", "hydra")
HEAVY = ("tensorrt_rtx_bindings", "tensorrt", "torch")


def modules(package: str) -> list[Path]:
    """The package's modules, its subpackages' too (flows/local/)."""
    files = sorted((REPO / package).rglob("*.py"))
    assert len(files) > 5, f"no modules found under {REPO / package}"
    return files


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imports(path: Path):
    """(imported module, node) for every import in the file, at any depth; relative imports resolved."""
    pkg = module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                yield (f"{pkg}.{node.module}" if node.module else pkg), node
            elif node.module:
                yield node.module, node


def test_tasks_never_import_orchestration_or_tracking():
    bad = [f"{p.name}: {mod}" for p in modules("tasks") for mod, _ in _imports(p) if mod.split(".")[0] in FORBIDDEN]
    assert not bad, bad


def test_tensorrt_and_torch_are_imported_lazily():
    """No module-level import of TensorRT or torch anywhere in tasks/ or flows/ (they load inside the stages)."""
    bad = []
    for p in modules("tasks") + modules("flows"):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{p.name}: {n}" for n in names if n.split(".")[0] in HEAVY]
    assert not bad, bad


def test_no_import_cycle_between_project_modules():
    """Counting imports inside functions too: a cycle dodged by a function-local import is still a cycle."""
    graph: dict[str, set[str]] = {}
    for p in modules("tasks") + modules("flows"):
        me = module_name(p)
        deps = set()
        for mod, node in _imports(p):
            if mod.split(".")[0] in ("tasks", "flows"):
                if isinstance(node, ast.ImportFrom) and mod in ("tasks", "flows", "flows.local"):  # from tasks.trt import backend as backend
                    deps |= {f"{mod}.{a.name}" for a in node.names}
                else:
                    deps.add(mod)
        graph[me] = {d for d in deps if d != me}
    cycles, state = [], {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(path[path.index(m):] + [m] if m in path else [n, m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_import_linter_contracts_hold():
    """The contracts in pyproject.toml (tasks never import Prefect/MLflow/Hydra/flows; flows over tasks), run by CI."""
    exe = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_importing_the_stages_loads_neither_tensorrt_nor_prefect():
    code = ("import sys, tasks.sources.export, tasks.partition.partition, tasks.engines.build, tasks.evaluate.validate, tasks.evaluate.benchmark, tasks.quantization.calibrate; "
            "print(sorted(m for m in ('prefect','mlflow','tensorrt_rtx_bindings','torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    assert out == "[]"
