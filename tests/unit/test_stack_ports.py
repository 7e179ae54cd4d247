"""The ports a stack is given: all different, none already taken, none the kernel may hand a connecting socket."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from specserve.stack import StackAddresses, StackConfig, free_ports


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_the_ports_of_one_draw_are_different_free_and_not_the_ones_taken() -> None:
    for _ in range(50):
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            busy = listening.getsockname()[1]
            ports = free_ports(8, taken=[busy])
        assert len(set(ports)) == 8
        assert busy not in ports
        for port in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # nothing holds it after the draw


def test_they_lie_below_the_range_the_kernel_gives_to_connecting_sockets() -> None:
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.exists():
        pytest.skip("no ephemeral range to stay out of on this system")
    low = int(ranges.read_text().split()[0])
    assert all(port < low for port in free_ports(20))


def test_a_stack_listens_on_four_different_ports_and_never_on_the_ones_it_was_given(tmp_path: Path) -> None:
    for _ in range(50):
        picked = StackAddresses.pick(StackConfig(tmp_path))
        ports = [picked.grpc_port, picked.http_port, _port(picked.gateway_address), _port(picked.worker_address)]
        assert len(set(ports)) == 4
    given = free_ports(2)
    picked = StackAddresses.pick(StackConfig(tmp_path, grpc_port=given[0], http_port=given[1]))
    assert (picked.grpc_port, picked.http_port) == (given[0], given[1])
    assert not {_port(picked.gateway_address), _port(picked.worker_address)} & set(given)
