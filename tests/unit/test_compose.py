"""docker-compose.yml: valid for a real compose parser, and every command is one the CLI accepts.

tests/compose runs it for real in Docker (`make test-compose`); these read what it says."""

from __future__ import annotations

import argparse
import os
import re
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
from common.defaults import MAX_MODEL_LEN
from common.draft_spec import DraftKind, DraftSpec
from common.lifecycle_process import EXIT_DISMISSED
from modeling.model.store import DEFAULT_MODEL_NAME, model_dir
from specserve.cli import _build_parser

ROOT = Path(__file__).resolve().parents[2]


def _resolve(**variables: str) -> dict:  # type: ignore[type-arg]
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose (Debian package) is needed to parse the compose file; `make setup` installs it"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECSERVE_")} | variables
    out = subprocess.run(
        [compose, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=ROOT,
    )
    config: dict = yaml.safe_load(out.stdout)  # type: ignore[type-arg]
    return config


@pytest.fixture(scope="module")
def resolved() -> dict:  # type: ignore[type-arg]
    """The file as compose reads it with no setting given."""
    return _resolve()


def _service_parser(name: str) -> argparse.ArgumentParser:
    parsers = {
        "scheduler": scheduler.config.add_arguments,
        "worker": gpu_worker.config.add_arguments,
        "draft": draft_service.config.add_arguments,
    }
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
    assert services.keys() == {"keys", "scheduler", "worker", "gpu-worker", "draft", "gateway"}
    for name, service in services.items():
        _accepts(service["command"], keys)
        if "healthcheck" in service:
            test = service["healthcheck"]["test"]
            assert test[:2] == ["CMD", "specserve"], name
            _accepts(test[2:])


def test_cpu_workers_by_default_and_a_gpu_profile_with_one_device_each(resolved: dict) -> None:  # type: ignore[type-arg]
    services = resolved["services"]
    assert "COMPOSE_PROFILES=cpu" in (ROOT / ".env").read_text().splitlines()
    cpu, gpu = services["worker"], services["gpu-worker"]
    assert (cpu["profiles"], gpu["profiles"]) == (["cpu"], ["gpu"])
    assert "deploy" not in cpu or "resources" not in cpu["deploy"]  # nothing reserved: it starts without a GPU
    assert cpu["command"][cpu["command"].index("--device") + 1] == "cpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    command = gpu["command"]
    assert command[command.index("--device") + 1] == "cuda:{slot}"  # narrows CUDA_VISIBLE_DEVICES to its own GPU
    for worker in (cpu, gpu):
        command = worker["command"]
        assert "{slot}" in command[command.index("--worker-id") + 1] and "--slot-dir" in command
        assert any(str(volume).startswith("slots:") for volume in worker["volumes"])
        assert "--status-file" in command and "healthcheck" in worker
        assert worker["depends_on"]["scheduler"]["condition"] == "service_healthy"
        assert worker["deploy"]["replicas"] == 1
    assert services["gateway"]["healthcheck"]["test"][2:] == [
        "healthcheck",
        "--ready",
        "127.0.0.1:8000",
        "--tls-certfile",
        "",
    ]


def test_tls_files_reach_the_gateway_and_its_health_check_asks_over_https(keys: Path) -> None:
    """Unset, the gateway serves plain TCP (its empty flags are no files); set, the folder is mounted where the files
    are named, and the health check speaks HTTPS."""
    plain = _service_parser("gateway").parse_args(
        [str(keys) if part == "/keys" else part for part in _resolve()["services"]["gateway"]["command"][1:]]
    )
    assert (plain.tls_certfile, plain.tls_keyfile, plain.tls_ca_certfile) == (None, None, None)
    gateway_service = _resolve(
        SPECSERVE_TLS_DIR="/srv/tls",
        SPECSERVE_TLS_CERTFILE="/tls/server.pem",
        SPECSERVE_TLS_KEYFILE="/tls/server.key",
        SPECSERVE_TLS_CA_CERTFILE="/tls/clients.pem",
    )["services"]["gateway"]
    args = _service_parser("gateway").parse_args(
        [str(keys) if part == "/keys" else part for part in gateway_service["command"][1:]]
    )
    assert (args.tls_certfile, args.tls_keyfile, args.tls_ca_certfile) == (
        Path("/tls/server.pem"),
        Path("/tls/server.key"),
        Path("/tls/clients.pem"),
    )
    assert "/srv/tls:/tls:ro" in gateway_service["volumes"]
    health = _build_parser().parse_args(gateway_service["healthcheck"]["test"][2:])
    assert (health.ready, health.tls_certfile) == ("127.0.0.1:8000", "/tls/server.pem")


def test_its_defaults_are_the_services_own(resolved: dict) -> None:  # type: ignore[type-arg]
    """The compose file repeats the shared defaults (common/defaults.py) as its variables' defaults: the same values."""
    for name in ("scheduler", "worker", "gpu-worker", "draft"):
        command = resolved["services"][name]["command"]
        assert command[command.index("--max-model-len") + 1] == str(MAX_MODEL_LEN), name


def test_the_worker_count_sizes_the_workers_and_the_draft_service(keys: Path) -> None:
    services = _resolve(SPECSERVE_WORKERS="3")["services"]
    assert services["worker"]["deploy"]["replicas"] == services["gpu-worker"]["deploy"]["replicas"] == 3
    draft = services["draft"]["command"]
    assert draft[draft.index("--num-targets") + 1] == "3"
    args = _service_parser("draft").parse_args([str(keys) if part == "/keys" else part for part in draft[1:]])
    assert draft_service.config.from_arguments(args).num_seqs == 3 * int(draft[draft.index("--num-seqs") + 1])


def test_another_model_is_mounted_and_named_by_variables() -> None:
    services = _resolve(
        SPECSERVE_MODELS_DIR="/srv/models",
        SPECSERVE_MODEL="/models/Qwen",
        SPECSERVE_DRAFT="ngram",
        SPECSERVE_MODEL_NAME="qwen",
    )["services"]
    for name in ("worker", "gpu-worker", "draft", "gateway"):
        command = services[name]["command"]
        flag = "--target-model" if name == "draft" else "--model"
        assert command[command.index(flag) + 1] == "/models/Qwen", name
        assert "/srv/models:/models:ro" in services[name]["volumes"], name
    assert services["draft"]["command"][services["draft"]["command"].index("--proposer") + 1] == "ngram"
    scheduler = services["scheduler"]["command"]
    assert scheduler[scheduler.index("--model-name") + 1] == "qwen"


def test_lifecycle_settings_match_the_processes(resolved: dict) -> None:  # type: ignore[type-arg]
    """Stop grace longer than the drains (30 s), a fresh process after a dismissal (exit 3) or a failed start."""
    assert EXIT_DISMISSED != 0
    drain_s = max(
        gateway.config.build_parser().parse_args(["--model", "m"]).shutdown_grace_s,
        _service_parser("worker").parse_args(["--model", "m"]).drain_timeout_s,
    )
    for name, service in resolved["services"].items():
        if name == "keys":
            assert service["restart"] == "no"
            continue
        assert service["restart"] == "on-failure", name
        grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
        assert grace is not None and int(grace.group(1)) > drain_s, name


def test_every_service_on_the_sockets_reads_the_keys_made_before_it_starts(resolved: dict) -> None:  # type: ignore[type-arg]
    services = resolved["services"]
    assert services["keys"]["command"] == ["keys", "/keys"]
    for name, service in services.items():
        if service["command"][0] in ("scheduler", "worker", "draft", "gateway"):
            command = service["command"]
            assert command[command.index("--keys") + 1] == "/keys", name
            assert "--insecure-loopback" not in command, name
            assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
            assert any(
                str(volume).endswith(":/keys") or str(volume).endswith(":/keys:rw") for volume in service["volumes"]
            ), name


def test_every_service_reads_the_keys_as_the_user_that_made_them(resolved: dict) -> None:  # type: ignore[type-arg]
    """The keys service writes each secret key 0600 (a key others may read is refused, common/transport.py): a service
    running as another user could not read it. Every service runs as the image's one user (none sets `user`)."""
    users = {name: service.get("user") for name, service in resolved["services"].items()}
    assert set(users.values()) == {users["keys"]}, users


def test_a_wrong_command_is_refused() -> None:
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        _accepts(["worker", "--model", "/models/m", "--no-such-flag"])


def _stages(dockerfile: str) -> list[str]:
    return re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)[1:]


