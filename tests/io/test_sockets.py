"""Stream socket set-up: congestion control choice and socket buffers (no traffic)."""
import socket

import pytest

from wanlink.errors import ConfigError
from wanlink.io.sockets import available_congestion_controls, configure_stream_socket, congestion_of


def fresh():
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


def test_loopback_peer_keeps_the_system_default():
    with fresh() as sock:
        default = congestion_of(sock)
        configure_stream_socket(sock, peer_host="127.0.0.1")
        assert congestion_of(sock) == default and not sock.getblocking()
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.skipif("bbr" not in available_congestion_controls(), reason="kernel offers no bbr")
def test_remote_peer_gets_bbr_by_default():
    with fresh() as sock:
        configure_stream_socket(sock, peer_host="198.18.0.2")
        assert congestion_of(sock) == "bbr"


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="no TCP_NOTSENT_LOWAT")
def test_remote_peer_limits_unsent_bytes_loopback_does_not():
    from wanlink.io.sockets import NOTSENT_LOWAT_BYTES

    with fresh() as remote, fresh() as local:
        configure_stream_socket(remote, peer_host="198.18.0.2")
        configure_stream_socket(local, peer_host="127.0.0.1")
        lowat = socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT
        assert remote.getsockopt(*lowat) == NOTSENT_LOWAT_BYTES
        assert local.getsockopt(*lowat) != NOTSENT_LOWAT_BYTES


def test_explicit_choice_and_unknown_algorithm():
    choice = available_congestion_controls()[0]
    with fresh() as sock:
        configure_stream_socket(sock, congestion=choice, peer_host="127.0.0.1")
        assert congestion_of(sock) == choice
    with fresh() as sock, pytest.raises(ConfigError, match="no-such-cc"):
        configure_stream_socket(sock, congestion="no-such-cc")


def test_socket_buffer_option():
    with fresh() as sock:
        configure_stream_socket(sock, buffer_bytes=1 << 20, peer_host="127.0.0.1")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 1 << 20
    with fresh() as sock, pytest.raises(ConfigError):
        configure_stream_socket(sock, buffer_bytes=0)


@pytest.mark.asyncio
async def test_kernel_bytes_acked_counts_what_the_peer_kernel_received():
    import asyncio

    from tests.support.links import open_pair

    pair = await open_pair(2)
    try:
        before = pair.client.kernel_bytes_acked()
        out = bytearray(3_000_000)
        await asyncio.gather(pair.client.send(bytes(3_000_000), tag=1), pair.accepted.recv_into(out, tag=1))
        after = pair.client.kernel_bytes_acked()
        assert before is not None and after - before >= 3_000_000  # payload plus frame headers
    finally:
        await pair.close()
