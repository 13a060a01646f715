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
