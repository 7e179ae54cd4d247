"""Whether a stack's gateway serves, asked from outside as a probe would: its gRPC health check or its HTTP /ready.

`specserve healthcheck` runs these every few seconds in each container, so this module
imports no more than the probes need (grpc and urllib only when called).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: the healthcheck needs no launcher
    from specserve.stack import StackAddresses, StackConfig


def stack_serving(config: StackConfig, addresses: StackAddresses) -> bool:
    """The stack's gateway serves: its gRPC health says SERVING, or with TLS on the public ports, its HTTPS /ready says
    200 (open without a client certificate under mutual TLS, as for any probe)."""
    if config.tls_certfile is None:
        return is_serving(addresses.host, addresses.grpc_port)
    return is_ready(addresses.host, addresses.http_port, tls=True)


def is_ready(host: str, port: int, *, tls: bool) -> bool:
    """The gateway's HTTP port on host:port answers /ready with 200 (a READY target worker), over HTTPS with `tls`.
    The probe checks a gateway on this machine (or in this container) and sends nothing secret, so it takes the
    certificate it finds."""
    import ssl
    import urllib.error
    import urllib.request

    context = None
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    try:
        with urllib.request.urlopen(
            f"{'https' if tls else 'http'}://{host}:{port}/ready", context=context, timeout=1.0
        ) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def is_serving(host: str, port: int) -> bool:
    """The gateway listening on host:port answers the standard gRPC health check with SERVING
    (a READY target worker)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
