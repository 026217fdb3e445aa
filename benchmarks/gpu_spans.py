"""How busy the GPU was inside a named range of a step, from a `torch.profiler` Chrome trace (pure).

A range opened with `torch.profiler.record_function(name)` around a call shows on the GPU's timeline as a
`gpu_user_annotation` event: from the first kernel the call launched to the end of its last. Its length is
what the range cost a step on the GPU; the kernels (and copies and memsets) that ran inside it on any stream
are what the GPU did there. The difference is the time the GPU waited inside the range: for the host to
launch the next kernel, or for another stream. `benchmarks/mfu.py --profile` reports both per phase.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

DEVICE_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""The trace categories of work a GPU does (`cat` in a Chrome trace from Kineto)."""


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


def phase_spans(events: list[dict[str, Any]], names: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per range name that appears on the GPU's timeline: how many times (`calls`), its total length there
    (`span_ms`), and the part of it in which some GPU work ran (`busy_ms`). Timestamps in the trace are in
    microseconds."""
    busy = merged((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                  if e.get("cat") in DEVICE_WORK and "ts" in e)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                 if e.get("cat") == "gpu_user_annotation" and e.get("name") == name and "ts" in e]
        if spans:
            out[name] = {"calls": len(spans), "span_ms": sum(end - start for start, end in spans) / 1e3,
                         "busy_ms": sum(overlap(span, busy) for span in spans) / 1e3}
    return out
