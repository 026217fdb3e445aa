"""Images/s and MFU of vitscale's training step against a hand-written PyTorch loop, in one run.

    python benchmarks/mfu.py [--models ViT-B/16 ViT-L/16] [--zero-stages 1 2 3] [--peer] [--profile DIR]
                             [--batch 256|auto] [--batch-for ViT-H/14=128|auto] [--steps 20] [--compile auto|on|off]

vitscale's side is the training path exactly as a Ray Train worker runs it: the model inside the
DeepSpeed engine `train/engine.py` builds (bf16 on GPU, torch's fused AdamW, `train.compile`'s
torch.compile, which is on by default with a GPU), stepped by the loop's own `train/step.py` `Stepper`
(uint8 batch normalised on the device, loss, backward, the one all-reduce, the guarded optimizer step
with gradient clipping and the non-finite check), fed a fixed uint8 batch already on the device so
the data loader is out of the picture (`benchmarks/train_data.py` measures it with real data).

`--peer` measures, in the same process, the loop a performance-minded user writes by hand: timm's
model of the same size (when timm is installed; it is a benchmark-only extra), `torch.compile`,
`torch.optim.AdamW(fused=True)` over fp32 weights, bf16 autocast, no gradient clipping, and the same
loop with vitscale's model instead of timm's. Each vitscale row prints its ratio to the timm peer
(else to the vitscale-model peer). MFU is the paper-convention model FLOPs (3x forward,
`scaling.flops`) per second over the device's dense bf16 peak (`train.mfu.PEAK_BF16_FLOPS`); the
large-matmul rate measured in the same process says what the chip delivers here.

Where a step's time goes: a few more steps with a device sync between forward (with the loss),
backward and the optimizer step (which includes DeepSpeed's gradient flattening, the norm and
clipping), reported as `*_ms` columns. `--profile DIR` traces three steps of the first model's vitscale
step at each ZeRO stage with `torch.profiler` and writes DIR/profile-zero{stage}.md: the step's phases
(forward, backward, update: the host's time in each, the GPU time of the work launched inside each from
any thread, and that work's span on the GPU's timeline with the share of it the GPU was busy, `gpu_spans.py`),
the GPU's kernels by time (each counted once), the host calls by count and by time, and the host syncs
(device-to-host copies, stream and device synchronisations); the Chrome trace beside it
(profile-zero{stage}.trace.json.gz). Where the GPU is busy for little of a phase's span, it waited there: for
the host, or for another stream.
The optimizer phase so measured starts with an idle GPU, so where the host queues the update more slowly
than the GPU runs it, it is the host's time; inside a real step the host queues the update while the GPU
still runs the backward pass. `update_gpu_ms` (the "update in step" column, GPU only) is the update's own
cost there: CUDA events recorded as the update is queued in unbroken steps, no sync between them.

`--batch auto` (or `--batch-for MODEL=auto`) chooses each model's batch on a GPU by its memory: the
peak memory of an eager bf16 forward and backward at two small batches gives a line (bytes at batch 0,
bytes per image); the training state a step adds (fp32 master weights and Adam's two moments, 12 more
bytes per parameter than the probe's fp32 weights and gradients) goes on top, and the batch is the
largest multiple of 64, at most 1024, whose line stays under 80% of the device's memory (compiled
steps use less than eager ones, so this errs on the side of fitting). Both loops then run at it.

Targets on one H100/H200: vitscale >= 1.0x the timm peer for B/16 and L/16; >= 40% MFU for B/16 and
>= 47% for L/16; the optimizer phase <= 5 ms (B/16) and <= 12 ms (L/16) at ZeRO 1 and 2; ZeRO 3
within 15% of ZeRO 1's step.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# gpu_spans: beside this file, on sys.path when run as a script or imported by tests
from gpu_spans import phase_spans, work_by_name

TIMM_NAMES = {"ViT-Ti/16": "vit_tiny_patch16_224", "ViT-S/16": "vit_small_patch16_224",
              "ViT-B/16": "vit_base_patch16_224", "ViT-B/32": "vit_base_patch32_224",
              "ViT-L/16": "vit_large_patch16_224", "ViT-H/14": "vit_huge_patch14_224"}
"""timm's model of the same size (class token, 224 px) for the peer loop."""

