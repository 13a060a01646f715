"""A training loop that calls wanlink collectives directly (no DDP).

Parameters start equal via ``broadcast``; each step's gradients are flattened into one buffer and
averaged with an asynchronous ``all_reduce(AVG)`` while the loss is being logged; per-rank
metrics are collected with ``all_gather_into_tensor``.

    torchrun --nproc-per-node 3 examples/custom_loop.py --steps 200
"""
import argparse

import torch
import torch.distributed as dist
import wanlink  # noqa: F401 - makes sure backend "wanlink" is registered even with autoload off
from wanlink.cli.demo import load_split  # the synthetic 10-class data set wanlink-demo trains on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    dist.init_process_group("wanlink")
    rank, world = dist.get_rank(), dist.get_world_size()
    features, labels, test_features, test_labels = load_split()
    generator = torch.Generator().manual_seed(rank)  # every rank draws its own batches

    torch.manual_seed(rank)  # deliberately different initialisations ...
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    for parameter in model.parameters():  # ... made equal by rank 0's broadcast
        dist.broadcast(parameter.data, src=0)
    parameters = list(model.parameters())
    optimiser = torch.optim.SGD(parameters, lr=0.2)

    for step in range(1, args.steps + 1):
        index = torch.randint(0, len(labels), (args.batch,), generator=generator)
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(features[index]), labels[index])
        loss.backward()
        flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
        work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True)
        losses = torch.empty(world)
        dist.all_gather_into_tensor(losses, loss.detach().reshape(1))  # overlaps the gradient exchange
        work.wait()
        offset = 0
        for parameter in parameters:
            parameter.grad.copy_(flat[offset:offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
        optimiser.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss per rank {[round(x, 3) for x in losses.tolist()]}")

    checksum = torch.cat([p.detach().reshape(-1) for p in parameters]).sum().reshape(1)
    everyone = torch.empty(world)
    dist.all_gather_into_tensor(everyone, checksum)
    with torch.no_grad():
        accuracy = (model(test_features).argmax(1) == test_labels).float().mean()
    if rank == 0:
        print(f"test accuracy {accuracy:.2%}; parameters identical on all ranks: "
              f"{bool((everyone == everyone[0]).all())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
