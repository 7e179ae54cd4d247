"""The images tests/compose runs, built in the tests' own Docker engine: a base image from Debian's archive
(docker/base-image.sh, no registry is reachable), then the project's, offline from docker/wheels, on the host network.

The compose fixture builds them before the first test. `python -m tests.compose.images` builds them ahead (CI does, at
the lowest CPU and I/O priority, while the other tests run): the fixture's build then finds every layer cached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = Path(os.environ.get("SPECSERVE_DOCKER_DIR", "/var/tmp/specserve-docker"))
ENGINE = ROOT / "docker" / "engine.sh"
BASE_IMAGE = "specserve-base:bookworm"
PROJECT = "specserve-test"
# Every service runs the one image; building one of them builds it (compose would build it again for each service).
BUILT_SERVICE = "scheduler"


def run(
    command: list[str], env: dict[str, str], timeout_s: float, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return done


def engine_env() -> dict[str, str]:
    """The environment for docker and docker-compose, aimed at the tests' engine (docker/engine.sh)."""
    return {
        **os.environ,
        "SPECSERVE_DOCKER_DIR": str(ENGINE_DIR),
        "DOCKER_HOST": f"unix://{ENGINE_DIR}/docker.sock",
        # Compose v1 builds through the engine's API (the legacy builder); the CLI's own build needs BuildKit's buildx.
        "DOCKER_BUILDKIT": "0",
        "COMPOSE_DOCKER_CLI_BUILD": "0",
        "SPECSERVE_BASE_IMAGE": BASE_IMAGE,
    }


@contextmanager
def running_engine() -> Iterator[dict[str, str]]:
    """The tests' engine started (docker/engine.sh; a no-op when it runs already) and stopped after, whatever happened;
    yields engine_env()."""
    env = engine_env()
    run([str(ENGINE), "start"], env, 120)
    try:
        yield env
    finally:
        run([str(ENGINE), "stop"], env, 120)


def on_host_network(env: dict[str, str], folder: Path) -> Path:
    """docker-compose.yml resolved with `env`, every service on the host's network; written into `folder`."""
    resolved = yaml.safe_load(run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"], env, 60).stdout)
    for service in resolved["services"].values():
        service["network_mode"] = "host"
        service.pop("ports", None)
        service["build"]["network"] = "host"
        service["build"]["args"]["PIP_OFFLINE"] = "1"
    path = folder / "docker-compose.yml"
    path.write_text(yaml.safe_dump(resolved, sort_keys=False))
    return path


def build(env: dict[str, str], compose_file: Path) -> dict[str, float]:
    """The base image, then the project's (specserve:latest); the seconds each took."""
    timings = {}
    started = time.monotonic()
    run([str(ROOT / "docker" / "base-image.sh"), BASE_IMAGE], env, 900)
    timings["base image"] = time.monotonic() - started
    started = time.monotonic()
    run(["docker-compose", "-p", PROJECT, "-f", str(compose_file), "build", BUILT_SERVICE], env, 1800)
    timings["project image"] = time.monotonic() - started
    return timings


def main() -> int:
    with running_engine() as env, tempfile.TemporaryDirectory() as folder:
        timings = build(env, on_host_network(env, Path(folder)))
    print(", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
