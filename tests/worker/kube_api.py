"""A Kubernetes API stand-in for one pod: HTTPS on loopback, a service account's token
directory beside it, and every PATCH of the pod recorded.

It answers what the worker's deletion-cost keeper asks (a JSON merge patch of the pod's
metadata) the way the API server does: 401 without the token, 415 for another patch
type, 404 for another pod, 200 with the pod. `refuse` makes it answer 403 (RBAC) until
cleared.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sqsinfer.worker.pod_cost import ANNOTATION

TOKEN = "a-bound-service-account-token"
NAMESPACE = "inference"
POD = "stage1-sqsinfer-7d9f8-abcde"


@dataclass
class Patch:
    at: float  # monotonic
    cost: str | None
    authorized: bool
    answered: int


def _certificate(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca.crt, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = tmp / "ca.crt", tmp / "server.crt", tmp / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@dataclass
class KubeApi:
    tmp: Path
    patches: list[Patch] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    refuse: bool = False
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def token_dir(self) -> Path:
        return self.tmp / "serviceaccount"

    def environ(self) -> dict[str, str]:
        """What Kubernetes (and the chart's downward API) sets in the pod."""
        return {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.port),
            "POD_NAME": POD,
            "POD_NAMESPACE": NAMESPACE,
        }

    @property
    def cost(self) -> str | None:
        return self.annotations.get(ANNOTATION)

    def costs(self) -> list[str | None]:
        """The values the pod's annotation took, one per accepted patch."""
        return [p.cost for p in self.patches if p.answered == 200]

    async def start(self) -> None:
        ca, cert, key = _certificate(self.tmp)
        self.token_dir.mkdir()
        (self.token_dir / "token").write_text(TOKEN + "\n")
        (self.token_dir / "ca.crt").write_bytes(ca.read_bytes())
        (self.token_dir / "namespace").write_text(NAMESPACE)
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(cert, key)
        app = web.Application()
        app.router.add_patch("/api/v1/namespaces/{namespace}/pods/{name}", self._patch)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=tls)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _patch(self, request: web.Request) -> web.Response:
        authorized = request.headers.get("Authorization") == f"Bearer {TOKEN}"
        body: dict[str, Any] = json.loads(await request.text() or "{}")
        cost = body.get("metadata", {}).get("annotations", {}).get(ANNOTATION)
        status = self._answer(request, authorized)
        self.patches.append(Patch(time.monotonic(), cost, authorized, status))
        if status != 200:
            return web.json_response({"kind": "Status", "code": status}, status=status)
        self.annotations.update(body["metadata"]["annotations"])
        pod = {"metadata": {"name": POD, "namespace": NAMESPACE, "annotations": self.annotations}}
        return web.json_response(pod)

    def _answer(self, request: web.Request, authorized: bool) -> int:
        if not authorized:
            return 401
        if request.content_type != "application/merge-patch+json":
            return 415
        if (request.match_info["namespace"], request.match_info["name"]) != (NAMESPACE, POD):
            return 404
        return 403 if self.refuse else 200
