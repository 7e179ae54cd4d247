"""docker-compose.yml run for real (`make test-compose`): a Docker engine of the tests' own, an image built from
Debian's archive and wheels fetched on this machine, the stack on the host network (every packet on 127.0.0.1).

The engine (docker/engine.sh) runs with --bridge=none --iptables=false: containers have no network of their own. The
stack is docker-compose.yml as compose resolves it (`docker-compose config`, with the addresses and ports chosen here)
with every service moved onto the host's network, its published ports dropped (the host network publishes whatever
a process listens on; compose refuses both at once) and its image built by tests/compose/images.py (unless built ahead,
as CI does). The engine is stopped at the end, whatever happened.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from specserve.stack import free_ports
from tests.compose.images import PROJECT, build, on_host_network, run, running_engine

LABEL = f"com.docker.compose.project={PROJECT}"


def progress(message: str) -> None:
    """A progress line on the terminal (pytest -s not needed): how long each part took is part of the result."""
    print(f"[compose {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Compose:
    """The compose project under test, and the docker and docker-compose commands aimed at its engine."""

    env: dict[str, str]
    file: Path  # the compose file run: docker-compose.yml on the host network
    grpc_port: int
    http_port: int
    timings: dict[str, float] = field(default_factory=dict)
    tls_ca: Path | None = None  # the CA of the certificate the gateway serves, when it serves TLS

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-p", PROJECT, "-f", str(self.file), *args], self.env, timeout_s, check)

    def docker(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker", *args], self.env, timeout_s, check)

    def containers(self, service: str) -> list[str]:
        """The ids of the service's containers, running or not."""
        out = self.docker(
            "ps", "-a", "-q", "--filter", f"label={LABEL}", "--filter", f"label=com.docker.compose.service={service}"
        ).stdout
        return out.split()

    def container(self, service: str) -> str:
        ids = self.containers(service)
        assert len(ids) == 1, f"{service}: {len(ids)} containers"
        return ids[0]

    def inspect(self, container: str) -> dict:  # type: ignore[type-arg]
        inspected: dict = json.loads(self.docker("inspect", container).stdout)[0]  # type: ignore[type-arg]
        return inspected

    def health(self, container: str) -> str:
        state = self.inspect(container)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def logs(self, service: str) -> str:
        """Everything the service's containers wrote (the services log to stderr), across their restarts."""
        outputs = (self.docker("logs", cid) for cid in self.containers(service))
        return "".join(done.stdout + done.stderr for done in outputs)

    def ready(self) -> bool:
        scheme, context = "http", None
        if self.tls_ca is not None:
            scheme, context = "https", ssl.create_default_context(cafile=str(self.tls_ca))
        try:
            with urllib.request.urlopen(
                f"{scheme}://localhost:{self.http_port}/ready", context=context, timeout=2
            ) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """/ready answers 200 and every container of the stack is healthy (the keys one has exited 0)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            services = ("scheduler", "worker", "draft", "gateway")
            if self.ready() and all(
                self.containers(s) and all(self.health(c) == "healthy" for c in self.containers(s)) for s in services
            ):
                return
            time.sleep(1)
        states = {
            s: [self.health(c) for c in self.containers(s)] for s in ("keys", "scheduler", "worker", "draft", "gateway")
        }
        raise AssertionError(
            f"the stack was not ready within {timeout_s:.0f} s: /ready {self.ready()}, containers {states}\n"
            + "\n".join(f"--- {s}\n{self.logs(s)[-3000:]}" for s in states)
        )

    def leftovers(self) -> dict[str, list[str]]:
        """What of the project the engine still has: containers (any state) and networks."""
        return {
            "containers": self.docker("ps", "-a", "-q", "--filter", f"label={LABEL}").stdout.split(),
            "networks": self.docker("network", "ls", "-q", "--filter", f"label={LABEL}").stdout.split(),
        }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, None]:  # type: ignore[type-arg]
    """A test that failed in any phase so far is marked (`item.compose_failed`) for print_logs_if_failed."""
    outcome = yield
    if outcome.get_result().failed:
        item.compose_failed = True  # type: ignore[attr-defined]


def print_logs_if_failed(request: pytest.FixtureRequest, stack: Compose) -> None:
    """After a failed test, the end of every service's logs on the terminal: the stack is taken down with the run,
    and what its processes said is the evidence."""
    if getattr(request.node, "compose_failed", False):
        for service in ("scheduler", "worker", "draft", "gateway"):
            progress(f"{request.node.name} failed; the last of {service}'s logs:\n{stack.logs(service)[-6000:]}")


@pytest.fixture(scope="session")
def engine() -> Iterator[dict[str, str]]:
    """The environment for docker and docker-compose, aimed at an engine started for these tests (stopped after)."""
    for tool in ("dockerd", "docker", "docker-compose"):
        assert shutil.which(tool), (
            f"{tool} is needed: Debian's docker.io and docker-compose (`make test-compose` installs them)"
        )
    started = time.monotonic()
    with running_engine() as env:
        progress(f"engine up in {time.monotonic() - started:.1f} s")
        yield env


@pytest.fixture(scope="session")
def compose(engine: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    """The image built (base image, then the project's) and the compose project's settings; taken down after."""
    gateway_port, worker_port, grpc_port, http_port = free_ports(4)
    env = {
        **engine,
        "SPECSERVE_BIND": "127.0.0.1",
        "SPECSERVE_SCHEDULER": "127.0.0.1",
        "SPECSERVE_SCHEDULER_GATEWAY_PORT": str(gateway_port),
        "SPECSERVE_SCHEDULER_WORKER_PORT": str(worker_port),
        "SPECSERVE_GRPC_PORT": str(grpc_port),
        "SPECSERVE_HTTP_PORT": str(http_port),
        "COMPOSE_PROFILES": "cpu",
    }
    stack = Compose(
        env,
        on_host_network(env, tmp_path_factory.mktemp("compose")),
        int(env["SPECSERVE_GRPC_PORT"]),
        int(env["SPECSERVE_HTTP_PORT"]),
    )
    stack.compose("down", "-v", "--remove-orphans", timeout_s=180)  # whatever an interrupted run left
    stack.timings.update(build(env, stack.file))
    size = int(stack.docker("image", "inspect", "-f", "{{.Size}}", "specserve:latest").stdout)
    progress(
        f"base image {stack.timings['base image']:.0f} s, project image {stack.timings['project image']:.0f} s, "
        f"{size / 1e9:.2f} GB"
    )
    try:
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", timeout_s=180, check=False)
