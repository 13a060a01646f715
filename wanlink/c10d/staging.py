"""Flat, contiguous CPU working buffers for user tensors (non-contiguous views, CUDA tensors).

Algorithms only ever see 1-D contiguous CPU tensors. A contiguous CPU tensor is used in place; any
other tensor gets a working copy (pinned host memory for CUDA) that is written back when the
collective finishes.
"""
from __future__ import annotations

import torch


def _in_place_ok(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")


class Staging:
    """Hands out working buffers and remembers which must be copied back to user tensors."""

    def __init__(self) -> None:
        self._write_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """A flat buffer holding ``tensor``'s values; treat it as read-only."""
        if _in_place_ok(tensor):
            return tensor.detach().reshape(-1)
        buffer = _host_buffer(tensor)
        buffer.view(tensor.shape).copy_(tensor.detach())
        return buffer

    def scratch(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private flat copy of ``tensor`` that an algorithm may overwrite."""
        return tensor.detach().reshape(-1).to("cpu", copy=True).contiguous()

    def write(self, tensor: torch.Tensor, fill: bool = False) -> torch.Tensor:
        """A flat buffer whose final contents become ``tensor``'s; ``fill`` copies the values in first."""
        if _in_place_ok(tensor):
            return tensor.detach().reshape(-1)
        buffer = _host_buffer(tensor)
        if fill:
            buffer.view(tensor.shape).copy_(tensor.detach())
        self._write_back.append((tensor, buffer))
        return buffer

    def finish(self) -> None:
        """Copy working buffers back into the user tensors they stand for."""
        if not self._write_back:
            return
        with torch.no_grad():
            for tensor, buffer in self._write_back:
                tensor.copy_(buffer.view(tensor.shape))


def copy_parts(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive parts of ``flat`` into ``tensors`` (any layout, any device)."""
    with torch.no_grad():
        for tensor, part in zip(tensors, flat.split([tensor.numel() for tensor in tensors])):
            tensor.copy_(part.view(tensor.shape))
