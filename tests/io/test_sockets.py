"""Stream socket set-up: congestion control choice and socket buffers (no traffic)."""
import contextlib
import platform
import re
import socket
import sys
import time

import pytest

from wanlink.errors import ConfigError
from wanlink.io.sockets import UNIX_BUFFER_BYTES, available_congestion_controls, configure_stream_socket, congestion_of


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


def test_unix_sockets_get_room_for_a_whole_chunk():
    """No autotuning on Unix sockets: at the kernel's default a 1 MiB chunk needs several writable turns."""
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        configure_stream_socket(left)
        assert left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(UNIX_BUFFER_BYTES, cap)
        configure_stream_socket(right, buffer_bytes=64 * 1024)  # an explicit size wins
        assert right.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < min(UNIX_BUFFER_BYTES, cap)


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


def test_tcp_info_layout_follows_linux_struct():
    from wanlink.io.sockets import _TCP_INFO_OFFSETS, TCP_INFO_BYTES

    # offsets from include/uapi/linux/tcp.h, counted by hand
    expected = {"snd_mss": 16, "sacked": 28, "pmtu": 60, "rtt": 68, "snd_cwnd": 80, "total_retrans": 100,
                "pacing_rate": 104, "bytes_acked": 120, "min_rtt": 148, "delivery_rate": 160, "bytes_sent": 200,
                "snd_wnd": 228}
    assert {name: _TCP_INFO_OFFSETS[name][0] for name in expected} == expected
    assert TCP_INFO_BYTES == 232


def test_tcp_info_layout_matches_the_installed_header(tmp_path):
    """Every field's offset as the C compiler computes it from <linux/tcp.h> (skipped without cc or header)."""
    import os
    import shutil
    import subprocess

    from wanlink.io.sockets import _TCP_INFO_OFFSETS

    header = "/usr/include/linux/tcp.h"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not os.path.exists(header):
        pytest.skip("no C compiler or no linux/tcp.h")
    with open(header) as f:
        text = f.read()
    bitfields = {"wscale", "app_limited_flags"}
    names = [n for n in _TCP_INFO_OFFSETS if n not in bitfields and f"tcpi_{n};" in text]
    prints = "".join(f'printf("{n} %zu\\n", offsetof(struct tcp_info, tcpi_{n}));' for n in names)
    source = tmp_path / "offsets.c"
    source.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <linux/tcp.h>\n"
                      f"int main(void) {{ {prints} return 0; }}\n")
    subprocess.run([compiler, str(source), "-o", str(tmp_path / "offsets")], check=True)
    out = subprocess.run([str(tmp_path / "offsets")], check=True, capture_output=True, text=True).stdout
    measured = {name: int(offset) for name, offset in (line.split() for line in out.splitlines())}
    assert measured == {name: _TCP_INFO_OFFSETS[name][0] for name in names}
    assert len(names) >= 50


def test_parse_tcp_info_leaves_fields_the_kernel_lacks_unset():
    from wanlink.io.sockets import _TCP_INFO_OFFSETS, TCP_INFO_BYTES, parse_tcp_info

    raw = bytearray(TCP_INFO_BYTES)
    for name, value in (("snd_mss", 1448), ("snd_cwnd", 10), ("rtt", 40000), ("total_retrans", 7),
                        ("bytes_acked", 1 << 40), ("snd_wnd", 65536)):
        offset, field = _TCP_INFO_OFFSETS[name]
        field.pack_into(raw, offset, value)
    full = parse_tcp_info(bytes(raw))
    assert (full.cwnd_bytes, full.rtt, full.total_retrans, full.bytes_acked, full.snd_wnd) == \
        (14480, 40000, 7, 1 << 40, 65536)
    old = parse_tcp_info(bytes(raw[:104]))  # a Linux 2.6-3.14 struct
    assert old.total_retrans == 7 and old.bytes_acked is None and old.snd_wnd is None
    pre_5_4 = parse_tcp_info(bytes(raw[:228]))
    assert pre_5_4.bytes_acked == 1 << 40 and pre_5_4.snd_wnd is None
    assert parse_tcp_info(bytes(raw[:103])) is None


