"""Who may speak on the ZeroMQ sockets between the services: CurveZMQ keys, or a stated insecure mode on loopback.

The scheduler is the CURVE server on both of its sockets. A gateway, a target worker or
the draft service is a client: it must know the scheduler's public key, and hold a key
pair whose public half the scheduler authorizes for that socket (libzmq's ZAP handshake,
answered by pyzmq's authenticator in the scheduler). Everything after the handshake is
encrypted. The keys live in one folder, made by `specserve keys FOLDER`:

    scheduler.key              the scheduler's public key: every process reads it
    scheduler.key_secret       the scheduler's key pair: the scheduler alone
    gateway.key_secret         a gateway's key pair
    worker.key_secret          a target worker's or the draft service's key pair
    authorized/gateway/*.key   public keys the scheduler lets in on its gateway socket
    authorized/worker/*.key    public keys the scheduler lets in on its worker socket

A process started without keys refuses to run unless told `--insecure-loopback`, and
then every address it binds or connects to must be on this machine's loopback. A key pair
(`*.key_secret`) that its group or others may read is refused, as ssh refuses such a private
key: `specserve keys` makes them 0600.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import zmq
import zmq.auth

Role = Literal["gateway", "worker"]
ROLES: tuple[Role, ...] = ("gateway", "worker")
ENV_VAR = "SPECSERVE_KEYS"  # the default of --keys
SCHEDULER = "scheduler"
AUTHORIZED = "authorized"

# Why a client's CURVE handshake with the scheduler failed, by libzmq's monitor event.
HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the scheduler does not authorize this process's key (its public key is not in "
    "the scheduler's {keys}/authorized/{role}/)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the scheduler speaks another security mechanism: one side has keys "
    "(--keys) and the other runs --insecure-loopback",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake with the scheduler failed: the scheduler's key is not the "
    "one in {keys}/scheduler.key, or one side runs without keys",
}
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)


class TransportError(ValueError):
    """A key folder or an address that cannot be used; the message names the flag or the file."""


@dataclass(frozen=True)
class Transport:
    """How one process secures its sockets: the key folder, or None for the insecure loopback mode."""

    keys: Path | None

    @property
    def secure(self) -> bool:
        return self.keys is not None

    def describe(self) -> str:
        return f"CURVE keys in {self.keys}" if self.keys is not None else "INSECURE: no keys, loopback only"

    def serve(self, socket: zmq.Socket[Any], role: Role) -> None:
        """Make `socket` (one of the scheduler's, before it binds) a CURVE server checked against `role`'s keys."""
        if self.keys is None:
            return
        public, secret = _load_pair(self.keys, SCHEDULER)
        socket.curve_server = True
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        socket.zap_domain = role.encode()

    def join(self, socket: zmq.Socket[Any], role: Role) -> None:
        """Make `socket` (a client's, before it connects) a CURVE client of the scheduler with `role`'s key pair."""
        if self.keys is None:
            return
        public, secret = _load_pair(self.keys, role)
        socket.curve_serverkey = _load_public(self.keys, SCHEDULER)
        socket.curve_publickey = public
        socket.curve_secretkey = secret

    def handshake_failure(self, event: int, role: Role) -> str | None:
        """What a failed handshake (a monitor event) most likely means, for the log; None for any other event."""
        reason = HANDSHAKE_FAILURES.get(event)
        return None if reason is None else reason.format(keys=self.keys, role=role)


def from_arguments(
    args: argparse.Namespace, role: Role | Literal["scheduler"], addresses: Iterable[tuple[str, str]]
) -> Transport:
    """The transport of a process of `role` whose sockets use `addresses` ((flag, address) pairs).

    Raises TransportError naming the flag or the key file."""
    keys: Path | None = args.keys
    if keys is not None and args.insecure_loopback:
        raise TransportError("--keys and --insecure-loopback exclude each other: give one")
    if keys is None and not args.insecure_loopback:
        raise TransportError(
            f"no keys: give --keys FOLDER (made by `specserve keys FOLDER`, or set ${ENV_VAR}), or "
            "--insecure-loopback to run unauthenticated with every address on 127.0.0.1"
        )
    if keys is None:
        for flag, address in addresses:
            if not is_loopback(address):
                raise TransportError(
                    f"{flag} {address}: --insecure-loopback serves on loopback only "
                    "(127.0.0.1, ::1, ipc://); give --keys to use another address"
                )
        return Transport(None)
    check_keys(keys, role)
    return Transport(keys)


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this machine: tcp:// to a loopback address, or ipc:// and inproc://."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or not rest:
        return False
    host = urlsplit(f"//{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, an interface, or *
        return False


def check_keys(keys: Path, role: Role | Literal["scheduler"]) -> None:
    """That `keys` holds what a process of `role` reads, each file a well-formed key; TransportError names the file."""
    if not keys.is_dir():
        raise TransportError(f"--keys {keys}: no such folder (make one with `specserve keys {keys}`)")
    _load_public(keys, SCHEDULER)
    _load_pair(keys, role)
    if role == SCHEDULER:
        for client in ROLES:
            folder = keys / AUTHORIZED / client
            if not folder.is_dir():
                raise TransportError(f"--keys {keys}: no folder {folder} of the {client} keys the scheduler lets in")


def make_keys(keys: Path) -> list[Path]:
    """Fill the key folder: the scheduler's, a gateway's and a worker's key pairs, and the two clients' public keys
    authorized. What is already there is kept (so this can run at every start); returns the files it made."""
    made: list[Path] = []
    keys.mkdir(parents=True, exist_ok=True)
    keys.chmod(0o700)
    for name in (SCHEDULER, *ROLES):
        if not (keys / f"{name}.key_secret").exists():
            public, secret = zmq.auth.create_certificates(keys, name)
            Path(secret).chmod(0o600)
            made += [Path(public), Path(secret)]
    for role in ROLES:
        folder = keys / AUTHORIZED / role
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.key")):
            shutil.copyfile(keys / f"{role}.key", folder / f"{role}.key")
            made.append(folder / f"{role}.key")
    return made


def authorized_keys(keys: Path, role: Role) -> set[bytes]:
    """The public keys (z85) let in on `role`'s socket, read from authorized/ROLE/ now; a file that is not a key is
    skipped (an empty set lets no one in)."""
    found: set[bytes] = set()
    for path in sorted((keys / AUTHORIZED / role).glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError):
            continue
        found.add(public)
    return found


class KeyCheck:
    """The scheduler's answer to a ZAP request for one socket: is this client's public key authorized for `role`?
    The folder is read at every connection attempt, so a key added or removed there takes effect for the next one."""

    def __init__(self, keys: Path, role: Role, refused: Callable[[bytes], None]) -> None:
        self._keys = keys
        self._role = role
        self._refused = refused

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in authorized_keys(self._keys, self._role)
        if not allowed:
            self._refused(key)
        return allowed


def _load_public(keys: Path, name: str) -> bytes:
    path = keys / f"{name}.key"
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise TransportError(f"--keys {keys}: cannot read the public key {path}: {exc}") from exc
    return public


def _load_pair(keys: Path, name: str) -> tuple[bytes, bytes]:
    path = keys / f"{name}.key_secret"
    _check_private(keys, path)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise TransportError(f"--keys {keys}: cannot read the key pair {path}: {exc}") from exc
    if secret is None:
        raise TransportError(f"--keys {keys}: {path} holds no secret key")
    return public, secret


def _check_private(keys: Path, path: Path) -> None:
    """Refuses a secret key with any of its mode's group or other bits set: whoever else can read it can speak for its
    role. (A file that cannot be read is named by the read that follows.)"""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        raise TransportError(
            f"--keys {keys}: the secret key {path} is open to its group or others (mode {mode:04o}); chmod 600 it"
        )
