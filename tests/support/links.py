"""Linked pairs over loopback: a server and a connected client, optionally through a FaultProxy."""
import asyncio
import contextlib

import wanlink
from tests.support.faultproxy import FaultProxy

SECRET = b"test-secret"


class Pair:
    """A server and a connected client link, with the server's side of the link."""

    def __init__(self, server, client, accepted):
        self.server, self.client, self.accepted = server, client, accepted

    async def close(self):
        await self.client.close()
        await self.accepted.close()
        self.server.close()
        await self.server.wait_closed()


async def open_pair(streams=4, *, port=None, server_options=None, **client_options) -> Pair:
    links: asyncio.Queue = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, **(server_options or {}))
    client = await wanlink.connect("127.0.0.1", port or server.port, streams=streams, secret=SECRET,
                                   **client_options)
    accepted = await asyncio.wait_for(links.get(), 10)
    return Pair(server, client, accepted)


@contextlib.asynccontextmanager
async def proxied_pair(streams: int, *, timeout: float = 10.0, **client_options):
    """(proxy, client, accepted): a link whose every stream runs through a FaultProxy."""
    links: asyncio.Queue = asyncio.Queue()
    server = await wanlink.serve("127.0.0.1", 0, secret=SECRET, on_link=links.put_nowait, timeout=timeout)
    proxy = await FaultProxy(server.port).start()
    opened = []
    try:
        opened.append(await wanlink.connect("127.0.0.1", proxy.port, streams=streams, secret=SECRET, timeout=timeout,
                                            **client_options))
        opened.append(await asyncio.wait_for(links.get(), 5))
        yield proxy, opened[0], opened[1]
    finally:
        for link in opened:
            await link.close()
        await proxy.close()
        server.close()
        await server.wait_closed()
