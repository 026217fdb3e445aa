"""Images/s and MFU of ViT-B/16 and ViT-L/16 training steps on whatever device is present.

    python benchmarks/mfu.py [--models ViT-B/16 ViT-L/16] [--batch 128] [--steps 20] [--zero-stages 0 1 2 3]

One process, one device, the vitscale model inside a DeepSpeed engine exactly as a worker builds
it (bf16 on GPU), fed a fixed in-memory batch so the data loader is out of the picture. MFU is the
paper-convention model FLOPs (3x forward, `scaling.flops`) per second over the device's dense bf16
peak (`train.metrics.PEAK_BF16_FLOPS`). The peer measured in the same run is the device's own
large-matmul throughput, so the printed ratio says how close the model step gets to what the
hardware's matmul actually delivers here (on a CPU, where no peak table applies, that is the only
meaningful denominator). Targets on one H200: >= 45% MFU for ViT-B/16, >= 50% for ViT-L/16.

Each ZeRO stage asked for is measured in turn, with the peak GPU memory of its step. On one device
ZeRO has no peer to shard with, so the memory column shows each stage's own overhead at world size 1,
not the per-rank saving it gives on N GPUs (model states / N for what the stage shards).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, n: int, seconds: float = 3.0) -> float:
    """Achieved FLOP/s of square matmuls: the hardware's practical peak in this process."""
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
    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


def bench_model(name: str, *, batch: int, steps: int, zero_stage: int, device: torch.device,
                compile_model: bool = False) -> dict:
    from vitscale.models import create_model
    from vitscale.scaling.flops import forward_flops
    from vitscale.train.config import TrainConfig
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.losses import classification_loss
    from vitscale.train.optim import derive_batch

    on_gpu = device.type == "cuda"
    # What an earlier measurement left allocated (DeepSpeed keeps some buffers past `del engine`) is
    # not this one's: its memory column is the peak above this.
    resident = torch.cuda.memory_allocated(device) if on_gpu else 0
    precision = "bf16" if on_gpu else "fp32"
    train = TrainConfig(global_batch=batch, micro_batch=batch, zero_stage=zero_stage, precision=precision,
                        weight_decay=0.1)
    model = create_model(name, num_classes=1000, img_size=224)
    if on_gpu:
        model = model.to(device)
    engine = build_engine(model, train, deepspeed_config(train, derive_batch(batch, batch, 1), on_gpu=on_gpu))
    dtype = torch.bfloat16 if on_gpu else torch.float32
    images = torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)
    labels = torch.randint(0, 1000, (batch,), device=device)
    if compile_model:
        engine.compile()  # torch.compile (inductor) of the module inside the engine; warm-up compiles it
    times = []
    for i in range(steps + 3):  # 3 warm-up steps (allocator, autotuning)
        _sync(device)
        t0 = time.perf_counter()
        loss = classification_loss(engine(images), labels, kind="softmax")
        engine.backward(loss)
        engine.step()
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]  # median: robust to a stray slow step
    # Where a step's time goes: a few more steps with a sync between phases (not in the figures above,
    # which have none).
    phases: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "optimizer_s": []}
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        loss = classification_loss(engine(images), labels, kind="softmax")
        _sync(device)
        t1 = time.perf_counter()
        engine.backward(loss)
        _sync(device)
        t2 = time.perf_counter()
        engine.step()
        _sync(device)
        for key, seconds in zip(phases, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
            phases[key].append(seconds)
    flops_per_image = 3 * forward_flops(name, img_size=224, num_classes=1000)
    result = {"model": name, "batch": batch, "precision": precision, "zero_stage": zero_stage,
              "compiled": compile_model, "step_s": step,
              **{key: sorted(v)[len(v) // 2] for key, v in phases.items()},
              "images_per_s": batch / step, "model_tflops_per_s": flops_per_image * batch / step / 1e12}
    if on_gpu:
        result["max_memory_gib"] = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
    del engine, model
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def _model_batch(text: str) -> tuple[str, int]:
    """`--batch-for` items: MODEL=BATCH with a positive batch (argparse shows the error, naming the item)."""
    name, _, batch = text.partition("=")
    if not name or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL=BATCH with a positive batch, e.g. ViT-H/14=128")
    return name, int(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["ViT-B/16", "ViT-L/16"])
    parser.add_argument("--batch", type=int, default=None, help="per-step batch (default 256 on GPU, 8 on CPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--zero-stages", type=int, nargs="+", default=[1], choices=[0, 1, 2, 3])
    parser.add_argument("--batch-for", nargs="*", default=[], metavar="MODEL=BATCH", type=_model_batch,
                        help="a per-step batch for one model (a large model that does not fit --batch)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model inside the engine")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from vitscale.train.metrics import peak_flops

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    batch = args.batch or (256 if on_gpu else 8)
    steps = args.steps or (20 if on_gpu else 3)
    _init_process_group()
    peer = matmul_flops_per_s(device, torch.bfloat16 if on_gpu else torch.float32, 8192 if on_gpu else 1024)
    peak = peak_flops("auto") if on_gpu else None
    batch_for = dict(args.batch_for)
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    rows = []
    for name in args.models:
        for stage in args.zero_stages:
            r = bench_model(name, batch=batch_for.get(name, batch), steps=steps, zero_stage=stage,
                            device=device, compile_model=args.compile)
            achieved = r["model_tflops_per_s"] * 1e12
            r["matmul_peer_tflops_per_s"] = peer / 1e12
            r["ratio_to_matmul_peer"] = achieved / peer
            r["mfu"] = achieved / peak if peak else None
            rows.append(r)
            # One line per measurement as it lands: a run cut short keeps what it measured.
            print(json.dumps({"device": device_name, **r}), flush=True)
    if args.json:
        print(json.dumps({"device": device_name, "results": rows}, indent=2))
        return
    print(f"device: {device_name}; large-matmul peer: {peer / 1e12:.1f} TFLOP/s"
          + (f"; dense bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else "; no peak table for this device"))
    print("| model | device | ZeRO | batch | images/s | model TFLOP/s | vs matmul peer | MFU | peak GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        memory = f"{r['max_memory_gib']:.1f}" if "max_memory_gib" in r else "n/a"
        print(f"| {r['model']} | {device_name} | {r['zero_stage']} | {r['batch']} | {r['images_per_s']:.1f} | "
              f"{r['model_tflops_per_s']:.2f} | {r['ratio_to_matmul_peer']:.2f} | {mfu} | {memory} |")


if __name__ == "__main__":
    main()
