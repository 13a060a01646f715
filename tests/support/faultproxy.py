"""A fault-injecting TCP proxy for transport tests: cut connections, stall forwarding, read or
rewrite what passes (an on-path attacker)."""
from __future__ import annotations

import asyncio


class _Pipe:
    def __init__(self, client_writer: asyncio.StreamWriter, upstream_writer: asyncio.StreamWriter):
        self.writers = (client_writer, upstream_writer)
        self.bytes_up = 0
        self.tasks: list[asyncio.Task] = []

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()


class FaultProxy:
    """Forwards 127.0.0.1:<port> to a target. ``cut(i)`` kills the i-th accepted connection
    (both directions, as a broken path would), ``stall()``/``resume()`` stop and restart forwarding,
    and ``cut_after(i, nbytes)`` kills connection i once it has carried nbytes client->server.
    ``rewrite = fn`` passes every forwarded piece through ``fn(upstream, data) -> data``.
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.pipes: list[_Pipe] = []
        self.connected = asyncio.Condition()
        self._running = asyncio.Event()
        self._running.set()
        self._cut_after: dict[int, int] = {}
        self._server: asyncio.Server | None = None
        self.rewrite = None

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> "FaultProxy":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pipe = _Pipe(writer, up_writer)
        index = len(self.pipes)
        self.pipes.append(pipe)
        pipe.tasks = [asyncio.create_task(self._forward(reader, up_writer, pipe, index, True)),
                      asyncio.create_task(self._forward(up_reader, writer, pipe, index, False))]
        async with self.connected:
            self.connected.notify_all()

    async def _forward(self, reader, writer, pipe: _Pipe, index: int, upstream: bool) -> None:
        try:
            while True:
                data = await reader.read(256 * 1024)
                if not data:
                    break
                await self._running.wait()
                if self.rewrite is not None:
                    data = self.rewrite(upstream, data)
                writer.write(data)
                await writer.drain()
                if upstream:
                    pipe.bytes_up += len(data)
                    limit = self._cut_after.get(index)
                    if limit is not None and pipe.bytes_up >= limit:
                        pipe.cut()
                        return
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def wait_connections(self, count: int) -> None:
        async with self.connected:
            await self.connected.wait_for(lambda: len(self.pipes) >= count)

    def cut(self, index: int) -> None:
        self.pipes[index].cut()

    def cut_after(self, index: int, nbytes: int) -> None:
        self._cut_after[index] = nbytes

    def stall(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def close(self) -> None:
        self._running.set()
        self._server.close()
        for pipe in self.pipes:
            pipe.cut()
        tasks = [t for pipe in self.pipes for t in pipe.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
