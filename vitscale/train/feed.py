"""Micro-batches for the step with their images already on the device: the next one read ahead, its copy
to the GPU queued on a side stream while the GPU still runs the current one.

A GPU step ends with a read of its loss (`train/step.py`), after which the GPU has nothing queued: until the
host queues the next forward pass it idles through the loop's bookkeeping, the loader's hand-over of the
next batch, and, on the compute stream ahead of the first kernel, that batch's copy to the device (38.5 MB
of uint8 for 256 images at 224 px: about a millisecond over PCIe, 1-2% of a ViT-B/16 step on an H200).
`Feed.ahead` reads the next micro-batch once the current step's work is queued and before its read, and
queues the image copy on a stream of its own, which the copy engine runs beside the update's kernels; the
next `take` makes the compute stream wait for that copy on the GPU, not on the host (torch's pattern for
side-stream copies: `wait_stream`, then `record_stream` so the allocator keeps the memory until the compute
stream is done with it). Which samples a step consumes does not change, only when they are read: the
stream's position and its checkpoint are functions of the step (`train/worker.py`), and the loop reads ahead
only within an epoch. Nor where an error surfaces: whatever reading ahead raises (a one-rank stream raising
`ErrorBudgetExceeded` as it reads a bad sample, a dead loader) is raised by the `take` that wanted the
batch, as reading it then would have, so the step before ends, checkpoints and reports as it did. On a CPU
there is no copy to hide; the read ahead is the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Feed"]


class Feed:
    """Takes micro-batches from the loader's iterator for `Stepper`, one read ahead where asked.

    Args:
        device: where the images go.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.next: tuple[Iterator[dict[str, Any]], dict[str, Any], torch.Tensor] | None = None
        """The micro-batch read ahead: (the iterator it came from, the micro-batch, its images on the device)."""
        self.failed: tuple[Iterator[dict[str, Any]], Exception] | None = None
        """What reading ahead raised instead: (the iterator, the error), for the `take` that wanted the batch."""

    def take(self, batches: Iterator[dict[str, Any]]) -> tuple[dict[str, Any], torch.Tensor, float]:
        """(the next micro-batch of `batches`, its images on the device, seconds waited for the loader).

        The one read ahead from `batches`, if any; one read ahead from another iterator (an epoch the loop has
        since left) is dropped."""
        ahead, self.next = self.next, None
        failed, self.failed = self.failed, None
        if failed is not None and failed[0] is batches:
            raise failed[1]
        if ahead is None or ahead[0] is not batches:
            micro, waited = _read(batches)
            return micro, micro["image"].to(self.device, non_blocking=True), waited
        _, micro, pixels = ahead
        if self.copies is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copies)
            pixels.record_stream(compute)
        return micro, pixels, 0.0

    def ahead(self, batches: Iterator[dict[str, Any]]) -> float:
        """Read the next micro-batch of `batches` now and queue its images' copy to the device; the seconds
        waited for the loader. The caller's next `take(batches)` gets it."""
        started = time.perf_counter()
        try:
            micro, waited = _read(batches)
        except Exception as error:  # noqa: BLE001 -- kept, and raised where the batch is wanted (`take`)
            self.failed = (batches, error)
            return time.perf_counter() - started
        if self.copies is None:
            pixels = micro["image"].to(self.device, non_blocking=True)
        else:
            # Nothing to wait for: the source is pinned and ready, the destination new from the side stream's own
            # pool (a block the compute stream used comes back only once it is done with it: `record_stream`).
            with torch.cuda.stream(self.copies):
                pixels = micro["image"].to(self.device, non_blocking=True)
        self.next = (batches, micro, pixels)
        return waited


def _read(batches: Iterator[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """The next micro-batch of `batches`, and the seconds waited for it."""
    started = time.perf_counter()
    micro = next(batches)
    return micro, time.perf_counter() - started
