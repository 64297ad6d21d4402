"""What sits between a client and AWS in some deployments, on loopback: an endpoint behind
TLS signed by a private CA, and an HTTPS proxy (CONNECT), each counting what it carried.

Both forward bytes, nothing more: whatever client reaches the stand-in through them
really used the CA bundle or the proxy it was configured with.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class PrivateCa:
    """A CA of its own (`bundle`: its certificate, what AWS_CA_BUNDLE names) and a server
    certificate it signed for `hosts` (names and IP addresses)."""

    bundle: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        return context


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_private_ca(directory: Path, hosts: tuple[str, ...]) -> PrivateCa:
    now = datetime.datetime.now(datetime.UTC)
    valid = {"not_valid_before": now - datetime.timedelta(hours=1)}
    valid["not_valid_after"] = now + datetime.timedelta(days=2)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder(**valid)
        .subject_name(_name("sqsinfer test CA"))
        .issuer_name(_name("sqsinfer test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder(**valid)
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = PrivateCa(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    paths.bundle.write_bytes(ca.public_bytes(pem))
    paths.cert.write_bytes(cert.public_bytes(pem))
    paths.key.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK_BYTES):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def _join(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    host: str,
    port: int,
) -> None:
    """Carry bytes both ways between the accepted connection and (host, port)."""
    try:
        up_reader, up_writer = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


@dataclass
class TlsFront:
    """TLS with the private CA's certificate in front of a plain HTTP server."""

    target_port: int
    ca: PrivateCa
    port: int = 0
    connections: int = 0
    _server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await _join(reader, writer, "127.0.0.1", self.target_port)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", 0, ssl=self.ca.server_context()
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


# ONNX Runtime (1.32) sends telemetry from any process that imported it, through the
# process's HTTPS_PROXY: a test process that ran an ONNX test earlier asks a test's proxy
# for this tunnel too, at any moment. It is refused and not recorded.
NOT_OURS = frozenset({"mobile.events.data.microsoft.com:443"})


@dataclass
class ConnectProxy:
    """An HTTPS proxy: each CONNECT is recorded (`targets`, as "host:port") and tunnelled
    to where `to` maps its target, or refused (403) when it maps it to None. A tunnel
    asked for by something else in the process (`NOT_OURS`) is refused unrecorded."""

    to: Callable[[str], tuple[str, int] | None]
    port: int = 0
    targets: list[str] = field(default_factory=list)
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        ours = target not in NOT_OURS
        if ours:
            self.targets.append(target if method == "CONNECT" else f"{method} {target}")
        destination = self.to(target) if method == "CONNECT" and ours else None
        if destination is None:
            writer.write(
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await _join(reader, writer, *destination)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


@contextlib.asynccontextmanager
async def serving(*servers: TlsFront | ConnectProxy) -> AsyncIterator[None]:
    """Each server listening on loopback, in this event loop, until the block ends."""
    for server in servers:
        await server.start()
    try:
        yield
    finally:
        for server in servers:
            await server.stop()
