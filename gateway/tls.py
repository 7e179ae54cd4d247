"""TLS on the public ports (`--tls-certfile`, `--tls-keyfile`, `--tls-ca-certfile`): one certificate for both.

The gRPC port and the HTTP port serve the same certificate and key. With a client CA, both
also want each client's own certificate, signed by that CA (mutual TLS). The gRPC port
refuses a connection without one during the handshake, before any call. The HTTP port asks
for one in the handshake and refuses a certificate the CA did not sign there; a connection
without any gets the probes' routes (`/health`, `/ready`: an orchestrator's probe holds no
client certificate, as it holds no API key) and a 401 on every other (`HttpApi`). Files are
read once, as the gateway starts; a file that cannot be read, or a key that does not match
its certificate, stops it there with the flag named.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsError(ValueError):
    """A TLS file that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class Tls:
    """The PEM files the public ports serve with; the bytes are the files' as the gateway started."""

    certfile: Path
    keyfile: Path
    client_ca: Path | None  # mutual TLS: clients present a certificate this CA signed
    certificate: bytes
    key: bytes
    client_ca_certificates: bytes | None

    @classmethod
    def load(cls, certfile: Path | None, keyfile: Path | None, client_ca: Path | None) -> Tls | None:
        """The files named (None when none is: plain TCP); raises TlsError for half a pair or a file that does not
        serve (unreadable, not PEM, a key that is not the certificate's)."""
        if certfile is None and keyfile is None:
            if client_ca is not None:
                raise TlsError(
                    "--tls-ca-certfile asks clients for certificates over TLS: give --tls-certfile and "
                    "--tls-keyfile too"
                )
            return None
        if certfile is None or keyfile is None:
            raise TlsError("--tls-certfile and --tls-keyfile go together: give both")
        tls = cls(
            certfile,
            keyfile,
            client_ca,
            _read(certfile, "--tls-certfile"),
            _read(keyfile, "--tls-keyfile"),
            None if client_ca is None else _read(client_ca, "--tls-ca-certfile"),
        )
        tls.ssl_context()  # every file parsed, and the key checked against the certificate, now
        return tls

    @property
    def mutual(self) -> bool:
        """Clients present certificates the client CA signed."""
        return self.client_ca_certificates is not None

    def ssl_context(self) -> ssl.SSLContext:
        """The HTTP port's: TLS 1.2 at least, the certificate and key, and with a client CA, client certificates
        asked for and checked when given (a connection without one is for the probes only: HttpApi)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as error:
            raise TlsError(
                f"--tls-certfile {self.certfile} with --tls-keyfile {self.keyfile}: {error} (is the key "
                "the certificate's, both PEM?)"
            ) from error
        if self.client_ca_certificates is not None:
            try:
                context.load_verify_locations(cadata=self.client_ca_certificates.decode("ascii"))
            except (ssl.SSLError, UnicodeDecodeError, ValueError) as error:
                raise TlsError(f"--tls-ca-certfile {self.client_ca}: {error} (PEM certificates?)") from error
            context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC port's: the same certificate and key, and the same demand for client certificates."""
        return grpc.ssl_server_credentials(
            [(self.key, self.certificate)],
            root_certificates=self.client_ca_certificates,
            require_client_auth=self.mutual,
        )


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise TlsError(f"{flag} {path}: cannot be read ({error.strerror})") from error
