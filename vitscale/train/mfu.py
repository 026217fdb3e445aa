"""Model FLOPs utilisation: the model's FLOPs per second over the device's dense bf16 peak.

MFU uses dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's data sheets (:data:`PEAK_BF16_FLOPS`).
On a CPU (or an unknown GPU) ``peak_flops("auto")`` is ``None`` and MFU is left out rather than made up.
The numerator is the paper's count (`scaling/flops.py`: 3x the forward pass), not what a kernel executes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

__all__ = ["PEAK_BF16_FLOPS", "device_key", "mfu", "peak_flops"]

#: Dense bf16 tensor-core peak FLOP/s per GPU (NVIDIA data sheets; the "with sparsity" figures are
#: twice these). H100 SXM and H200 SXM share the GH100 compute: 989.4 TFLOP/s; A100 (SXM and PCIe):
#: 312 TFLOP/s; H100 PCIe: 756 TFLOP/s; H100 NVL and H200 NVL: 835 TFLOP/s (1,671 sparse).
#: Matching is by :func:`device_key`: the longest key found in the upper-cased device name, not inside a
#: longer number, so "NVIDIA H100 PCIe" resolves to the PCIe figure, "NVIDIA H100 80GB HBM3" to the SXM
#: one, and an "NVIDIA RTX A1000" to none (it is no A100). GH200's GPU is an H100/H200 SXM.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "GH200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "H100 PCIE": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
}


def mfu(model_flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak FLOP/s.

    Both per device (or both summed over devices). The numerator counts the model's FLOPs only
    (the paper's 3x-forward convention), not recomputation from activation checkpointing.

    Raises:
        ValueError: the peak is not a positive finite number or the achieved rate is negative.
    """
    if not math.isfinite(peak_flops_per_s) or peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be a positive finite number, got {peak_flops_per_s}")
    if not model_flops_per_s >= 0:  # also rejects NaN
        raise ValueError(f"model_flops_per_s must be >= 0, got {model_flops_per_s}")
    return model_flops_per_s / peak_flops_per_s


def device_key(device_name: str, keys: Iterable[str]) -> str | None:
    """The longest of `keys` (upper case, words apart by spaces) in `device_name`, whatever its case and
    whether its words are apart by spaces, '-' or '_' ("h100-pcie" is "H100 PCIE"), and not as a piece
    of a longer number: "H1000" and "RTX A1000" are no H100 and no A100. None when no key is there."""
    name = re.sub(r"[\s_-]+", " ", device_name.upper())
    found = [key for key in keys if re.search(rf"(?<![0-9]){re.escape(key)}(?![0-9])", name)]
    return max(found, key=len) if found else None


def _lookup_peak(device_name: str) -> float | None:
    key = device_key(device_name, PEAK_BF16_FLOPS)
    return None if key is None else PEAK_BF16_FLOPS[key]


def peak_flops(device_name_or_value: str | float | None, *, device_name: str | None = None) -> float | None:
    """Resolve the ``peak_flops`` config value to FLOP/s per device, or None when it is unknown.

    * a positive number (or a numeric string such as ``"989e12"``): returned as is — the way to
      describe hardware this table does not know;
    * ``"auto"``: the table entry for ``device_name`` if given, else for
      ``torch.cuda.get_device_name()`` of the current CUDA device; ``None`` on a machine without
      CUDA or for a GPU not in :data:`PEAK_BF16_FLOPS` (MFU is then reported as absent, never
      guessed);
    * a GPU name such as ``"H100"`` or ``"NVIDIA A100-SXM4-80GB"``: its table entry;
    * ``None``: None (MFU off).

    Raises:
        ValueError: a non-positive number, or a name that is neither "auto" nor in the table.
    """
    if device_name_or_value is None:
        return None
    if isinstance(device_name_or_value, bool):
        raise ValueError(f"peak_flops must be 'auto', a GPU name or FLOP/s, got {device_name_or_value!r}")
    if isinstance(device_name_or_value, str):
        text = device_name_or_value.strip()
        try:
            value: float = float(text)
        except ValueError:
            if text.lower() == "auto":
                if device_name is None:
                    import torch  # deferred: the table and mfu() need no torch

                    if not torch.cuda.is_available():
                        return None
                    device_name = torch.cuda.get_device_name(torch.cuda.current_device())
                return _lookup_peak(device_name)
            found = _lookup_peak(text)
            if found is None:
                raise ValueError(
                    f"peak_flops: unknown device {text!r}; use 'auto', one of {sorted(PEAK_BF16_FLOPS)}, "
                    "or the dense bf16 peak in FLOP/s as a number (e.g. 989e12)"
                ) from None
            return found
    else:
        value = float(device_name_or_value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"peak_flops must be a positive number of FLOP/s, got {device_name_or_value!r}")
    return value
