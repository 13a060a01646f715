"""Process-wide registry of open links, for ``wanlink.stats()``."""
from __future__ import annotations

import weakref

_links: "weakref.WeakSet" = weakref.WeakSet()


def register(link) -> None:
    _links.add(link)


def unregister(link) -> None:
    _links.discard(link)


def stats() -> dict[str, dict]:
    """Per open link (keyed ``peer/link-id``): bytes, chunks per stream, streams alive, re-queued chunks, rates."""
    return {link.name: link.stats() for link in list(_links)}