WARMUP_STEPS = 3  # compilation, the allocator and autotuning land here

AUTO_BATCH_MULTIPLE = 64  # tensor-core friendly, and coarse enough that the choice is stable between runs
AUTO_BATCH_CAP = 1024  # past this a ViT's step is matmul-bound and gains nothing but compile time
AUTO_MEMORY_SHARE = 0.8  # the rest: the allocator's fragmentation, cuBLAS and compile workspaces
PROBE_STATE_BYTES = 8
"""Bytes per parameter of the probe's own state: fp32 weights and their gradients."""
EXTRA_STATE_BYTES = 12
"""Bytes per parameter a training step holds beyond the probe's fp32 weights and gradients (8 bytes):
fp32 master weights or a bf16 copy with its gradient partition (DeepSpeed's bf16, 4) and Adam's two
fp32 moments (8)."""
PROBE_BATCHES = (32, 64)


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, n: int, seconds: float = 3.0) -> float:
    """Achieved FLOP/s of square matmuls on random data: the hardware's practical peak in this process."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
        if count % 8 == 0:
            _sync(device)
    _sync(device)
    return 2 * n**3 * count / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _init_process_group() -> None:
    """A one-rank group (NCCL on a GPU, gloo on CPU) joined the way a worker joins Ray Train's."""
    from vitscale.train.engine import init_distributed

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_RANK": "0"})
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    init_distributed(torch.cuda.is_available())


def _fixed_batch(batch: int, device: torch.device, img_size: int = 224) -> Iterator[dict[str, Any]]:
    """The same uint8 micro-batch for ever, already on the device: what the stream hands the step."""
    torch.manual_seed(0)
    micro = {"image": torch.randint(0, 256, (batch, 3, img_size, img_size), dtype=torch.uint8, device=device),
             "label": torch.randint(0, 1000, (batch,), device=device), "key": [f"{i:06d}" for i in range(batch)]}
    while True:
        yield micro


def _time_steps(step: Callable[[], Any], steps: int, device: torch.device) -> float:
    """Median seconds of `steps` calls after the warm-up ones, each ended by a device sync."""
    times = []
    for i in range(steps + WARMUP_STEPS):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]  # median: robust to a stray slow step