def test_tcp_info_reads_the_kernel_counters():
    from wanlink.io.sockets import tcp_bytes_acked, tcp_info

    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as conn:
            peer, _ = listener.accept()
            with peer:
                conn.sendall(b"x" * 100000)
                received = 0
                while received < 100000:
                    received += len(peer.recv(65536))
                info = tcp_info(conn)
                if info is None:
                    pytest.skip("no TCP_INFO on this platform")
                acked = tcp_bytes_acked(conn)
    # loopback loses nothing, but on a loaded host a tail-loss probe or spurious timeout counts as a retransmit
    assert 0 <= info.total_retrans <= 100000 // info.snd_mss and info.pmtu >= 1500 and info.snd_mss > 0
    assert info.cwnd_bytes >= info.pmtu // 2 and info.rttvar >= 0  # rtt itself may read 0 µs on loopback
    if info.snd_wnd is not None:  # Linux 5.4 and later
        assert info.snd_wnd > 0
    if info.bytes_acked is not None:  # 4.1 and later; read twice: acks may arrive in between
        assert info.bytes_acked <= acked <= 100001  # the SYN counts as one byte


def test_tcp_send_progress_counts_bytes_given_to_the_kernel_and_acknowledged():
    from wanlink.io.sockets import tcp_send_progress

    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as conn:
            peer, _ = listener.accept()
            with peer:
                if tcp_send_progress(conn) is None:
                    pytest.skip("no TCP_INFO bytes_sent on this platform (Linux 4.19+)")
                conn.sendall(b"x" * 100000)
                peer.sendall(b"y" * 3000)
                received = 0
                while received < 100000:
                    received += len(peer.recv(65536))
                conn.recv(3000, socket.MSG_WAITALL)
                for _ in range(1000):  # the last acks may still be on their way
                    (given, acked), (peer_given, peer_acked) = tcp_send_progress(conn), tcp_send_progress(peer)
                    if acked >= given and peer_acked >= peer_given:
                        break
                    time.sleep(0.01)
    assert (given, acked) == (100000, 100001)  # the connecting side counts its SYN
    assert (peer_given, peer_acked) == (3000, 3000)
    with socket.socket(socket.AF_UNIX) as unix:
        assert tcp_send_progress(unix) is None


def _linux_release() -> tuple[int, ...]:
    """The running Linux kernel's version, (0,) elsewhere."""
    if sys.platform != "linux":
        return (0,)
    return tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])


def test_tcp_send_room_is_the_congestion_window_less_what_waits_in_it_and_notsent_what_waits():
    from wanlink.io.sockets import tcp_info, tcp_notsent_bytes, tcp_send_room

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the peer reads nothing: its window fills
        with socket.create_connection(listener.getsockname()) as conn:
            peer, _ = listener.accept()
            with peer:
                if tcp_info(conn) is None or _linux_release() < (4, 6):  # (not from tcp_send_room's None:
                    pytest.skip("no TCP_INFO notsent_bytes on this platform (Linux 4.6+)")  # that is the test)
                assert tcp_send_room(conn) == tcp_info(conn).cwnd_bytes  # idle: the whole window
                assert tcp_notsent_bytes(conn) == 0  # nothing given to the kernel yet
                conn.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    for _ in range(1000):
                        conn.send(b"x" * 65536)
                assert tcp_send_room(conn) < 0  # more queued than the window can send
                assert tcp_notsent_bytes(conn) > 0  # held back unsent (the striped routes' hand-over)
    with socket.socket(socket.AF_UNIX) as unix:
        assert tcp_send_room(unix) is None and tcp_notsent_bytes(unix) is None
