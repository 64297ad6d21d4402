"""Health and metrics over HTTP: `/livez`, `/readyz`, `/metrics` (aiohttp).

Liveness means "the worker is making progress and its pool is usable", not "the
process exists": a restart is the right answer only to the first being false.
Readiness means "warmed up, not draining, an inference process able to run (or one
restarting), and the last receive worked".
"""

from __future__ import annotations

import logging
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics import exposition as openmetrics

from sqsinfer.logs import Event

log = logging.getLogger("sqsinfer.health")


class Probed(Protocol):
    def livez(self) -> tuple[bool, str]: ...

    def readyz(self) -> tuple[bool, str]: ...

    def metrics_text(self, openmetrics_format: bool = False) -> bytes: ...


def _answer(result: tuple[bool, str]) -> web.Response:
    ok, why = result
    return web.Response(status=200 if ok else 503, text=("ok" if ok else why) + "\n")


class HealthServer:
    def __init__(self, target: Probed, host: str, port: int) -> None:
        self.target = target
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None)
        if self.port == 0 and sockets:  # report the port the OS picked
            self.port = int(sockets[0].getsockname()[1])
        log.info(Event.HEALTH_SERVER_LISTENING, extra={"host": self.host, "port": self.port})

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _livez(self, _: web.Request) -> web.Response:
        return _answer(self.target.livez())

    async def _readyz(self, _: web.Request) -> web.Response:
        return _answer(self.target.readyz())

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, or OpenMetrics (with the exemplars) when the scraper asks for it."""
        wanted = _wants_openmetrics(request.headers.get("Accept", ""))
        content_type = openmetrics.CONTENT_TYPE_LATEST if wanted else CONTENT_TYPE_LATEST
        return web.Response(
            body=self.target.metrics_text(wanted), headers={"Content-Type": content_type}
        )


def _wants_openmetrics(accept: str) -> bool:
    """As prometheus_client decides: any `application/openmetrics-text` in Accept."""
    return any(
        part.split(";", 1)[0].strip() == "application/openmetrics-text"
        for part in accept.split(",")
    )
