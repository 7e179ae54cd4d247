"""The scheduler process never loads torch: it moves token ids and bytes, and starts in a fraction of a second."""

from __future__ import annotations

import subprocess
import sys


def test_the_scheduler_process_imports_no_torch() -> None:
    code = (
        "import sys, scheduler.__main__, scheduler.service, scheduler.core; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout


_PROJECT = {
    "proto",
    "common",
    "modeling",
    "gpu_worker",
    "draft_service",
    "gateway",
    "scheduler",
    "specserve",
    "distill",
    "bench",
}


def _imported_roots(package: str) -> dict[str, set[str]]:
    """Each module file of `package` -> the top-level names it imports
    (absolute imports; the project uses no others)."""
    import ast
    from pathlib import Path

    found: dict[str, set[str]] = {}
    for path in sorted(Path(package).rglob("*.py")):
        roots: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
        found[str(path)] = roots
    return found


def test_the_packages_the_scheduler_may_import_hold_no_torch() -> None:
    """The boundary is the package: the scheduler imports only its own package, `common` and `proto`, and those
    import neither torch nor the model."""
    for path, roots in _imported_roots("scheduler").items():
        assert not (roots & _PROJECT) - {"scheduler", "common", "proto"}, (path, roots & _PROJECT)
    for package in ("common", "proto"):
        for path, roots in _imported_roots(package).items():
            assert not roots & {"torch", "modeling", "scheduler", "gateway", "gpu_worker", "draft_service"}, (
                path,
                roots,
            )
