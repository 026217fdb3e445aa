"""Training throughput fed by real data: the worker loop on JPEG shards against the same step on a fixed batch.

    python benchmarks/train_data.py                                   # GPU: ViT-B/16, 224 px, batch 256, 60 steps
    python benchmarks/train_data.py --loader-workers 4 8 12 --train compile=true --out train_data.json
    python benchmarks/train_data.py --data DIR                        # reuse a shard set (written with --workdir)
    python benchmarks/train_data.py --images 64 --jpeg-size 48 --classes 8 --batch 8 --steps 4   # CPU, seconds

What it does, in one process on one device:

1. Makes ``--images`` photo-like JPEGs (random crops of scikit-learn's two bundled photographs, scaled
   to ``--jpeg-size`` on the long side at 4:3, mirrored, colour-shifted; quality 90) as a class-per-folder
   tree with a process pool over every core, then shards them with vitscale's own writer
   (``write_dataset("folder:DIR")``, a thread per core). Both times are printed; the writer decodes and
   re-encodes every image (``data/tools/images.encode_image``), so its time is that of a full re-encode.
   ``--data DIR`` skips this and reads an existing shard set.
2. Runs the real worker loop (``vitscale.train.loop.train``, rank 0 of a one-rank process group: NCCL on
   GPU, gloo on CPU, as Ray Train sets it up) on those shards for ``--steps`` steps with
   ``data.num_workers`` = each of ``--loader-workers``, no evaluation, and only the final checkpoint
   (written after the last step's time is taken, so it is not in the figures). Every step's metrics
   are read back from the run's metrics file (``metrics/rank0.jsonl``, as a user reads them); the
   figure is the median images/s of the steps after the first quarter (compilation and the loader
   workers' start land there).
3. Times the fixed-batch step of the same model, batch, ZeRO stage, precision and compile setting with
   no data loading, first and once: ``benchmarks/mfu.py``'s ``bench_vitscale`` (the loop's own ``Stepper``
   on a uint8 batch already on the device; its head has 1000 classes, the data's 100: a negligible
   difference), or the same measurement here for a precision or micro batch it does not take; and, per
   worker count, the CPU decode rate: ``ShardStream`` with
   that many workers and no model (``data/tools/bench.measure``), the most the loader alone can feed.

Prints a markdown row per loader-worker count (loop images/s, fixed-batch images/s, their ratio, target
>= 0.95; median data wait per step; loader processes seen alive mid-run; the decode rate alone) and
one JSON line per measurement as it lands (stdout); progress goes to stderr, the loop's own step
lines to ``WORKDIR/loop-wN.log`` (``--verbose`` shows them). ``--out FILE`` writes all results as JSON.

Cost on 2 CPU cores (photo JPEGs 2.6 ms each a core, the writer's re-encode ~1,000 a second on 2 threads):
the tiny CPU run above takes ~8 s, the CPU defaults (256 JPEGs of 400 px, 6 steps) ~9 s. On a 16-core GPU
machine the 20,000 JPEGs and shards take ~10 s; the rest is compiling the model (once for the fixed
batch, again, mostly from inductor's cache, for each loop), the steps, and each loop's final checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from photos import bundled_photos, photo_like  # benchmarks/photos.py, beside this script

BENCHMARKS = Path(__file__).resolve().parent
WARMUP_FRACTION = 0.25
"""Share of the loop's first steps left out of its figure: compilation and worker start-up land there."""
TARGET_RATIO = 0.95
CPU_TINY_MODEL = {"name": "ViT-Ti/8", "img_size": 32, "depth": 2, "width": 64, "mlp_dim": 128, "heads": 2}


def say(text: str) -> None:
    """A progress line (stderr: stdout holds the JSON lines and the table)."""
    print(f"[vitscale] train_data: {text}", file=sys.stderr, flush=True)


def emit(record: dict[str, Any]) -> None:
    """One JSON line per measurement as it lands: a run cut short keeps what it measured."""
    print(json.dumps(record), flush=True)


# ----------------------------------------------------------------------------- photo-like JPEGs

_PHOTOS: list[Any] = []


def _load_photos() -> None:
    """Pool initializer: the bundled photographs, once per process."""
    _PHOTOS[:] = bundled_photos()


