"""DistributedDataParallel over wanlink, launched by torchrun.

    torchrun --nproc-per-node 4 examples/ddp_torchrun.py --epochs 10

torchrun provides the Store (MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE); wanlink publishes each
rank's listening address through it. Set WANLINK_SECRET on every node for links between hosts
(see docs/c10d.md). No ``import wanlink`` is needed when wanlink is installed: torch loads the
backend through its entry points.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from wanlink.cli.demo import load_split  # the synthetic 10-class data set wanlink-demo trains on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    dist.init_process_group("wanlink")  # env:// rendezvous from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y, test_x, test_y = load_split()
    shard_x, shard_y = train_x[rank::world], train_y[rank::world]

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        started = time.perf_counter()
        for start in range(0, len(shard_y) - args.batch + 1, args.batch):
            batch = slice(start, start + args.batch)
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(model(shard_x[batch]), shard_y[batch]).backward()
            optimiser.step()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean()
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {accuracy:.2%} ({time.perf_counter() - started:.2f} s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
