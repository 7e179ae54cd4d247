"""TLS files (gateway/tls.py): what serves, and what stops the gateway at start naming the flag."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from gateway.tls import Tls, TlsError
from tests.tls_certs import make_test_ca


def test_a_certificate_and_its_key_serve_both_ports_and_a_client_ca_asks_for_client_certificates(
    tmp_path: Path,
) -> None:
    ca = make_test_ca(tmp_path)
    assert Tls.load(None, None, None) is None  # plain TCP
    plain = Tls.load(ca.server_cert, ca.server_key, None)
    assert plain is not None and plain.ssl_context().verify_mode == ssl.CERT_NONE and not plain.mutual
    assert plain.grpc_credentials() is not None
    mutual = Tls.load(ca.server_cert, ca.server_key, ca.ca_cert)
    # The HTTP handshake asks for a certificate and checks one given; HttpApi keeps every route but the probes' from
    # a connection that gave none (tests/e2e/test_access.py).
    assert mutual is not None and mutual.mutual and mutual.ssl_context().verify_mode == ssl.CERT_OPTIONAL
    assert mutual.ssl_context().minimum_version >= ssl.TLSVersion.TLSv1_2


def test_files_that_do_not_serve_stop_the_gateway_naming_the_flag(tmp_path: Path) -> None:
    ca = make_test_ca(tmp_path)
    (tmp_path / "other").mkdir()
    other = make_test_ca(tmp_path / "other")
    cases = [
        ((ca.server_cert, None, None), "--tls-certfile and --tls-keyfile go together"),
        ((None, ca.server_key, None), "--tls-certfile and --tls-keyfile go together"),
        ((None, None, ca.ca_cert), "--tls-ca-certfile asks clients for certificates over TLS"),
        ((tmp_path / "missing.pem", ca.server_key, None), "--tls-certfile .*missing.pem: cannot be read"),
        ((ca.server_cert, other.server_key, None), "is the key the certificate's"),  # another certificate's key
        ((ca.server_key, ca.server_cert, None), "is the key the certificate's"),  # the two swapped
        ((ca.server_cert, ca.server_key, ca.server_key), "--tls-ca-certfile"),  # a key is no CA certificate
    ]
    for (certfile, keyfile, client_ca), message in cases:
        with pytest.raises(TlsError, match=message):
            Tls.load(certfile, keyfile, client_ca)
