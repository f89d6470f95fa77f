"""An ingress replica serving HTTP itself (`serve.http: direct`), without Ray Serve's proxy.

Behind Serve's proxy every request costs one Ray call from the proxy to the replica (and one
more for the replica to fetch the body), and every streamed chunk one more Ray message back
to the proxy, on the same cores the engines compute on. vLLM's own server and Ray Serve's
experimental direct-ingress mode answer HTTP in the process that runs the request; so does
this: uvicorn in the replica's event loop, on `serve.host:serve.port` of the replica's node.
The socket is opened with SO_REUSEPORT, so the replicas on one node share the port and the
kernel spreads connections among them. Serve still starts, places, health-checks and
restarts the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

# A replica that is stopped stops accepting at once and gives requests in flight this long.
GRACEFUL_STOP_S = 15.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the replica's process belongs to Ray."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DirectHTTP:
    """`app` served on host:port from the running event loop until stop()."""

    def __init__(self, app: ASGIApp, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self.sock.bind((host, port))
        except OSError as err:
            self.sock.close()
            raise RuntimeError(f"the ingress cannot listen on {host}:{port} ({err}); another program holds the port: "
                               "stop it or set serve.port") from None
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                                timeout_graceful_shutdown=GRACEFUL_STOP_S)
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen, and return once connections are accepted (or raise why not)."""
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the ingress's HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        """Stop accepting; requests in flight get GRACEFUL_STOP_S to finish."""
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task
        self.sock.close()
