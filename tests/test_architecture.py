"""Stages in tasks/ are plain functions: they never import Prefect, MLflow or the flows."""
import ast
from pathlib import Path

FORBIDDEN = ("prefect", "mlflow", "flows", "hydra")
HEAVY = ("tensorrt_rtx_bindings", "tensorrt", "torch")


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node


def test_tasks_never_import_orchestration_or_tracking():
    bad = [f"{p.name}: {mod}" for p in Path("tasks").glob("*.py") for mod, _ in _imports(p)
           if mod.split(".")[0] in FORBIDDEN]
    assert not bad, bad


def test_tensorrt_and_torch_are_imported_lazily():
    """No module-level import of TensorRT or torch anywhere in tasks/ or flows/ (they load inside the stages)."""
    bad = []
    for p in list(Path("tasks").glob("*.py")) + list(Path("flows").glob("*.py")):
        tree = ast.parse(p.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{p.name}: {n}" for n in names if n.split(".")[0] in HEAVY]
    assert not bad, bad


def test_importing_the_stages_loads_neither_tensorrt_nor_prefect():
    import subprocess
    import sys

    code = ("import sys, tasks.export, tasks.partition, tasks.build, tasks.validate, tasks.benchmark; "
            "print(sorted(m for m in ('prefect','mlflow','tensorrt_rtx_bindings','torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
