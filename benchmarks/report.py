"""How a benchmark ends: its table under a title that names the device, and its rows as JSON where asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def device_name(device: torch.device) -> str:
    """The GPU's name (an H200 is not an H100), or CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def finish(title: str, table: list[str], rows: list[dict[str, Any]], out: Path | None) -> list[dict[str, Any]]:
    """Print `title` and `table`, write `rows` to `out` if given; the rows, for the caller to return."""
    print(f"\n{title}")
    print("\n".join(table))
    if out:
        out.write_text(json.dumps(rows, indent=1))
    return rows
