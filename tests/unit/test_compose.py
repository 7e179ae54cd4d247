"""docker-compose.yml: valid for a real compose parser, and every command is one the CLI accepts."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

import draft_service.config
import gateway.config
import gpu_worker.config
import scheduler.config
from common.draft_spec import DraftKind, DraftSpec
from specserve.cli import _build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resolved() -> dict:  # type: ignore[type-arg]
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose (Debian package) is needed to parse the compose file; `make setup` installs it"
    out = subprocess.run([compose, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True, check=True)
    config: dict = yaml.safe_load(out.stdout)  # type: ignore[type-arg]
    return config


def _service_parser(name: str) -> argparse.ArgumentParser:
    parsers = {"scheduler": scheduler.config.add_arguments, "worker": gpu_worker.config.add_arguments,
               "draft": draft_service.config.add_arguments}
    if name == "gateway":
        return gateway.config.build_parser()
    parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
    parsers[name](parser)
    return parser


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the keys service makes in the `keys` volume, for the commands that read /keys."""
    folder = tmp_path_factory.mktemp("volume") / "keys"
    args = _build_parser().parse_args(["keys", str(folder)])
    assert args.run(args) == 0
    return folder


def _accepts(argv: list[str], keys: Path | None = None) -> None:
    """Parse argv as `specserve ARGV` would, without running anything; raises SystemExit if refused."""
    argv = [str(keys) if keys is not None and part == "/keys" else part for part in argv]
    if argv[0] == "scheduler":
        scheduler.config.from_arguments(_service_parser("scheduler").parse_args(argv[1:]))  # the keys are read here
    elif argv[0] in ("worker", "draft", "gateway"):
        parser = _service_parser(argv[0])
        args = parser.parse_args(argv[1:])
        if argv[0] == "draft":
            draft_service.config.from_arguments(args)  # the proposer spec is checked here
    else:
        _build_parser().parse_args(argv)


def test_every_service_command_and_health_check_is_accepted(resolved: dict, keys: Path) -> None:  # type: ignore[type-arg]
    services = resolved["services"]
    assert {"model-init", "keys", "scheduler", "draft", "gateway"} <= services.keys()
    assert any(name.startswith("gpu-worker") for name in services)
    for name, service in services.items():
        _accepts(service["command"], keys)
        if "healthcheck" in service:
            test = service["healthcheck"]["test"]
            assert test[:2] == ["CMD", "specserve"], name
            _accepts(test[2:])


def test_workers_reserve_a_gpu_and_follow_readiness(resolved: dict) -> None:  # type: ignore[type-arg]
    for name, service in resolved["services"].items():
        if not name.startswith("gpu-worker"):
            continue
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and len(devices[0]["device_ids"]) == 1
        assert "--status-file" in service["command"] and "healthcheck" in service
        assert service["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert resolved["services"]["gateway"]["healthcheck"]["test"][-2:] == ["--grpc", "127.0.0.1:50051"]


def test_every_service_on_the_sockets_reads_the_keys_made_before_it_starts(resolved: dict) -> None:  # type: ignore[type-arg]
    services = resolved["services"]
    assert services["keys"]["command"] == ["keys", "/keys"]
    for name, service in services.items():
        if service["command"][0] in ("scheduler", "worker", "draft", "gateway"):
            command = service["command"]
            assert command[command.index("--keys") + 1] == "/keys", name
            assert "--insecure-loopback" not in command, name
            assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
            assert any(str(volume).endswith(":/keys") or str(volume).endswith(":/keys:rw") for volume in service["volumes"]), name


def test_a_wrong_command_is_refused() -> None:
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        _accepts(["worker", "--model", "/models/m", "--no-such-flag"])


def test_the_image_holds_every_package_and_the_shipped_draft() -> None:
    """`pip install .` in the Dockerfile installs what pyproject lists; each of those must be copied in first."""
    root = ROOT
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    packages = [p.removesuffix("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    dockerfile = (root / "Dockerfile").read_text()
    for name in [*packages, "drafts"]:
        assert f"COPY {name} ./{name}" in dockerfile, f"the Dockerfile does not copy {name}/"
    on_disk = {p.parent.name for p in root.glob("*/__init__.py")} - {"tests", "bench"}
    assert on_disk <= set(packages), f"packages missing from pyproject: {on_disk - set(packages)}"


def test_the_draft_serves_the_phrases_shipped_in_the_image_for_the_workers_model(resolved: dict) -> None:  # type: ignore[type-arg]
    services = resolved["services"]
    draft, worker = services["draft"]["command"], services["gpu-worker-0"]["command"]
    proposer = DraftSpec.parse(draft[draft.index("--proposer") + 1], flag="--proposer")
    assert proposer.kind is DraftKind.PHRASES and proposer.path is not None
    path = proposer.path.relative_to("/app")  # the Dockerfile's WORKDIR and COPY
    assert path.parts[0] == "drafts" and "COPY drafts ./drafts" in (ROOT / "Dockerfile").read_text()
    assert (ROOT / path / "phrases.safetensors").is_file()
    assert draft[draft.index("--target-model") + 1] == worker[worker.index("--model") + 1]
    assert services["draft"]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
