"""Loopback ports for tests that need one before a server exists (prefer port 0 handed to the server)."""
import contextlib
import socket


@contextlib.contextmanager
def refused_port():
    """A loopback port bound but not listening while the block runs: connecting to it is refused."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield bound.getsockname()[1]


def unused_port() -> int:
    """A port free a moment ago, for stock iperf3, which cannot report a port 0 it bound; callers retry."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
