"""What the GPU did in each phase of a step, from a `torch.profiler` Chrome trace (pure).

A phase is a host range opened with `torch.profiler.record_function(name)` around one call of the step (a
`user_annotation` event on the host's thread). Its GPU work is every kernel, copy and memset whose launch (the
CUDA runtime or driver call, matched to the work by its `correlation` id) the host made inside that range, on
any thread: autograd launches a backward pass's kernels from its own device thread while the caller waits
inside `backward()`. Kineto's own `gpu_user_annotation` counts only the launches of the range's thread, so a
backward pass whose caller launched nothing itself showed 0.01 ms on the GPU (ZeRO 2 and 3, 2026-12-01).

Per phase: the GPU time of its work, its span on the GPU's timeline (first piece of its work starting to the
last ending) and the part of the span in which some GPU work ran, on any stream; the rest the GPU waited
inside the phase, for the host to launch the next kernel or for another stream. `benchmarks/mfu.py --profile`
reports them, and the work's kernels by time (`work_by_name`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""The trace categories of work a GPU does (`cat` in a Chrome trace from Kineto)."""

LAUNCHES = frozenset({"cuda_runtime", "cuda_driver"})
"""The trace categories of the host's CUDA calls, a launch among them."""


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    """How much of `span` the disjoint sorted intervals `busy` cover."""
    return sum(max(0.0, min(span[1], end) - max(span[0], start)) for start, end in busy)


def _interval(event: dict[str, Any]) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))


def _correlation(event: dict[str, Any]) -> Any:
    return (event.get("args") or {}).get("correlation")


def launched_work(events: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """Each piece of GPU work as (when the host launched it, its start, its end), sorted by the launch; work
    whose launch is not in the trace is left out."""
    launched_at = {_correlation(e): float(e["ts"]) for e in events
                   if e.get("cat") in LAUNCHES and "ts" in e and _correlation(e) is not None}
    return sorted((launched_at[c], *_interval(e)) for e in events
                  if e.get("cat") in DEVICE_WORK and "ts" in e and (c := _correlation(e)) in launched_at)


def phase_spans(events: list[dict[str, Any]], names: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per range name that the host opened: how many times (`calls`, overlapping ranges of one name counted
    once), the host's time in it (`host_ms`), the GPU time of the work launched inside it (`work_ms`), that
    work's span on the GPU's timeline summed over the calls (`span_ms`) and the part of each span in which
    some GPU work ran, its own or not (`busy_ms`). Timestamps in the trace are in microseconds."""
    busy = merged(_interval(e) for e in events if e.get("cat") in DEVICE_WORK and "ts" in e)
    work = launched_work(events)
    launches = [w[0] for w in work]
    out: dict[str, dict[str, float]] = {}
    for name in names:
        ranges = merged(_interval(e) for e in events
                        if e.get("cat") == "user_annotation" and e.get("name") == name and "ts" in e)
        if not ranges:
            continue
        totals = {"calls": float(len(ranges)), "host_ms": 0.0, "work_ms": 0.0, "span_ms": 0.0, "busy_ms": 0.0}
        for start, end in ranges:
            totals["host_ms"] += (end - start) / 1e3
            inside = work[bisect.bisect_left(launches, start):bisect.bisect_right(launches, end)]
            if not inside:
                continue
            span = (min(w[1] for w in inside), max(w[2] for w in inside))
            totals["work_ms"] += sum(w[2] - w[1] for w in inside) / 1e3
            totals["span_ms"] += (span[1] - span[0]) / 1e3
            totals["busy_ms"] += overlap(span, busy) / 1e3
        out[name] = totals
    return out


def work_by_name(events: list[dict[str, Any]]) -> list[tuple[str, int, float]]:
    """Every kernel, copy and memset of the trace by name: (name, how many ran, their GPU milliseconds), the
    longest first. The work itself only: not the host's operators that launched it, nor the ranges around it,
    which the profiler's own averages list beside the kernels with the same GPU time again."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") in DEVICE_WORK and "ts" in e:
            total = totals.setdefault(str(e.get("name", "")), [0, 0.0])
            total[0] += 1
            total[1] += float(e.get("dur", 0)) / 1e3
    return sorted(((name, int(n), ms) for name, (n, ms) in totals.items()), key=lambda row: (-row[2], row[0]))
