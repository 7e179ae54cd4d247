"""The shape of the source tree, as a successor relies on it: no import circles, modules of a readable size, one place
where the scheduler places and dispatches, and docs that name only files, flags and symbols that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
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
)
# Exempt from the size rule: the wire messages (one Struct per message, read as a table), generated code, and the
# kernels (their loader, packing and block formats sit beside the C++ they drive).
LONG_ALLOWED = ("proto/messages.py", "proto/specserve_pb2.py", "proto/specserve_pb2_grpc.py", "modeling/kernels/")
MAX_LINES, MAX_SCHEDULER_LINES = 400, 300
# README and every page of docs/ but the figures (whose commands name other tools' flags by the dozen).
DOCS = (
    "README.md",
    *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md") if path.name != "benchmarks.md"),
)
# What the front docs name that is not this project's: other tools' flags, a gRPC method, a placeholder folder.
NOT_OURS = {
    "--help",
    "--index-url",
    "--cpus",
    "--cpuset-cpus",
    "--profile",
    "--build-arg",
    "--bridge",
    "--iptables",
    "grpc.health.v1.Health/Check",
    "OUT/training/",
    "./NAME",
    "DIR/N.lock",
    "authorized/worker/",
    "_WORKER_PORT",
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules a file imports, at any depth, except under `if TYPE_CHECKING:` (no import at run time)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in known}


def test_no_module_imports_itself_through_others() -> None:
    known = _modules()
    graph = {name: _imports(path, known) - {name} for name, path in known.items()}
    circles: list[list[str]] = []
    for start in graph:  # a path back to `start`, depth first
        stack, seen = [(start, [start])], {start}
        while stack:
            name, path = stack.pop()
            for next_name in graph[name]:
                if next_name == start:
                    circles.append(path)
                elif next_name not in seen:
                    seen.add(next_name)
                    stack.append((next_name, [*path, next_name]))
    assert not circles, circles[:3]


def test_modules_are_of_a_readable_size() -> None:
    too_long = {}
    for path in _modules().values():
        relative = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        limit = MAX_SCHEDULER_LINES if relative.startswith("scheduler/") else MAX_LINES
        if not relative.startswith(LONG_ALLOWED) and lines > limit:
            too_long[relative] = lines
    assert not too_long, too_long


def test_the_scheduler_places_and_dispatches_in_one_place() -> None:
    calls = {"place_waiting": [], "dispatch": []}  # type: dict[str, list[str]]
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls:
                calls[node.func.attr].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(calls["place_waiting"]) == len(calls["dispatch"]) == 1, calls
    assert calls["place_waiting"][0].split(":")[0] == calls["dispatch"][0].split(":")[0] == "scheduler/stepping.py"


def _named(doc: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", doc)


def _source_text() -> str:
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    files += [ROOT / "proto" / "specserve.proto", *sorted((ROOT / "tests").rglob("*.py"))]
    files += sorted((ROOT / "modeling" / "kernels" / "csrc").glob("*.[ch]*"))
    return "\n".join(path.read_text() for path in files)


def _tree_paths() -> set[str]:
    """Every file and folder of the tree, relative to the root, folders ending in /."""
    paths: set[str] = set()
    for path in ROOT.rglob("*"):
        if not {".git", ".venv", "__pycache__", ".mypy_cache", ".hypothesis"} & set(path.parts):
            paths.add(str(path.relative_to(ROOT)) + ("/" if path.is_dir() else ""))
    return paths


def _exists(name: str, paths: set[str]) -> bool:
    """A file or folder named from the root, from docs/, or (in a layout table) from within its package."""
    name = name.rstrip("/")
    return any(path.rstrip("/") in (name, "docs/" + name) or path.rstrip("/").endswith("/" + name) for path in paths)


def test_the_docs_name_only_files_flags_and_symbols_that_exist() -> None:
    source = _source_text()
    paths = _tree_paths()
    flags = set(re.findall(r"""["'](--[a-z0-9][a-z0-9-]*)["']""", source))
    missing: list[str] = []
    for doc in DOCS:
        for name in _named((ROOT / doc).read_text()):
            name = name.strip()
            if (
                re.fullmatch(r"[\w./-]+/[\w./-]*|[\w/-]+\.(py|md|yml|toml|proto|cpp|h|sh)", name)
                and not name.startswith(("http", "/", "~"))
                and "<" not in name
            ):
                if name not in NOT_OURS and not _exists(name, paths):
                    missing.append(f"{doc}: file {name}")
            for flag in re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", name):
                if flag not in flags | NOT_OURS and "--" + flag.removeprefix("--no-") not in flags:
                    missing.append(f"{doc}: flag {flag}")
            if re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+(\(\))?", name) and not re.search(
                r"\.(py|md|json)$", name
            ):
                symbol = name.removesuffix("()").split(".")[-1]
                if not re.search(rf"\b{re.escape(symbol)}\b", source):
                    missing.append(f"{doc}: symbol {name}")
            elif re.fullmatch(r"_?[A-Z][a-z]+[A-Z]\w*|_\w+|\w+_\w+\(\)", name):
                if not re.search(rf"\b{re.escape(name.removesuffix('()'))}\b", source):
                    missing.append(f"{doc}: symbol {name}")
    assert not missing, missing