def _write_jpegs(job: tuple[Path, list[int], tuple[int, int], int, int]) -> int:
    """Write images ``ns`` as ``root/class_k/img_n.jpg``; each from its own seeded RNG, so the set is the
    same whatever the number of processes (`photos.photo_like`, the recipe data_throughput.py writes too)."""
    root, ns, size, classes, seed = job
    for n in ns:
        img = photo_like(_PHOTOS[n % len(_PHOTOS)], random.Random(seed * 1_000_003 + n), size)
        folder = root / f"class_{n % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"img_{n:06d}.jpg", quality=90)
    return len(ns)


def make_jpegs(root: Path, images: int, long_side: int, classes: int, processes: int, seed: int = 0) -> float:
    """``images`` JPEGs of ``long_side`` x 3/4 of it under ``root``, over ``processes``; returns seconds."""
    size = (long_side, max(1, round(long_side * 3 / 4)))
    chunk = max(1, min(256, images // (4 * processes) or 1))  # several chunks a process: even finish
    jobs = [(root, list(range(i, min(i + chunk, images))), size, classes, seed) for i in range(0, images, chunk)]
    t0 = time.perf_counter()
    with multiprocessing.Pool(processes, initializer=_load_photos) as pool:
        sum(pool.imap_unordered(_write_jpegs, jobs))
    return time.perf_counter() - t0


def write_shards(jpegs: Path, out: Path, max_side: int, workers: int, images: int) -> float:
    """vitscale's writer over the folder (re-encodes every image on ``workers`` threads); returns seconds."""
    from vitscale.data.tools.write import write_dataset

    t0 = time.perf_counter()
    # ~16 shards or more: every loader worker can have one of its own to read from.
    write_dataset(f"folder:{jpegs}", str(out), shard_size=min(1000, max(32, images // 16)), max_side=max_side,
                  quality=90, progress=False, workers=workers)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the process group


def init_process_group(on_gpu: bool) -> None:
    """A one-rank group, as Ray Train sets up for a worker (tests/test_gpu_training.py's `nccl_group`)."""
    import torch

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    if on_gpu:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    from vitscale.train.engine import init_distributed

    # DeepSpeed adopts the group now, as the loop has it do: on CPU that also keeps DeepSpeed from
    # JIT-building its shared-memory all-reduce (~40 s on 2 cores) when the fixed-batch engine is built first.
    init_distributed(on_gpu)


# ----------------------------------------------------------------------------- the loop


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` items, values parsed as YAML (as ``vitscale run --set`` does)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"train_data: {flag} {item!r}: expected KEY=VALUE, e.g. {flag} compile=true")
        out[key.strip()] = yaml.safe_load(text) if text.strip() else ""
    return out


def build_job(data: str, model: dict[str, Any], *, batch: int, micro_batch: int, steps: int, zero_stage: int,
              precision: str, loader_workers: int, on_gpu: bool, extra_train: dict[str, Any]) -> Any:
    """The pre-training job a pipeline with these settings gives (`build_pipeline` + `pretraining_job`)."""
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job

    train = {"global_batch": batch, "micro_batch": micro_batch, "max_steps": steps,
             "warmup_steps": max(1, steps // 10), "base_lr": 1e-3, "zero_stage": zero_stage,
             "precision": precision,
             # Past the last step: the only checkpoint is the final one, after the last step's time is taken.
             "checkpoint_every": steps + 1,
             # A progress line per step in the log (the figures come from the metrics file, every step).
             "log_every": 1}
    return pretraining_job(build_pipeline({
        "model": model,
        "data": {"url": data, "num_workers": loader_workers},
        "train": {**train, **extra_train},
        "cluster": {"num_workers": 1, "use_gpu": on_gpu},
    }))


def loader_processes() -> int:
    """This process's live children that are loader workers: forked copies of it (DataLoader's default
    start method here), not the compiler's worker pool (which runs its own module)."""
    import psutil

    me = psutil.Process()
    own = me.cmdline()
    count = 0
    for child in me.children(recursive=False):
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if child.is_running() and (cmd == own or any("multiprocessing" in part for part in cmd)):
                count += 1
    return count


class LoaderCount:
    """The loader processes alive mid-run, counted at step `sample_at` from inside the loop: the loop asks
    its context once per step whether the rank was told to stop (`WorkerContext.terminated`, a SIGTERM
    notice under Ray), and this stand-in counts there and never tells it to stop."""

    def __init__(self, sample_at: int) -> None:
        self.sample_at, self.asked = sample_at, 0
        self.processes: int | None = None

    def __call__(self) -> None:
        self.asked += 1  # the n-th ask is during step n, once its micro-batches have run
        if self.asked == self.sample_at:
            self.processes = loader_processes()


def step_rows(metrics_file: Path) -> list[dict[str, Any]]:
    """Every step the loop recorded (``metrics/rank0.jsonl`` of the run)."""
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def steady(metrics: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The loop's figures over the steps after the warm-up quarter."""
    by_step = {int(m["step"]): m for m in metrics}  # a step recorded twice (a restart): the last wins
    steps = [by_step[s] for s in sorted(by_step)]
    kept = steps[math.ceil(len(steps) * WARMUP_FRACTION):] or steps
    times = [float(m["step_time_s"]) for m in kept]
    waits = [float(m["data_wait_s"]) for m in kept]
    return {
        "steps": len(steps), "steady_steps": len(kept), "first_steady_step": int(kept[0]["step"]),
        "images_per_s": statistics.median(float(m["images_per_s"]) for m in kept),
        # All steady steps' images over their summed time: a periodic stall (a worker late every Nth
        # step) shows here when the median hides it.
        "images_per_s_sustained": batch * len(kept) / sum(times),
        "step_time_s": statistics.median(times),
        "data_wait_s": statistics.median(waits),
        "data_wait_max_s": max(waits),
        "data_wait_share": sum(waits) / sum(times),
        "compute_s": statistics.median(float(m["compute_s"]) for m in kept),
        "first_step_s": float(steps[0]["step_time_s"]),
        "mfu": statistics.median(m["mfu"] for m in kept) if all(m.get("mfu") is not None for m in kept) else None,
    }


def run_loop(job: Any, run_dir: Path, log: Path, verbose: bool, batch: int, steps: int) -> dict[str, Any]:
    """``train(job, ctx)`` as rank 0 of 1; the step figures (`steady`) and the loop's summary."""
    from vitscale.train.loop import WorkerContext, train

    shutil.rmtree(run_dir, ignore_errors=True)  # a kept --workdir's earlier run: its metrics file would go on
    metrics_file = run_dir / "metrics" / "rank0.jsonl"
    counter = LoaderCount(sample_at=max(1, min(steps, math.ceil(steps * WARMUP_FRACTION) + 1)))
    ctx = WorkerContext(rank=0, world_size=1, run_dir=run_dir, report=lambda metrics, checkpoint_dir: None,
                        terminated=counter)
    t0 = time.perf_counter()
    with open(log, "w", buffering=1) as out, \
            contextlib.nullcontext() if verbose else contextlib.redirect_stdout(out):
        try:
            summary = train(job, ctx)
        except BaseException:
            if not verbose:
                sys.stdout.flush()
                print("".join(log.read_text().splitlines(keepends=True)[-20:]), file=sys.stderr)
            raise
    wall = time.perf_counter() - t0
    return {**steady(step_rows(metrics_file), batch), "loader_processes": counter.processes,
            "summary_steps": int(summary["steps"]), "wall_s_with_startup_and_checkpoint": wall}


# ----------------------------------------------------------------------------- the peers


def fixed_batch(job: Any, num_classes: int, device: Any, steps: int) -> dict[str, Any]:
    """Images/s of the same step on a fixed batch already on the device: ``benchmarks/mfu.py``'s
    ``bench_vitscale`` (the loop's own ``Stepper``), or, for a precision or micro batch it does not take,
    the same measurement here on the job's own recipe."""
    sys.path.insert(0, str(BENCHMARKS))
    import mfu

    model, train = job.model, job.train
    on_gpu = device.type == "cuda"
    compiled = train.compiles(on_gpu)
    # bench_vitscale's own choices: bf16 on GPU and fp32 on CPU, one micro batch a step.
    if train.precision == ("bf16" if on_gpu else "fp32") and train.micro_batch == train.global_batch:
        result = mfu.bench_vitscale(model.name, batch=train.global_batch, steps=steps, zero_stage=train.zero_stage,
                                    device=device, compile_model=compiled, compile_mode=train.compile_mode,
                                    img_size=model.img_size, options=dict(model.options))
        return {**result, "by": "benchmarks/mfu.py bench_vitscale", "compiled": compiled}
    return {**_fixed_batch_here(job, num_classes, device, steps), "by": "train_data.py (precision or micro batch "
            "bench_vitscale does not take)", "compiled": compiled}


def _fixed_batch_here(job: Any, num_classes: int, device: Any, steps: int) -> dict[str, Any]:
    """bench_vitscale's measurement (the loop's `Stepper` on a uint8 batch already on the device, warm-up
    steps, a device sync around each step, the median) with the job's own train section."""
    import itertools

    import torch

    from vitscale.train.batch import derive_batch
    from vitscale.train.engine import build_engine, deepspeed_config
    from vitscale.train.step import Stepper

    model_cfg, train = job.model, job.train
    on_gpu = device.type == "cuda"
    torch.manual_seed(train.seed)
    plan = derive_batch(train.global_batch, train.micro_batch, 1)
    model = model_cfg.build(num_classes)
    parameters = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, train, deepspeed_config(train, plan, on_gpu=on_gpu, parameters=parameters),
                          on_gpu=on_gpu)
    stepper = Stepper(engine, train, plan, device, world_size=1)
    r = model_cfg.img_size
    batches = itertools.repeat({
        "image": torch.randint(0, 256, (plan.micro_batch, 3, r, r), dtype=torch.uint8, device=device),
        "label": torch.randint(0, num_classes, (plan.micro_batch,), device=device),
        "key": [f"{i:06d}" for i in range(plan.micro_batch)]})
    times = []
    for i in range(steps + 3):  # 3 warm-up steps: compilation, the allocator, autotuning
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stepper.step(batches, 1e-4)
        if on_gpu:
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    del stepper, engine
    return {"model": model_cfg.name, "img_size": r, "batch": train.global_batch, "micro_batch": train.micro_batch,
            "precision": train.precision, "zero_stage": train.zero_stage, "step_ms": 1e3 * step,
            "images_per_s": train.global_batch / step}


def decode_rate(data: str, workers: int, batch: int, resolution: int, seconds: float) -> dict[str, Any]:
    """Images/s the loader sustains alone: ``ShardStream`` with ``workers`` processes, training transform."""
    import torch

    from vitscale.data.loader.stream import ShardStream
    from vitscale.data.tools.bench import measure

    stream = ShardStream(data, "train", batch_size=batch, resolution=resolution, train=True, num_workers=workers)
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)  # decoding in this process: as DataLoader sets in its workers
    try:
        m = measure(lambda: stream, lambda b: len(b["key"]), seconds)
    finally:
        torch.set_num_threads(threads)
    return {"images_per_s": m["images_per_s"], "images_per_cpu_s": m["images_per_cpu_s"], "seconds": m["wall_s"],
            "startup_s": m["startup_s"], "images": int(m["images"])}


def free_device_memory(on_gpu: bool) -> None:
    """What the last engine left allocated, gone before the next one is built."""
    import torch

    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- output


def table(rows: list[dict[str, Any]], fixed: dict[str, Any]) -> str:
    lines = ["| loader workers | loader procs | loop img/s | fixed-batch img/s | loop / fixed | data wait/step | "
             "decode img/s (loader alone) | decode / fixed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        loop, decode = r["loop"], r["decode"]
        procs = "n/a" if loop["loader_processes"] is None else str(loop["loader_processes"])
        lines.append(f"| {r['loader_workers']} | {procs} | {loop['images_per_s']:.1f} | {fixed['images_per_s']:.1f} | "
                     f"{r['ratio']:.3f} | {loop['data_wait_s'] * 1e3:.1f} ms | {decode['images_per_s']:.1f} | "
                     f"{decode['images_per_s'] / fixed['images_per_s']:.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None, on_gpu: bool) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="an existing shard set to train on (default: write one)")
    p.add_argument("--workdir", help="where the JPEGs, shards and runs go, kept (default: a temporary folder)")
    p.add_argument("--images", type=int, default=20000 if on_gpu else 256, help="JPEGs to write")
    p.add_argument("--jpeg-size", type=int, default=400, help="long side of the JPEGs (4:3)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--write-processes", type=int, default=cores, help="processes (and writer threads)")
    p.add_argument("--model", help="model name (default ViT-B/16 on GPU, a 2-layer ViT-Ti/8 on CPU)")
    p.add_argument("--img-size", type=int, help="training resolution (default 224 on GPU, 32 on CPU)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a model option")
    p.add_argument("--batch", type=int, default=256 if on_gpu else 16, help="global batch")
    p.add_argument("--micro-batch", type=int, help="micro batch (default: the global batch, as bench_vitscale)")
    p.add_argument("--steps", type=int, default=60 if on_gpu else 6)
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--loader-workers", type=int, nargs="+",
                   default=[min(12, max(1, cores - 2))] if on_gpu else [1], help="data.num_workers; several sweep")
    p.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                   help="merged into the job's train section (e.g. compile=true, precision=fp32)")
    p.add_argument("--fixed-steps", type=int, default=20 if on_gpu else 3, help="timed fixed-batch steps")
    p.add_argument("--decode-seconds", type=float, default=5.0 if on_gpu else 2.0)
    p.add_argument("--out", help="write the results as JSON here too")
    p.add_argument("--verbose", action="store_true", help="the loop's own step lines on the terminal")
    args = p.parse_args(argv)
    if min(args.loader_workers) < 0:
        p.error("--loader-workers must be >= 0")
    return args


def model_section(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    if args.model is None and not on_gpu:
        base = dict(CPU_TINY_MODEL)
    else:
        base = {"name": args.model or "ViT-B/16", "img_size": 224 if on_gpu else 32}
    if args.img_size is not None:
        base["img_size"] = args.img_size
    return {**base, **key_values(args.option, "--option")}


def prepare_data(args: argparse.Namespace, workdir: Path) -> tuple[str, dict[str, Any]]:
    """The shard set to train on (written unless --data), and what writing it cost."""
    if args.data:
        from vitscale.data.format import read_meta

        meta = read_meta(args.data)
        return args.data, {"measure": "data", "data": args.data, "images": meta.samples("train"),
                           "classes": meta.num_classes, "written": False}
    jpegs, shards = workdir / "jpegs", workdir / "shards"
    if (shards / "dataset.json").exists():
        from vitscale.config.errors import UserError

        raise UserError(f"{shards} holds a shard set already: --data {shards} reuses it; or another --workdir")
    say(f"writing {args.images} JPEGs of {args.jpeg_size} px on {args.write_processes} processes")
    t_jpeg = make_jpegs(jpegs, args.images, args.jpeg_size, args.classes, args.write_processes)
    say(f"JPEGs in {t_jpeg:.1f}s ({args.images / t_jpeg:.0f}/s); sharding them (vitscale's writer re-encodes)")
    t_shard = write_shards(jpegs, shards, args.jpeg_size, args.write_processes, args.images)
    record = {"measure": "data", "data": str(shards), "images": args.images, "classes": args.classes,
              "jpeg_size": args.jpeg_size, "written": True, "processes": args.write_processes,
              "jpeg_s": t_jpeg, "shard_s": t_shard, "shard_images_per_s": args.images / t_shard,
              "shard_bytes": sum(p.stat().st_size for p in shards.glob("*.tar"))}
    say(f"shards in {t_shard:.1f}s ({args.images / t_shard:.0f} images/s, {args.write_processes} threads)")
    return str(shards), record


def measure_all(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from vitscale.data.format import read_meta

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    model = model_section(args, on_gpu)
    extra_train = key_values(args.train, "--train")
    precision = "bf16" if on_gpu else "fp32"
    data = args.data or str(workdir / "shards")

    def job_for(workers: int) -> Any:
        return build_job(data, model, batch=args.batch, micro_batch=args.micro_batch or args.batch,
                         steps=args.steps, zero_stage=args.zero_stage, precision=precision,
                         loader_workers=workers, on_gpu=on_gpu, extra_train=extra_train)

    job_for(args.loader_workers[0])  # every setting checked before the data is written
    data, data_record = prepare_data(args, workdir)
    emit({"device": device_name, **data_record})
    meta = read_meta(data)
    if args.batch > meta.samples("train"):
        from vitscale.config.errors import UserError

        raise UserError(f"--batch {args.batch} cannot be filled: {data} has {meta.samples('train')} training images")
    first = job_for(args.loader_workers[0])
    train = first.train
    if args.steps * args.batch > meta.samples("train"):
        say(f"note: {args.steps} steps of {args.batch} pass an epoch end of {meta.samples('train')} images: "
            "the loader's workers read on into the next epoch (`data/loader/stream.py`), inside the figures")
    init_process_group(on_gpu)
    setting = {"device": device_name, "model": model, "batch": train.global_batch, "micro_batch": train.micro_batch,
               "steps": args.steps, "zero_stage": train.zero_stage, "precision": train.precision,
               "compiled": train.compiles(on_gpu), "train_extra": extra_train, "cpu_count": os.cpu_count()}
    say(f"fixed batch: {model['name']} at {model['img_size']} px, batch {train.global_batch}, ZeRO {train.zero_stage}, "
        f"{train.precision}, compile {setting['compiled']}")
    fixed = fixed_batch(first, meta.num_classes, device, args.fixed_steps)
    free_device_memory(on_gpu)
    emit({"measure": "fixed_batch", **setting, **fixed})
    say(f"fixed batch: {fixed['images_per_s']:.1f} images/s")
    rows = []
    for workers in args.loader_workers:
        job = first if workers == args.loader_workers[0] else job_for(workers)
        kept = "" if args.workdir else "; --workdir keeps them"
        say(f"loop: {args.steps} steps with {workers} loader workers (step lines: {workdir / f'loop-w{workers}.log'}"
            f"{kept})")
        loop = run_loop(job, workdir / f"run-w{workers}", workdir / f"loop-w{workers}.log", args.verbose,
                        train.global_batch, args.steps)
        free_device_memory(on_gpu)
        ratio = loop["images_per_s"] / fixed["images_per_s"]
        emit({"measure": "loop", **setting, "loader_workers": workers, **loop, "fixed_images_per_s":
              fixed["images_per_s"], "ratio": ratio, "target": TARGET_RATIO})
        decode = decode_rate(data, workers, train.micro_batch, model["img_size"], args.decode_seconds)
        emit({"measure": "decode", "device": device_name, "loader_workers": workers, "batch": train.micro_batch,
              "resolution": model["img_size"], **decode})
        say(f"{workers} loader workers: loop {loop['images_per_s']:.1f} images/s ({ratio:.3f} of the fixed batch), "
            f"data wait {loop['data_wait_s'] * 1e3:.1f} ms/step; loader alone {decode['images_per_s']:.1f} images/s")
        rows.append({"loader_workers": workers, "loop": loop, "decode": decode, "ratio": ratio})
    return {"setting": setting, "data": data_record, "fixed_batch": fixed, "rows": rows, "target_ratio": TARGET_RATIO}


@contextlib.contextmanager
def work_folder(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    tmp = Path(tempfile.mkdtemp(prefix="vitscale-train-data-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    import torch

    from vitscale.config.checks import ConfigError
    from vitscale.config.errors import UserError
    from vitscale.data.format import DatasetError

    args = parse_args(argv, torch.cuda.is_available())
    try:
        with work_folder(args.workdir) as workdir:
            results = measure_all(args, workdir)
    except (ConfigError, UserError, DatasetError) as exc:  # a setting or the data: one line, as the CLI does
        print(f"train_data: {exc}", file=sys.stderr)
        return 2
    s = results["setting"]
    print(f"\n{s['device']}: {s['model']['name']} at {s['model']['img_size']} px, batch {s['batch']}, "
          f"ZeRO {s['zero_stage']}, {s['precision']}, compile {s['compiled']}, {s['steps']} steps "
          f"(median of the last {results['rows'][0]['loop']['steady_steps']}); target loop / fixed >= {TARGET_RATIO}")
    print(table(results["rows"], results["fixed_batch"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
