"""Process-wide registry of open links and servers, for ``wanlink.stats()`` and clean shutdown."""
from __future__ import annotations

import asyncio
import concurrent.futures
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
    return {key: link.stats() for key, link in _keyed_links().items()}


def _keyed_links() -> dict:
    """The open links by the key ``stats()`` shows them under."""
    out = {}
    for link in sorted(_links, key=lambda link: link.name):
        key = link.name
        if "peer_rank" in link.labels:
            key = f"rank {link.labels['peer_rank']}"
            if key in out:
                key = f"{key} ({link.name})"
        out[key] = link
    return out


def pending(timeout: float = 2.0) -> dict[str, dict]:
    """Per open link, what it still sends and awaits (``Link.pending``), keyed as ``stats()``; from
    any thread. A link whose event loop does not answer within ``timeout`` seconds says so instead
    (its loop thread is blocked: the stacks show where)."""
    out: dict[str, dict] = {}
    for key, link in _keyed_links().items():
        try:
            running_here = asyncio.get_running_loop() is link.loop
        except RuntimeError:
            running_here = False
        if running_here:
            out[key] = link.pending()
            continue
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def ask(link=link, answer=answer):
            try:
                answer.set_result(link.pending())
            except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a diagnostic
                answer.set_result({"error": repr(exc)})

        try:
            link.loop.call_soon_threadsafe(ask)
            out[key] = answer.result(timeout)
        except RuntimeError as exc:  # its loop is closed
            out[key] = {"error": f"its event loop is gone ({exc})"}
        except concurrent.futures.TimeoutError:
            out[key] = {"error": f"its event loop did not answer within {timeout:g} s (blocked)"}
    return out


async def close_all_on(loop: asyncio.AbstractEventLoop) -> None:
    """Close every server and link that lives on ``loop`` (runtime shutdown)."""
    for server in [s for s in list(_servers) if s.loop is loop]:
        server.close()
    await asyncio.gather(*(link.close(grace=0.2) for link in list(_links) if link.loop is loop),
                         return_exceptions=True)
