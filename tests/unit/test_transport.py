"""The services' transport security (common/transport.py): key folders, the insecure loopback mode, and the checks
every process makes before it starts."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.auth
import zmq.utils.monitor

from common import settings, transport
from common.transport import KeyCheck, Transport, TransportError, authorized_keys, is_loopback, make_keys

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, "worker")
    return parser.parse_args(["--model", "m", *argv])


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.2.1:1", True),
        ("tcp://localhost:5556", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/specserve.sock", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://scheduler:5556", False),
        ("tcp://10.0.0.7:5556", False),
        ("tcp://127.0.0.1.example.com:5", False),
        ("udp://127.0.0.1:5", False),
        ("127.0.0.1:5555", False),
    ],
)
def test_only_addresses_on_this_machine_count_as_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_a_process_without_keys_refuses_to_start_unless_told_insecure_and_then_only_on_loopback() -> None:
    with pytest.raises(TransportError, match="no keys: give --keys FOLDER .* or --insecure-loopback"):
        transport.from_arguments(_args(), "worker", [("--scheduler-address", "tcp://127.0.0.1:5556")])
    with pytest.raises(
        TransportError, match="--scheduler-address tcp://10.1.2.3:5556: --insecure-loopback serves on loopback only"
    ):
        transport.from_arguments(
            _args("--insecure-loopback"), "worker", [("--scheduler-address", "tcp://10.1.2.3:5556")]
        )
    with pytest.raises(TransportError, match="--worker-address tcp://0.0.0.0:5556"):
        transport.from_arguments(
            _args("--insecure-loopback"),
            "scheduler",
            [("--gateway-address", "tcp://127.0.0.1:5555"), ("--worker-address", "tcp://0.0.0.0:5556")],
        )
    with pytest.raises(TransportError, match="exclude each other"):
        transport.from_arguments(_args("--insecure-loopback", "--keys", "/k"), "gateway", [])
    insecure = transport.from_arguments(
        _args("--insecure-loopback"), "gateway", [("--scheduler-address", "tcp://127.0.0.1:1")]
    )
    assert not insecure.secure and "INSECURE" in insecure.describe()


def test_each_service_refuses_to_start_without_keys_naming_the_flags(tmp_path: Path, default_model_dir: Path) -> None:
    for module, argv in (
        ("scheduler", []),
        ("gpu_worker", ["--model", str(tmp_path)]),
        ("draft_service", []),
        ("gateway", ["--model", str(default_model_dir)]),
    ):
        done = subprocess.run(
            [sys.executable, "-m", module, *argv], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (module, done.stderr[-2000:])
        assert "no keys: give --keys FOLDER" in done.stderr and "--insecure-loopback" in done.stderr, module


def test_the_key_folder_is_made_once_private_and_kept(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = make_keys(keys)
    assert {p.relative_to(keys).as_posix() for p in made} == {
        "scheduler.key",
        "scheduler.key_secret",
        "gateway.key",
        "gateway.key_secret",
        "worker.key",
        "worker.key_secret",
        "authorized/gateway/gateway.key",
        "authorized/worker/worker.key",
    }
    assert keys.stat().st_mode & 0o777 == 0o700
    assert all((keys / f"{name}.key_secret").stat().st_mode & 0o077 == 0 for name in ("scheduler", "gateway", "worker"))
    secret_before = (keys / "worker.key_secret").read_bytes()
    assert make_keys(keys) == []  # what is there is kept
    assert (keys / "worker.key_secret").read_bytes() == secret_before
    worker_public, _ = zmq.auth.load_certificate(keys / "worker.key")
    gateway_public, _ = zmq.auth.load_certificate(keys / "gateway.key")
    assert authorized_keys(keys, "worker") == {worker_public} and authorized_keys(keys, "gateway") == {gateway_public}
    for role in ("scheduler", "gateway", "worker"):
        transport.check_keys(keys, role)  # type: ignore[arg-type]


def test_a_missing_or_damaged_key_file_is_named(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    with pytest.raises(TransportError, match="no such folder"):
        transport.check_keys(keys, "worker")
    make_keys(keys)
    (keys / "worker.key_secret").unlink()
    with pytest.raises(TransportError, match="cannot read the key pair .*worker.key_secret"):
        transport.from_arguments(
            _args("--keys", str(keys)), "worker", [("--scheduler-address", "tcp://scheduler:5556")]
        )
    transport.check_keys(keys, "gateway")  # the other roles still have theirs
    (keys / "gateway.key_secret").write_text("not a key\n")
    with pytest.raises(TransportError, match="gateway.key_secret"):
        transport.check_keys(keys, "gateway")
    (keys / "scheduler.key").unlink()
    with pytest.raises(TransportError, match="cannot read the public key .*scheduler.key"):
        transport.check_keys(keys, "scheduler")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o610, 0o601, 0o700], ids=lambda mode: f"{mode:04o}")
def test_a_secret_key_its_group_or_others_may_use_is_refused_naming_the_file_and_its_mode(
    tmp_path: Path, mode: int
) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    secret = keys / "worker.key_secret"
    secret.chmod(mode)
    if mode & 0o077 == 0:  # the owner's own bits are the owner's business
        transport.check_keys(keys, "worker")
        return
    refused = rf"{re.escape(str(secret))} is open to its group or others \(mode 0{mode:o}\); chmod 600 it"
    with pytest.raises(TransportError, match=refused):
        transport.from_arguments(
            _args("--keys", str(keys)), "worker", [("--scheduler-address", "tcp://scheduler:5556")]
        )
    with zmq.Context() as context, context.socket(zmq.DEALER) as sock, pytest.raises(TransportError, match=refused):
        Transport(keys).join(sock, "worker")
    transport.check_keys(keys, "gateway")  # the other roles' keys are still theirs
    secret.chmod(0o400)
    transport.check_keys(keys, "worker")


def test_a_service_given_a_secret_key_others_may_read_refuses_to_start_naming_it(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    (keys / "scheduler.key_secret").chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "scheduler", "--keys", str(keys)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{keys / 'scheduler.key_secret'} is open to its group or others (mode 0644); chmod 600 it" in done.stderr


def test_the_scheduler_needs_its_authorized_folders(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    for path in (keys / "authorized" / "worker").iterdir():
        path.unlink()
    (keys / "authorized" / "worker").rmdir()
    with pytest.raises(TransportError, match="authorized/worker of the worker keys"):
        transport.check_keys(keys, "scheduler")


def test_the_key_check_reads_the_authorized_folder_at_every_attempt(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    refused: list[bytes] = []
    check = KeyCheck(keys, "worker", refused.append)
    worker_public, _ = zmq.auth.load_certificate(keys / "worker.key")
    gateway_public, _ = zmq.auth.load_certificate(keys / "gateway.key")
    assert check.callback("worker", worker_public)
    assert not check.callback("worker", gateway_public)  # a gateway's key does not open the worker socket
    assert refused == [gateway_public]
    public, _ = zmq.auth.create_certificates(keys, "second-host")  # a new host's key, authorized without a restart
    (keys / "authorized" / "worker" / "second-host.key").write_bytes(Path(public).read_bytes())
    second, _ = zmq.auth.load_certificate(public)
    assert check.callback("worker", second)
    (keys / "authorized" / "worker" / "worker.key").unlink()  # revoked: refused at its next connection
    assert not check.callback("worker", worker_public)


def test_a_curve_client_with_the_folders_keys_reaches_a_curve_server_and_the_traffic_is_encrypted(
    tmp_path: Path,
) -> None:
    from zmq.auth.thread import ThreadAuthenticator

    keys = tmp_path / "keys"
    make_keys(keys)
    secured = Transport(keys)
    context = zmq.Context()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    refused: list[bytes] = []
    authenticator.configure_curve_callback("worker", KeyCheck(keys, "worker", refused.append))
    try:
        server = context.socket(zmq.ROUTER)
        secured.serve(server, "worker")
        assert server.curve_server and server.zap_domain == b"worker"
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        secured.join(client, "worker")
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        assert server.poll(5000)
        _, payload = server.recv_multipart()
        assert payload == b"hello" and not refused
        stranger = context.socket(zmq.DEALER)
        secured.join(stranger, "gateway")  # right server key, a key the worker socket does not authorize
        monitor = stranger.get_monitor_socket(transport.HANDSHAKE_EVENTS)
        stranger.connect(f"tcp://127.0.0.1:{port}")
        stranger.send(b"let me in")
        assert monitor.poll(5000)
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert "not in the scheduler's" in (secured.handshake_failure(event, "gateway") or "")
        assert not server.poll(300) and len(refused) == 1
    finally:
        authenticator.stop()
        context.destroy(linger=0)
