"""Which attention kernel is fastest for each ViT's shapes: every backend of `F.scaled_dot_product_attention`.

    python benchmarks/attention.py [--models ViT-B/16 ViT-L/16 ViT-H/14] [--batch 256] [--img-size 224]
                                   [--steps 20] [--out rows.json]

vitscale's attention (`models/layers.py`) is one `F.scaled_dot_product_attention` call over (batch, heads,
tokens, head dim) with no mask; PyTorch picks a kernel for it (flash, memory-efficient, cuDNN or the
plain math) by its own priority list, not by time. This times the forward and backward pass of that call
at each model's shapes (the class token included: 197 tokens at 224 px and 16-px patches) in bf16 on a GPU
(fp32 on a CPU), once per backend that accepts them, and prints the median milliseconds, the attention's
TFLOP/s (4 * tokens^2 * width per image and layer forward, twice that backward), the fastest backend and
PyTorch's own choice beside it. The share of attention in a ViT step is small at 224 px (about 4% of
ViT-B/16's FLOPs), so this says whether pinning a backend is worth an option, not what the step gains.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import device_name, finish
from vitscale.models.variants import parse_model_name

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
"""Every backend PyTorch's SDPA dispatches to, by the name this benchmark prints."""


def shapes(model: str, batch: int, img_size: int) -> tuple[int, int, int, int]:
    """(batch, heads, tokens, head dim) of one attention call of `model` at `img_size`."""
    spec = parse_model_name(model)
    dims = spec.vit
    if dims is None:
        raise ValueError(f"{model}: not a ViT (no attention to time)")
    tokens = spec.num_patches(img_size) + 1  # the class token
    return batch, dims.heads, tokens, dims.head_dim


def time_backend(shape: tuple[int, int, int, int], backend: str | None, device: torch.device,
                 dtype: torch.dtype, steps: int) -> float | None:
    """Median milliseconds of forward + backward with `backend` (None: PyTorch's choice); None if refused."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    chosen = [BACKENDS[backend]] if backend else list(BACKENDS.values())

    def step() -> None:
        with sdpa_kernel(chosen):
            out = F.scaled_dot_product_attention(q, k, v)
        torch.autograd.backward(out, grad)

    try:
        for _ in range(3):
            step()
    except RuntimeError:  # "No available kernel": this backend does not take these shapes or this dtype
        return None
    laps = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        laps.append(time.perf_counter() - t0)
    return 1e3 * sorted(laps)[len(laps) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: str, *, batch: int, img_size: int, steps: int, device: torch.device) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = shapes(model, batch, img_size)
    b, heads, tokens, head_dim = shape
    flops = 3 * 4 * tokens**2 * heads * head_dim * b  # forward 4 t^2 d, backward twice that
    times = {name: time_backend(shape, name, device, dtype, steps) for name in BACKENDS}
    times["default"] = time_backend(shape, None, device, dtype, steps)
    measured = {name: ms for name, ms in times.items() if ms is not None and name != "default"}
    fastest = min(measured, key=lambda name: measured[name])
    return {"model": model, "batch": b, "heads": heads, "tokens": tokens, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "ms": times, "fastest": fastest,
            "tflops_per_s": {name: flops / ms / 1e9 for name, ms in measured.items()},
            "default_vs_fastest": times["default"] / measured[fastest] if times["default"] else None}


def table(rows: list[dict[str, Any]]) -> list[str]:
    names = [*BACKENDS, "default"]
    lines = ["| model | batch x heads x tokens x head dim | " + " | ".join(f"{n} ms" for n in names)
             + " | fastest | PyTorch's choice / fastest |", "|---|---|" + "---:|" * (len(names) + 2)]
    for r in rows:
        cells = [f"{r['ms'][n]:.2f}" if r["ms"][n] is not None else "-" for n in names]
        ratio = f"{r['default_vs_fastest']:.2f}x" if r["default_vs_fastest"] else "-"
        lines.append(f"| {r['model']} | {r['batch']} x {r['heads']} x {r['tokens']} x {r['head_dim']} | "
                     + " | ".join(cells) + f" | {r['fastest']} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["ViT-B/16", "ViT-L/16", "ViT-H/14"],
                        help="ViT names, as in a pipeline's model: section")
    parser.add_argument("--batch", type=int, default=256, help="images per call")
    parser.add_argument("--img-size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=20, help="timed calls per backend (after 3 warm-up)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for model in args.models:
        rows.append(measure(model, batch=args.batch, img_size=args.img_size, steps=args.steps, device=device))
        print(json.dumps(rows[-1]), flush=True)
    return finish(f"scaled_dot_product_attention forward + backward on {device_name(device)}, torch "
                  f"{torch.__version__}, median of {args.steps}:", table(rows), rows, args.out)


if __name__ == "__main__":
    main()
