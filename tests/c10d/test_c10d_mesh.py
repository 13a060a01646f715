"""How a world's members link: Unix sockets between processes of one host, TCP otherwise."""
import torch
import torch.distributed as dist

from tests.support.worlds import run_world


def link_families(rank, size):
    import wanlink

    tensor = torch.full((1 << 20,), float(rank + 1))
    dist.all_reduce(tensor)
    return sorted(s["peer"].split(":", 1)[0] for s in wanlink.stats().values()), float(tensor[0])


def test_members_of_one_host_link_over_unix_sockets_unless_turned_off():
    for peers, total in run_world(3, link_families):
        assert peers == ["unix", "unix"] and total == 6.0
    for peers, total in run_world(3, link_families, env={"WANLINK_UNIX": "0"}):
        assert peers == ["127.0.0.1", "127.0.0.1"] and total == 6.0


def test_failed_rendezvous_closes_the_server_and_the_links_made_so_far():
    """Rank 2 of 3 links to rank 0 (a real server here), then its link to rank 1 fails (a plain
    socket that accepts and hangs up): the Mesh must close its server and its link to rank 0."""
    import asyncio
    import socket
    import threading
    from datetime import timedelta

    import pytest

    from wanlink.c10d.mesh import ADDRESS_KEY, LOCAL_KEY, SITE_KEY, SIZE_KEY, WORLD_KEY, Mesh
    from wanlink.endpoints import serve
    from wanlink.errors import PeerLost
    from wanlink.io.runtime import get_runtime
    from wanlink.settings import Settings

    runtime = get_runtime()
    accepted, linked = [], threading.Event()

    def on_link(link):
        accepted.append(link)
        linked.set()

    server = runtime.run(serve("127.0.0.1", 0, secret="s", on_link=on_link))
    hang_up = socket.create_server(("127.0.0.1", 0))

    def refuse_after_rank_0_linked():
        linked.wait(60)
        connection, _ = hang_up.accept()
        connection.close()

    refuser = threading.Thread(target=refuse_after_rank_0_linked)
    refuser.start()
    store = dist.HashStore()
    store.set(WORLD_KEY, "world")
    store.set(ADDRESS_KEY.format(rank=0), f"127.0.0.1:{server.port}")
    store.set(ADDRESS_KEY.format(rank=1), f"127.0.0.1:{hang_up.getsockname()[1]}")
    for rank in (0, 1):
        store.set(SIZE_KEY.format(rank=rank), "3")
        store.set(LOCAL_KEY.format(rank=rank), " ")
        store.set(SITE_KEY.format(rank=rank), "here")
    try:
        with pytest.raises(PeerLost, match="rank 2 -> rank 1"):
            Mesh(store, 2, 3, timedelta(seconds=60), Settings(secret="s", streams=1, unix=False))
    finally:
        refuser.join()
        hang_up.close()
        server.close()
    own_port = int(store.get(ADDRESS_KEY.format(rank=2)).decode().rpartition(":")[2])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", own_port), timeout=10).close()
    [link] = accepted  # rank 0's side of the link rank 2 made before failing: rank 2 closed it
    with pytest.raises(PeerLost):
        runtime.run(asyncio.wait_for(link.recv_into(bytearray(1), tag=1), 60))


def test_a_world_size_mismatch_fails_every_rank_at_rendezvous_naming_both_sizes():
    """Rank 0 started with world size 3, rank 1 with 2: both fail at once (not at the init timeout)."""
    import threading
    from datetime import timedelta

    from wanlink.c10d.mesh import Mesh
    from wanlink.errors import ConfigError
    from wanlink.settings import Settings

    store = dist.HashStore()
    errors = {}

    def member(rank, size):
        try:
            Mesh(store, rank, size, timedelta(seconds=120), Settings(secret="s", streams=1, unix=False))
        except BaseException as error:  # noqa: BLE001 - collected
            errors[rank] = error

    threads = [threading.Thread(target=member, args=(0, 3)), threading.Thread(target=member, args=(1, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    for rank in (0, 1):
        assert isinstance(errors[rank], ConfigError), errors
        assert "world size mismatch" in str(errors[rank])
    assert "rank 0 was started with world size 3, rank 1 with 2" in str(errors[0])
    assert "rank 1 was started with world size 2, rank 0 with 3" in str(errors[1])


def test_a_lost_store_is_reported_as_lost_not_as_a_timeout(tmp_path):
    import socket
    import subprocess
    import sys
    from datetime import timedelta

    import pytest

    from wanlink.c10d.mesh import _store_get
    from wanlink.errors import PeerLost

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    host = subprocess.Popen([sys.executable, "-c",
                             "import time, torch.distributed as d; "
                             f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); "
                             "print('up', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    try:
        assert host.stdout.readline().strip() == b"up"
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
        client.set("here", "1")
    finally:
        host.kill()
        host.wait()
    with pytest.raises(PeerLost, match="lost the torch Store .* rank 2 of 3 to join"):
        _store_get(client, "wanlink/size/2", timedelta(seconds=60), "rank 2 of 3 to join")
