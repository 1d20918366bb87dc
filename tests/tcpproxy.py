"""A TCP proxy for tests that need a real service to vanish and come back (Redis outages, recoveries).

``up`` forwards bytes both ways; ``blackhole`` accepts connections and sends nothing anywhere, as a
partitioned network does; ``stop`` refuses connections and cuts the ones open.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


class TCPProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = _free_port()
        self.mode = "up"
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self, mode: str = "up") -> TCPProxy:
        self.mode = mode
        if self._server is None:
            self._server = await asyncio.start_server(
                self._client, "127.0.0.1", self.port, reuse_address=True
            )
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self.mode == "blackhole":
            with contextlib.suppress(Exception):
                await reader.read()  # hold the connection, answer nothing
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
