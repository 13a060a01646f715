import pytest_asyncio

from tests.support.links import open_pair


@pytest_asyncio.fixture
async def pair():
    """A server and a connected 4-stream client link over loopback, closed after the test."""
    p = await open_pair()
    yield p
    await p.close()
