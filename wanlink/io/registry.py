"""Process-wide registry of open links and servers, for ``wanlink.stats()`` and clean shutdown."""
from __future__ import annotations

import asyncio
import weakref

_links: "weakref.WeakSet" = weakref.WeakSet()
_servers: "weakref.WeakSet" = weakref.WeakSet()


def register(link) -> None:
    _links.add(link)


def unregister(link) -> None:
    _links.discard(link)


def register_server(server) -> None:
    _servers.add(server)


def unregister_server(server) -> None:
    _servers.discard(server)


def stats() -> dict[str, dict]:
    """Per open link: bytes, chunks per stream, streams alive, re-queued chunks, rates.

    Keyed ``rank N`` where the layers above labelled the link with its peer's rank (the torch
    backend does), else ``peer/link-id``; a second link to one rank is keyed ``rank N (peer/link-id)``.
    """
    out: dict[str, dict] = {}
    for link in sorted(_links, key=lambda link: link.name):
        key = link.name
        if "peer_rank" in link.labels:
            key = f"rank {link.labels['peer_rank']}"
            if key in out:
                key = f"{key} ({link.name})"
        out[key] = link.stats()
    return out


async def close_all_on(loop: asyncio.AbstractEventLoop) -> None:
    """Close every server and link that lives on ``loop`` (runtime shutdown)."""
    for server in [s for s in list(_servers) if s.loop is loop]:
        server.close()
    await asyncio.gather(*(link.close(grace=0.2) for link in list(_links) if link.loop is loop),
                         return_exceptions=True)