def _phases(run: list[Callable[[], Any]], device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of each phase of a step, a device sync after each (not in the step figures)."""
    laps: list[list[float]] = [[] for _ in run]
    for _ in range(repeats):
        for lap, phase in zip(laps, run):
            _sync(device)
            t0 = time.perf_counter()
            phase()
            _sync(device)
            lap.append(time.perf_counter() - t0)
    names = ("forward_ms", "backward_ms", "optimizer_ms")
    return {name: 1e3 * sorted(lap)[len(lap) // 2] for name, lap in zip(names, laps)}


def _update_gpu_ms(step: Callable[[], Any], owner: Any, attribute: str, device: torch.device,
                   repeats: int = 5) -> dict[str, float]:
    """Median GPU milliseconds of the update inside `repeats` unbroken steps: `owner.attribute` (the call that
    queues the update) bracketed by CUDA events as it is queued, read once the steps are done. Empty off a GPU."""
    if device.type != "cuda":
        return {}
    spans: list[tuple[Any, Any]] = []
    real = getattr(owner, attribute)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return real(*args, **kwargs)
        finally:
            end.record()
            spans.append((start, end))

    setattr(owner, attribute, timed)
    try:
        for _ in range(repeats):
            step()
    finally:
        setattr(owner, attribute, real)
    torch.cuda.synchronize(device)
    return {"update_gpu_ms": sorted(s.elapsed_time(e) for s, e in spans)[len(spans) // 2]}


def _result(name: str, batch: int, step_s: float, device: torch.device, resident: int, *, img_size: int = 224,
            options: dict[str, Any] | None = None, **extra: Any) -> dict:
    from vitscale.scaling.flops import forward_flops

    flops_per_image = 3 * forward_flops(name, img_size=img_size, num_classes=1000, **(options or {}))
    out = {"model": name, "batch": batch, "step_ms": 1e3 * step_s, "images_per_s": batch / step_s,
           "model_tflops_per_s": flops_per_image * batch / step_s / 1e12, **extra}
    if device.type == "cuda":
        out["max_memory_gib"] = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
    return out


def largest_batch(fixed: float, per_image: float, capacity: float, *, multiple: int = AUTO_BATCH_MULTIPLE,
                  cap: int = AUTO_BATCH_CAP) -> int:
    """The largest multiple of `multiple`, at most `cap`, whose memory `fixed + per_image * batch` fits `capacity`.

    Raises:
        ValueError: not even one `multiple` of images fits (the message gives the figures).
    """
    if multiple < 1 or cap < multiple or per_image <= 0:
        raise ValueError(f"need 1 <= multiple <= cap and bytes per image > 0; got multiple={multiple}, cap={cap}, "
                         f"per_image={per_image}")
    fits = int((capacity - fixed) // per_image) if capacity > fixed else 0
    batch = min(cap, fits) // multiple * multiple
    while batch >= multiple and fixed + per_image * batch > capacity:  # the floor division's rounding
        batch -= multiple
    if batch < multiple:
        raise ValueError(f"{multiple} images need {(fixed + per_image * multiple) / 2**30:.1f} GiB; "
                         f"{capacity / 2**30:.1f} GiB are available")
    return batch


def memory_line(name: str, device: torch.device, *, img_size: int = 224,
                probes: tuple[int, int] = PROBE_BATCHES) -> tuple[float, float, int]:
    """(bytes at batch 0, bytes per image, parameters) of training `name` on a GPU: the peak memory of an
    eager bf16-autocast forward and backward over fp32 weights at two batches, as a straight line."""
    from vitscale.data.loader.transforms import normalize_on_device
    from vitscale.models import create_model

    resident = _release(device)
    model = create_model(name, num_classes=1000, img_size=img_size).to(device).train()
    peaks = []
    for batch in probes:
        image = torch.randint(0, 256, (batch, 3, img_size, img_size), dtype=torch.uint8, device=device)
        label = torch.randint(0, 1000, (batch,), device=device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(normalize_on_device(image))
        torch.nn.functional.cross_entropy(logits.float(), label).backward()
        peaks.append(torch.cuda.max_memory_allocated(device) - resident)
        del image, label, logits
        model.zero_grad(set_to_none=True)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    _release(device)
    per_image = (peaks[1] - peaks[0]) / (probes[1] - probes[0])
    return peaks[0] - per_image * probes[0], per_image, parameters


def auto_batch(name: str, device: torch.device, *, img_size: int = 224) -> int:
    """The batch `--batch auto` gives `name` on this GPU (the module docstring says how); prints why."""
    at_zero, per_image, parameters = memory_line(name, device, img_size=img_size)
    # The probe's peak comes in its backward pass, before the last gradients exist (ViT-Ti/16's line met
    # batch 0 at 4.9 bytes per parameter on an H200): the fp32 weights and every gradient, at least.
    fixed = max(at_zero, PROBE_STATE_BYTES * parameters) + EXTRA_STATE_BYTES * parameters
    total = torch.cuda.get_device_properties(device).total_memory
    capacity = AUTO_MEMORY_SHARE * total - torch.cuda.memory_allocated(device)
    batch = largest_batch(fixed, per_image, capacity)
    print(f"{name}: batch auto -> {batch} ({per_image / 2**20:.1f} MiB per image, {fixed / 2**30:.1f} GiB fixed, "
          f"{capacity / 2**30:.1f} GiB to fill)", flush=True)
    return batch


def _release(device: torch.device) -> int:
    """Free what the last measurement left and reset the peak; the bytes still allocated (not the next one's)."""
    import gc

    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


class VitscaleStep:
    """vitscale's training step as a worker runs it (engine + `Stepper`) on a fixed batch, and its phases.

    `img_size` and `options` (model options such as depth or width) shape the model as in a pipeline's
    `model:` section; `precision` and `fused` default to what the device trains with (bf16 and torch's
    fused optimizer on a GPU)."""

    def __init__(self, name: str, *, batch: int, zero_stage: int, device: torch.device,
                 compile_model: bool | str = "auto", compile_mode: str = "default", img_size: int = 224,
                 options: dict[str, Any] | None = None, deepspeed: dict[str, Any] | None = None,
                 precision: str | None = None, fused: bool | None = None) -> None:
        from vitscale.models import create_model
        from vitscale.train.batch import derive_batch
        from vitscale.train.config import TrainConfig
        from vitscale.train.engine import build_engine, deepspeed_config
        from vitscale.train.step import Stepper

        on_gpu = device.type == "cuda"
        self.precision = precision or ("bf16" if on_gpu else "fp32")
        self.train = TrainConfig(global_batch=batch, micro_batch=batch, zero_stage=zero_stage,
                                 precision=self.precision, weight_decay=0.1, compile=compile_model,
                                 compile_mode=compile_mode, deepspeed=deepspeed or {})
        self.train.validate()
        self.compiled = self.train.compiles(on_gpu)
        plan = derive_batch(batch, batch, 1)
        torch.manual_seed(0)
        model = create_model(name, num_classes=1000, img_size=img_size, **(options or {}))
        parameters = sum(p.numel() for p in model.parameters())
        self.engine = build_engine(model, self.train,
                                   deepspeed_config(self.train, plan, on_gpu=on_gpu, parameters=parameters),
                                   on_gpu=on_gpu, fused=fused)
        self.stepper = Stepper(self.engine, self.train, plan, device, world_size=1)
        self.batches = _fixed_batch(batch, device, img_size)
        self.micro = next(self.batches)
        self.loss: torch.Tensor | None = None

    def step(self) -> None:
        # As the loop steps inside an epoch: its four per-step votes (`train/stopvote.py`), all "no", riding in
        # the step's all-reduce, and the next step's batch read ahead (`train/feed.py`).
        self.stepper.step(self.batches, 1e-4, votes=lambda: [0.0, 0.0, 0.0, 0.0], ahead=True)

    def forward(self) -> None:
        from vitscale.data.loader.transforms import normalize_on_device

        image = self.micro["image"]
        self.loss, _ = self.stepper.objective.loss(self.engine, image, normalize_on_device(image, self.stepper.dtype),
                                                   self.micro)

    def backward(self) -> None:
        self.engine.backward(self.loss)

    def update(self) -> None:  # as `Stepper.step` ends: the update, then its one read of verdict and norm
        from vitscale.train.update import apply_update

        assert self.loss is not None
        apply_update(self.engine, loss=self.loss.detach()).read()

    def phases(self) -> list[Callable[[], Any]]:
        return [self.forward, self.backward, self.update]

    def phase_owners(self) -> dict[str, Any]:
        """Where `step` finds each phase's call (`PROFILED_PHASES`): the engine's forward and backward, and the
        `apply_update` of the module whose `Stepper` steps."""
        import vitscale.train.step as stepper

        return {"forward": self.engine, "backward": self.engine, "update": stepper}


def bench_vitscale(name: str, *, batch: int, steps: int, zero_stage: int, device: torch.device,
                   compile_model: bool | str = "auto", compile_mode: str = "default",
                   profile: Path | None = None, img_size: int = 224, options: dict[str, Any] | None = None,
                   deepspeed: dict[str, Any] | None = None) -> dict:
    """Images/s and phases of `VitscaleStep` (the paper's model at 224 px by default)."""
    resident = _release(device)
    run = VitscaleStep(name, batch=batch, zero_stage=zero_stage, device=device, compile_model=compile_model,
                       compile_mode=compile_mode, img_size=img_size, options=options, deepspeed=deepspeed)
    step_s = _time_steps(run.step, steps, device)
    if profile is not None:
        _profile(run, profile / f"profile-zero{zero_stage}.md", f"{name}, ZeRO {zero_stage}")
    phases = _phases(run.phases(), device)
    import vitscale.train.step as stepper  # the module whose `apply_update` the step calls
    from vitscale.train.one_pass import one_pass_installed

    phases.update(_update_gpu_ms(run.step, stepper, "apply_update", device))
    return _result(name, batch, step_s, device, resident, img_size=img_size, options=options, loop="vitscale",
                   zero_stage=zero_stage, precision=run.precision, compiled=run.compiled,
                   update="one pass" if one_pass_installed(run.engine) else "DeepSpeed's", **phases)


class PeerStep:
    """The hand-written loop: the model (timm's, else vitscale's), `torch.compile`, fused AdamW over fp32
    weights, bf16 autocast, no clipping. `bf16` and `fused` default to what a GPU gets (fp32 and torch's
    default optimizer kernel on a CPU)."""

    def __init__(self, name: str, *, batch: int, device: torch.device, timm_model: bool, compile_model: bool = True,
                 img_size: int = 224, options: dict[str, Any] | None = None, bf16: bool | None = None,
                 fused: bool | None = None) -> None:
        from vitscale.models import create_model
        from vitscale.train.optim import param_groups

        on_gpu = device.type == "cuda"
        torch.manual_seed(0)
        if timm_model:
            import timm

            model = timm.create_model(TIMM_NAMES[name], num_classes=1000)
        else:
            model = create_model(name, num_classes=1000, img_size=img_size, **(options or {}))
        model = model.to(device).train()
        groups = param_groups(model, 0.1) if not timm_model else [
            {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=(on_gpu if fused is None else fused) or None)
        self.model = torch.compile(model) if compile_model else model
        self.bf16 = on_gpu if bf16 is None else bf16
        self.precision = "bf16 autocast" if self.bf16 else "fp32"
        self.micro = next(_fixed_batch(batch, device, img_size))
        self.loss: torch.Tensor | None = None

    def forward(self) -> None:
        from vitscale.data.loader.transforms import normalize_on_device

        image = self.micro["image"]
        with torch.autocast(image.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext():
            logits = self.model(normalize_on_device(image))
        self.loss = torch.nn.functional.cross_entropy(logits.float(), self.micro["label"])

    def backward(self) -> None:
        assert self.loss is not None
        self.loss.backward()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.forward()
        self.backward()
        self.update()

    def phases(self) -> list[Callable[[], Any]]:
        return [self.forward, self.backward, self.update]


def bench_peer(name: str, *, batch: int, steps: int, device: torch.device, timm_model: bool,
               compile_model: bool = True) -> dict:
    """Images/s and phases of `PeerStep` (the paper's model at 224 px)."""
    resident = _release(device)
    run = PeerStep(name, batch=batch, device=device, timm_model=timm_model, compile_model=compile_model)
    step_s = _time_steps(run.step, steps, device)
    phases = _phases(run.phases(), device)
    phases.update(_update_gpu_ms(run.step, run, "update", device))
    return _result(name, batch, step_s, device, resident, loop="peer: timm" if timm_model else "peer: vitscale model",
                   zero_stage=None, precision=run.precision, compiled=compile_model, update="torch's fused",
                   **phases)


PROFILED_PHASES = {"forward": "forward", "backward": "backward", "update": "apply_update"}
"""The step's phases in a profile: each a range around one call of the step (`VitscaleStep.phase_owners`)."""


def _profile(run: VitscaleStep, out: Path, title: str) -> None:
    """Trace three of `run`'s steps; write the phases, the top kernels, the host calls by count and by time and
    the host syncs as markdown."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _phase_ranges(run), profile(activities=activities) as prof:
        for _ in range(3):
            run.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    # The Chrome trace beside the summary, for what the tables leave out; it also holds the phases' GPU spans.
    trace = out.with_name(f"{out.stem}.trace.json.gz")
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    with gzip.open(trace, "rt") as opened:
        trace_events = json.load(opened).get("traceEvents", [])
    spans = phase_spans(trace_events, [f"vitscale.{p}" for p in PROFILED_PHASES])
    work = work_by_name(trace_events)
    events = prof.key_averages()
    syncs = [e for e in events if any(s in e.key for s in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                             "cudaMemcpy", "cudaEventSynchronize", "aten::item",
                                                             "aten::_local_scalar_dense"))]
    total_work = sum(ms for _, _, ms in work) or 1.0
    lines = [f"# Profile: {title}, 3 steps", "", "## The step's phases", "",
             "Host ms: the host's time inside the phase's calls. GPU work ms: the GPU time of the kernels, copies and",
             "memsets launched inside them, from any thread (autograd launches the backward pass's from its own).",
             "GPU span ms: that work's length on the GPU's timeline, first start to last end; busy: the part of it in",
             "which some GPU work ran, on any stream (the rest, the GPU waited inside the phase).", "",
             "| phase | calls | host ms (3 steps) | GPU work ms (3 steps) | GPU span ms (3 steps) | busy in span |",
             "|---|---:|---:|---:|---:|---:|"]
    for phase in PROFILED_PHASES:
        span = spans.get(f"vitscale.{phase}", {})
        on_gpu = (f"{span['work_ms']:.2f} | {span['span_ms']:.2f} | {span['busy_ms'] / span['span_ms']:.0%}"
                  if span.get("span_ms") else "- | - | -")
        lines.append(f"| {phase} | {span.get('calls', 0):.0f} | {span.get('host_ms', 0.0):.2f} | {on_gpu} |")
    lines += ["", "## GPU work by time", "", "Kernels, copies and memsets, each counted once.", "",
              "| kernel | calls | ms (3 steps) | share |", "|---|---:|---:|---:|"]
    lines += [f"| `{name[:90]}` | {calls} | {ms:.2f} | {ms / total_work:.1%} |" for name, calls, ms in work[:25]]
    if not work:
        lines.append("| (none: no GPU in this trace) | | | |")
    for order, key in (("count", lambda e: -e.count), ("host time", lambda e: -e.self_cpu_time_total)):
        lines += ["", f"## Host calls by {order}", "", "| op | calls | host ms (self) |", "|---|---:|---:|"]
        lines += [f"| `{e.key[:90]}` | {e.count} | {e.self_cpu_time_total / 1e3:.2f} |"
                  for e in sorted(events, key=key)[:25]]
    lines += ["", "## Host syncs and copies", "", "| call | calls | host ms |", "|---|---:|---:|"]
    lines += [f"| `{e.key[:90]}` | {e.count} | {e.cpu_time_total / 1e3:.2f} |" for e in syncs]
    out.write_text("\n".join(lines) + "\n")
    print(f"profile written to {out} (the trace: {trace.name})", flush=True)


@contextlib.contextmanager
def _phase_ranges(run: VitscaleStep) -> Iterator[None]:
    """`run`'s step with a profiler range (`vitscale.<phase>`) around each of its phases' calls."""
    owners = run.phase_owners()
    real = {phase: getattr(owners[phase], attribute) for phase, attribute in PROFILED_PHASES.items()}

    def ranged(phase: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"vitscale.{phase}"):
                return real[phase](*args, **kwargs)
        return call

    own = {phase: attribute in vars(owners[phase]) for phase, attribute in PROFILED_PHASES.items()}
    for phase, attribute in PROFILED_PHASES.items():
        setattr(owners[phase], attribute, ranged(phase))
    try:
        yield
    finally:
        for phase, attribute in PROFILED_PHASES.items():
            if own[phase]:
                setattr(owners[phase], attribute, real[phase])
            else:  # a method: the class's again
                delattr(owners[phase], attribute)


def _batch(text: str) -> int | str:
    """A batch argument: a positive number of images, or `auto` (chosen per model by GPU memory)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of images or auto")
    return int(text)


def _model_batch(text: str) -> tuple[str, int | str]:
    """`--batch-for` items: MODEL=BATCH with a positive batch or auto (argparse shows the error, naming the item)."""
    name, _, batch = text.partition("=")
    try:
        if name:
            return name, _batch(batch)
    except argparse.ArgumentTypeError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL=BATCH with a positive batch or auto, e.g. ViT-H/14=128")


def _compile_choice(text: str) -> bool | str:
    return {"auto": "auto", "on": True, "off": False}[text]


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _table(rows: list[dict], device_name: str) -> list[str]:
    """The markdown table: each vitscale row against its model's peer (timm's, else vitscale's model)."""
    peers = {}
    for r in rows:
        if r["loop"].startswith("peer") and (r["model"] not in peers or r["loop"] == "peer: timm"):
            peers[r["model"]] = r
    lines = ["| model | loop | ZeRO | compiled | update | batch | images/s | vs peer | MFU | forward ms | "
             "backward ms | optimizer ms | update in step ms | peak GiB |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peer = peers.get(r["model"])
        ratio = f"{r['images_per_s'] / peer['images_per_s']:.2f}x" if peer and not r["loop"].startswith("peer") else ""
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        memory = f"{r['max_memory_gib']:.1f}" if "max_memory_gib" in r else "n/a"
        stage = "" if r["zero_stage"] is None else str(r["zero_stage"])
        lines.append(f"| {r['model']} | {r['loop']} | {stage} | {'yes' if r['compiled'] else 'no'} | "
                     f"{r.get('update', '')} | {r['batch']} | "
                     f"{r['images_per_s']:.1f} | {ratio} | {mfu} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | "
                     f"{r['optimizer_ms']:.1f} | {_ms(r.get('update_gpu_ms'))} | {memory} |")
    return [f"device: {device_name}", *lines]


def _plans(args: argparse.Namespace, *, steps: int, device: torch.device,
           batch_for: dict[str, int]) -> list[tuple[str, Callable[[], dict]]]:
    """The measurements to take, in order, each a label and a call: per model (at its batch in `batch_for`)
    the peer(s), then vitscale's step at each ZeRO stage (the first model's profiled when asked)."""
    on_gpu = device.type == "cuda"
    try:
        import timm  # noqa: F401 -- only asks whether the peer can use timm's model
        has_timm = True
    except ImportError:
        has_timm = False
    plans: list[tuple[str, Callable[[], dict]]] = []
    # The peer compiles as vitscale's step does (`--compile off` keeps both eager, e.g. on a CPU).
    peer_compiles = on_gpu if args.compile == "auto" else bool(args.compile)
    profile = args.profile
    for name in args.models:
        n = batch_for[name]
        if args.peer:
            if has_timm and name in TIMM_NAMES:
                plans.append((f"{name} peer timm", lambda name=name, n=n: bench_peer(
                    name, batch=n, steps=steps, device=device, timm_model=True, compile_model=peer_compiles)))
            if args.peer_own_model or not (has_timm and name in TIMM_NAMES):
                plans.append((f"{name} peer vitscale-model", lambda name=name, n=n: bench_peer(
                    name, batch=n, steps=steps, device=device, timm_model=False, compile_model=peer_compiles)))
        for stage in args.zero_stages:
            for compiled in [args.compile, *([False] if args.eager_too else [])]:
                plans.append((f"{name} ZeRO {stage} compile={compiled}",
                              lambda name=name, n=n, stage=stage, compiled=compiled, profile=profile: bench_vitscale(
                                  name, batch=n, steps=steps, zero_stage=stage, device=device,
                                  compile_model=compiled, compile_mode=args.compile_mode, profile=profile,
                                  deepspeed=args.deepspeed)))
        profile = None  # the first model's stages only: a trace costs steps and host memory
    return plans


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["ViT-B/16", "ViT-L/16"], help="vitscale model names")
    parser.add_argument("--batch", type=_batch, default=None,
                        help="per-step batch (default 256 on GPU, 8 on CPU), or auto: each model's by GPU memory")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement (after 3 warm-up)")
    parser.add_argument("--zero-stages", type=int, nargs="+", default=[1], choices=[0, 1, 2, 3],
                        help="ZeRO stages of vitscale's step to measure, each in turn")
    parser.add_argument("--batch-for", nargs="*", default=[], metavar="MODEL=BATCH", type=_model_batch,
                        help="a per-step batch for one model (a large model that does not fit --batch), or auto")
    parser.add_argument("--compile", type=_compile_choice, default="auto", choices=["auto", True, False],
                        metavar="{auto,on,off}", help="train.compile for vitscale's step (auto: on with a GPU)")
    parser.add_argument("--compile-mode", default="default", help="train.compile_mode for vitscale's step")
    parser.add_argument("--deepspeed", type=json.loads, default={}, metavar="JSON",
                        help="train.deepspeed for vitscale's step, e.g. '{\"compile\": {\"deepcompile\": true}}'")
    parser.add_argument("--eager-too", action="store_true", help="also measure vitscale's step without compile")
    parser.add_argument("--peer", action="store_true",
                        help="measure the hand-written loop in the same run (timm's model where timm is installed)")
    parser.add_argument("--peer-own-model", action="store_true",
                        help="also run the hand-written loop with vitscale's model (always, where timm is missing)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="trace the first model's vitscale step at each ZeRO stage; write DIR/profile-zero*.md")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document at the end")
    args = parser.parse_args(argv)

    from vitscale.train.mfu import peak_flops

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    batch = args.batch or (256 if on_gpu else 8)
    batch_for = dict(args.batch_for)
    if not on_gpu and "auto" in {batch, *batch_for.values()}:
        parser.error("a batch of auto is chosen by GPU memory: this machine has no GPU")
    steps = args.steps or (20 if on_gpu else 3)
    _init_process_group()
    matmul = matmul_flops_per_s(device, torch.bfloat16 if on_gpu else torch.float32, 8192 if on_gpu else 1024)
    peak = peak_flops("auto") if on_gpu else None
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    batch_for = {name: batch_for.get(name, batch) for name in args.models}
    batch_for = {name: auto_batch(name, device) if n == "auto" else n for name, n in batch_for.items()}
    plans = _plans(args, steps=steps, device=device, batch_for=batch_for)
    rows = []
    for label, run in plans:
        try:
            r = run()
        except Exception:  # noqa: BLE001 -- one failed measurement must not lose the others (GPU time is scarce)
            print(f"FAILED {label}:\n{traceback.format_exc(limit=6)}", flush=True)
            continue
        achieved = r["model_tflops_per_s"] * 1e12
        r.update(device=device_name, matmul_tflops_per_s=matmul / 1e12, ratio_to_matmul=achieved / matmul,
                 mfu=achieved / peak if peak else None)
        rows.append(r)
        print(json.dumps(r), flush=True)  # one line per measurement as it lands: a cut-short run keeps it
    if args.out is not None:
        args.out.write_text(json.dumps({"device": device_name, "rows": rows}, indent=2))
    if args.json:
        print(json.dumps({"device": device_name, "results": rows}, indent=2))
        return rows
    print(f"large-matmul rate here: {matmul / 1e12:.1f} TFLOP/s"
          + (f"; dense bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else "; no peak table for this device"))
    print("\n".join(_table(rows, device_name)))
    return rows


if __name__ == "__main__":
    main()
