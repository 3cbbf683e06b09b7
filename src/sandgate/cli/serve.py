"""Running the API instance under uvicorn, without uvicorn's own signal handling."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import uvicorn

from sandgate.api.app import create_app
from sandgate.config import ServerSettings


class _Server(uvicorn.Server):
    """The caller decides when to stop (`should_exit`); signals are its business."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def make_server(settings: ServerSettings, *, own_signals: bool) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        ws="websockets-sansio",
        ws_max_size=16 << 20,
        # a silent WebSocket (a worker's tunnel in a partition) is dropped within ~15 s
        ws_ping_interval=5,
        ws_ping_timeout=10,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=10,
        lifespan="on",
    )
    return uvicorn.Server(config) if own_signals else _Server(config)
