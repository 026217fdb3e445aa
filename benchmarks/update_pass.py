"""The optimizer's update alone, four ways over one model's parameters, on this machine's device.

    python benchmarks/update_pass.py [--models ViT-B/16 ViT-L/16] [--steps 20] [--out FILE]

- **deepspeed**: DeepSpeed 0.19's bf16 update (ZeRO 1-3 alike, one rank) as it queues it: the gradients
  flattened, the flat buffer cast to a new fp32 gradient, the clip's multiply, torch's fused AdamW over the flat
  fp32 master, the copy back to the bf16 weights: 52 bytes per parameter read and written;
- **one pass**: vitscale's (`train/one_pass.py`): the same flatten, then `adamw_pass` compiled: 32 bytes;
- **one pass, flat gradient**: the kernel alone, over a gradient already flat (as one rank's ZeRO 1 and ZeRO 3
  gradients lie in DeepSpeed's buffer, `one_pass.end_to_end`): 28 bytes, the peer's, so the two rows compare
  the kernels themselves;
- **peer**: the hand-written loop's update: torch's fused AdamW over fp32 weights and their fp32 gradients
  (bf16 autocast's), tensor by tensor, no clip: 28 bytes.

None of them takes the gradient norm (the peer has none; vitscale's and DeepSpeed's are the same fused kernel).
Each is timed alone, a sync either side (CUDA events on a GPU), the median of `--steps` after three to warm
up; the table gives milliseconds, the bandwidth each reaches on the bytes it must move, and its time against
DeepSpeed's. The update is memory-bound on a GPU, so the bytes are the forecast: one pass at about 32/52 of
DeepSpeed's time. DeepSpeed's sequence and the one pass get the same gradients every step, and the table says
how far apart their fp32 masters end (fp32 rounding: a few 1e-7 at most).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import device_name, finish
from vitscale.models import create_model
from vitscale.train.one_pass import compiled_pass

ONE_PASS, FLAT = "one pass", "one pass, flat gradient"
BYTES = {"deepspeed": 52, ONE_PASS: 32, FLAT: 28, "peer": 28}
"""Bytes per parameter each update reads and writes (the module's docstring)."""
LR, BETAS, EPS, DECAY, FACTOR = 1e-3, (0.9, 0.999), 1e-8, 0.1, 0.5


def shapes(name: str) -> list[torch.Size]:
    """The shapes of `name`'s parameters (built on the meta device: no memory)."""
    with torch.device("meta"):
        return [p.shape for p in create_model(name, num_classes=1000).parameters()]


class Updates:
    """One model's parameters as each update holds them, on `device`, with the same gradients for all."""

    def __init__(self, sizes: list[torch.Size], device: torch.device) -> None:
        self.device = device
        self.gradients = [torch.randn(s, device=device).to(torch.bfloat16) for s in sizes]
        flat = _flatten_dense_tensors([torch.randn(s, device=device) * 0.02 for s in sizes])
        self.numel = flat.numel()
        # deepspeed's and vitscale's: one flat fp32 master, its moments, the flat bf16 weights.
        self.ds_master = torch.nn.Parameter(flat.clone())
        self.ds_weights = flat.to(torch.bfloat16)
        self.ds_adamw = torch.optim.AdamW([self.ds_master], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                                          fused=True)
        self.ours = [flat.clone(), torch.zeros_like(flat), torch.zeros_like(flat),
                     torch.zeros((), device=device), flat.to(torch.bfloat16)]
        self.kernel = compiled_pass()
        self.flat_gradient: torch.Tensor | None = None  # the "flat" row's, flattened once, outside its timing
        self.factor = torch.full((), FACTOR, device=device)
        # the peer's: fp32 weights tensor by tensor, autocast's fp32 gradients.
        self.peer_weights = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in sizes]
        for weight, gradient in zip(self.peer_weights, self.gradients):
            weight.grad = gradient.float()
        self.peer_adamw = torch.optim.AdamW(self.peer_weights, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                                            fused=True)

    def deepspeed(self) -> None:
        self.ds_master.grad = _flatten_dense_tensors(self.gradients).to(torch.float32)
        self.ds_master.grad.mul_(self.factor)
        self.ds_adamw.step()
        self.ds_weights.copy_(self.ds_master.detach())
        self.ds_master.grad = None

    def one_pass(self) -> None:
        self._pass(_flatten_dense_tensors(self.gradients))

    def flat(self) -> None:
        if self.flat_gradient is None:
            self.flat_gradient = _flatten_dense_tensors(self.gradients)
        self._pass(self.flat_gradient)

    def _pass(self, gradient: torch.Tensor) -> None:
        lr = torch.full((), LR, device=self.device)
        refused = torch.zeros((), device=self.device)
        self.kernel(gradient, *self.ours[:4], self.ours[4], lr, self.factor, refused,
                    beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=DECAY)

    def peer(self) -> None:
        self.peer_adamw.step()

    def masters_apart(self) -> float:
        return float((self.ds_master.detach() - self.ours[0]).abs().max())


def _time(run: Callable[[], None], device: torch.device, steps: int) -> float:
    """Median milliseconds of `run` alone, after three to warm up (and compile)."""
    laps = []
    for i in range(steps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            lap = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            run()
            lap = 1e3 * (time.perf_counter() - t0)
        if i >= 3:
            laps.append(lap)
    return statistics.median(laps)


def measure(name: str, device: torch.device, steps: int) -> list[dict[str, Any]]:
    updates = Updates(shapes(name), device)
    with torch.no_grad():
        ms = {"deepspeed": _time(updates.deepspeed, device, steps), ONE_PASS: _time(updates.one_pass, device, steps)}
        apart = updates.masters_apart()  # before the flat row steps vitscale's state on (its own count of steps)
        ms[FLAT] = _time(updates.flat, device, steps)
        ms["peer"] = _time(updates.peer, device, steps)
    return [{"model": name, "device": str(device), "update": loop, "parameters": updates.numel, "ms": ms[loop],
             "gb_per_s": BYTES[loop] * updates.numel / ms[loop] / 1e6, "vs_deepspeed": ms[loop] / ms["deepspeed"],
             "masters_apart": apart} for loop in ms]


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | update | bytes per parameter | ms | GB/s | vs DeepSpeed's | masters apart |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        apart = f"{r['masters_apart']:.1e}" if r["update"] == ONE_PASS else ""
        lines.append(f"| {r['model']} | {r['update']} | {BYTES[r['update']]} | {r['ms']:.2f} | {r['gb_per_s']:.0f} "
                     f"| {r['vs_deepspeed']:.2f}x | {apart} |")
    return lines


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number")
    return int(text)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["ViT-B/16", "ViT-L/16"])
    parser.add_argument("--steps", type=_positive, default=20, help="timed updates per way (after 3 warm-up)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in args.models:  # a misspelt model is one line before anything is allocated or compiled
        try:
            shapes(name)
        except ValueError as exc:
            parser.error(f"--models: {exc}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = [row for name in args.models for row in measure(name, device, args.steps)]
    return finish(f"The update alone on {device_name(device)}, median of {args.steps}:", table(rows), rows, args.out)


if __name__ == "__main__":
    main()
