"""A throwaway certificate authority and an HTTPS file server on 127.0.0.1.

Lets the tests serve an `https://` model source for real: the Nomad agent is
started with SSL_CERT_FILE pointing at a bundle that includes this CA, so
its artifact downloader (go-getter) verifies the server like any other.
The server records every request, so a test can assert what was downloaded.

The CA's own certificate and key are kept (`ca_cert`, `ca_key`), so `issue`
can sign more: client certificates for agents that ask for one
(tests/integration/test_tls.py).
"""

from __future__ import annotations

import datetime
import http.server
import io
import ipaddress
import re
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass(frozen=True)
class TlsCA:
    bundle: Path  # system CAs + this CA, for SSL_CERT_FILE
    cert: Path  # server certificate for 127.0.0.1 (and localhost), no key usage limits
    key: Path
    ca_cert: Path  # this CA alone, for a ca_file / NOMAD_CACERT
    ca_key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _leaf(
    ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common: str, days: float, client: bool
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for 127.0.0.1 and localhost, valid `days` from an hour ago; a
    `client` one is limited to client authentication."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    )
    if client:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def make_ca(folder: Path) -> TlsCA:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("llmgw test CA"))
        .issuer_name(_name("llmgw test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert, key = _leaf(ca, ca_key, "127.0.0.1", days=2, client=False)
    pem = serialization.Encoding.PEM
    system = SYSTEM_BUNDLE.read_bytes() if SYSTEM_BUNDLE.exists() else b""
    (folder / "bundle.pem").write_bytes(system + ca.public_bytes(pem))
    (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
    _write_key(folder / "ca.key", ca_key)
    (folder / "server.pem").write_bytes(cert.public_bytes(pem))
    _write_key(folder / "server.key", key)
    return TlsCA(
        folder / "bundle.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "ca.pem",
        folder / "ca.key",
    )


def issue(
    ca: TlsCA, folder: Path, name: str, days: float = 2, client: bool = False
) -> tuple[Path, Path]:
    """Sign another certificate for 127.0.0.1 with `ca`, valid `days`; a `client` one for
    client authentication only. Writes `<name>.pem` and `<name>.key` into `folder`;
    returns their paths."""
    ca_cert = x509.load_pem_x509_certificate(ca.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    cert, key = _leaf(ca_cert, ca_key, name, days, client)
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(folder / f"{name}.key", key)
    return folder / f"{name}.pem", folder / f"{name}.key"


@dataclass
class FileServer:
    """Serves one folder over HTTPS. `requests` lists the paths asked for whole (what
    Nomad downloads); `ranges` the (path, first byte, last byte) of each range request
    (what `planner apply` reads of a GGUF header), answered 206 as RFC 9110 says."""

    url: str
    requests: list[str] = field(default_factory=list)
    ranges: list[tuple[str, int, int]] = field(default_factory=list)
    _server: http.server.ThreadingHTTPServer | None = None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def serve_https(folder: Path, ca: TlsCA) -> FileServer:
    served = FileServer(url="")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)  # type: ignore[arg-type]

        def send_head(self):  # type: ignore[no-untyped-def]
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if match is None:
                served.requests.append(self.path)
                return super().send_head()
            path = Path(self.translate_path(self.path))
            if not path.is_file():
                self.send_error(404)
                return None
            size = path.stat().st_size
            first = int(match[1])
            last = min(int(match[2]) if match[2] else size - 1, size - 1)
            served.ranges.append((self.path, first, last))
            if first >= size:
                self.send_error(416)
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("Content-Length", str(last - first + 1))
            self.end_headers()
            with path.open("rb") as f:
                f.seek(first)
                return io.BytesIO(f.read(last - first + 1))

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(ca.cert, ca.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    served.url = f"https://127.0.0.1:{server.server_address[1]}"
    served._server = server
    return served
