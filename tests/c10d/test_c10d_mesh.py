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

    from wanlink.c10d.mesh import ADDRESS_KEY, LOCAL_KEY, SITE_KEY, WORLD_KEY, Mesh
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
