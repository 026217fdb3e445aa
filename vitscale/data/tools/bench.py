"""Loader throughput: ``vitscale shards bench DEST`` and the pieces ``benchmarks/`` reuse.

Throughput is reported two ways: images per wall-clock second, and images per CPU-second (all
processes of the loader: this one plus its worker processes). The second is "images/s per core":
it is what a loader costs, and it stays meaningful on a busy machine where wall-clock rates swing
with the neighbours' load.
"""

from __future__ import annotations

import itertools
import resource
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch

from vitscale.config.checks import positive
from vitscale.data.loader.stream import ShardStream, StreamSpec

__all__ = ["cpu_seconds", "measure", "run_bench"]


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its finished (joined) child processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(
    make_batches: Callable[[], Iterable[Any]],
    batch_images: Callable[[Any], int],
    seconds: float,
    warmup_batches: int = 2,
) -> dict[str, float]:
    """Pull batches from ``make_batches()`` for about ``seconds`` after ``warmup_batches``.

    ``make_batches`` may return a finite iterable (one epoch); it is called again until the time
    is up. Worker processes must be gone when an epoch's iterator is dropped (DataLoader does
    this) or, for an iterable with a ``close()`` (a ``ShardStream``, whose loader reads on from
    one epoch into the next), once it is closed at the end, so their CPU time is counted. Returns
    images, wall_s, cpu_s, images_per_s, images_per_cpu_s and startup_s (time to the first batch).
    """
    positive(seconds, "seconds")
    sources: list[Iterable[Any]] = []

    def forever() -> Generator[Any, None, None]:
        for _ in itertools.count():
            got = False
            sources[:] = [make_batches()]
            for batch in sources[0]:
                got = True
                yield batch
            if not got:
                raise ValueError("the loader yielded no batches")

    t_start = time.perf_counter()
    it = forever()
    for _ in range(warmup_batches):
        next(it)
    startup = time.perf_counter() - t_start
    images = 0
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    while time.perf_counter() - wall0 < seconds:
        images += batch_images(next(it))
    wall = time.perf_counter() - wall0
    it.close()  # drops the epoch's loader: its workers exit and are joined before we read CPU time
    close = getattr(sources[0], "close", None) if sources else None
    if close is not None:
        close()  # a stream's loader, kept for its next epoch: stopped and joined likewise
    cpu = cpu_seconds() - cpu0
    return {
        "images": float(images),
        "wall_s": wall,
        "cpu_s": cpu,
        "images_per_s": images / wall,
        "images_per_cpu_s": images / cpu if cpu > 0 else float("nan"),
        "startup_s": startup,
    }


def run_bench(spec: StreamSpec, *, seconds: float = 15.0) -> dict[str, Any]:
    """Throughput of the :class:`ShardStream` that `spec` describes (the loader's one list of settings).

    ``spec.num_workers=0`` decodes in this process, so ``images_per_s`` is the single-core rate; ``N>0``
    uses N DataLoader worker processes. Returns images_per_s, images_per_s_per_worker, images_per_cpu_s
    (per core, all processes counted), workers, images, seconds, startup_s, resolution, batch_size and
    skipped (bad samples met).
    """
    stream = ShardStream(spec)
    workers = max(1, spec.num_workers)
    # One intra-op thread while decoding in this process, as DataLoader sets in its workers: the
    # per-image resize is too small to gain from torch's thread pool.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = measure(lambda: stream, lambda b: len(b["key"]), seconds)
    finally:
        torch.set_num_threads(threads)
    return {
        "dataset": spec.url,
        "split": spec.split,
        "images_per_s": m["images_per_s"],
        "images_per_s_per_worker": m["images_per_s"] / workers,
        "images_per_cpu_s": m["images_per_cpu_s"],
        "workers": workers,
        "images": int(m["images"]),
        "seconds": m["wall_s"],
        "startup_s": m["startup_s"],
        "resolution": spec.resolution,
        "batch_size": spec.batch_size,
        "skipped": sum(stream.skipped().values()),
    }