def test_the_image_holds_every_package_the_model_and_no_compiler() -> None:
    """`pip install` in the build stage installs what pyproject lists (each copied in first); the runtime stage takes
    the venv, the model and the kernels from it, and installs no compiler."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.removesuffix("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("ARG BASE_IMAGE=python:3.11-slim") == 1
    build, runtime = _stages(dockerfile)
    assert build.startswith("${BASE_IMAGE} AS build") and runtime.startswith("${BASE_IMAGE}\n")
    for name in packages:
        assert f"COPY {name} /opt/specserve/src/{name}" in build, f"the Dockerfile does not copy {name}/"
    assert "specserve prepare-model" in build and "python -m modeling.kernels.native" in build
    assert "g++" in build and not re.search(r"g\+\+|gcc|clang|build-essential|-dev\b", runtime)
    assert "COPY --from=build /opt/specserve /opt/specserve" in runtime
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert on_disk <= set(packages), f"packages missing from pyproject: {on_disk - set(packages)}"


def test_the_services_serve_the_model_the_image_was_built_with(resolved: dict) -> None:  # type: ignore[type-arg]
    services = resolved["services"]
    baked = str(model_dir(DEFAULT_MODEL_NAME, Path("/opt/specserve/cache")))  # where prepare-model puts it in the build
    assert "SPECSERVE_CACHE_DIR=/opt/specserve/cache" in (ROOT / "Dockerfile").read_text()
    worker = services["worker"]["command"]
    assert worker[worker.index("--model") + 1] == baked
    draft = services["draft"]["command"]
    proposer = DraftSpec.parse(draft[draft.index("--proposer") + 1], flag="--proposer")
    assert proposer.kind is DraftKind.PHRASES and proposer.path is not None
    path = proposer.path.relative_to("/opt/specserve")  # the Dockerfile's COPY of drafts/
    assert path.parts[0] == "drafts" and "COPY drafts /opt/specserve/drafts" in (ROOT / "Dockerfile").read_text()
    assert (ROOT / path / "phrases.safetensors").is_file()
    assert draft[draft.index("--target-model") + 1] == baked
