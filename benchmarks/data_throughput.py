"""Data-loader throughput, side by side in one run: ours vs what a typical user writes.

Loaders, all doing the same work (Inception random-resized crop + flip to ``--resolution``, batches
of ``--batch-size``, the same number of decode processes):

1. ``vitscale``: ``ShardStream`` (ranged reads, reduced-scale libjpeg-turbo decode, crop+resize in
   one call, uint8 batches collated in place; normalisation left to the accelerator);
2. ``webdataset+PIL``: ``wds.WebDataset(...).shuffle().decode("pil")`` + a PIL random-resized crop
   + flip + a torchvision-style ``ToTensor`` (float /255) and default collation;
3. ``jpeg folder``: one JPEG file per image read through a map-style ``Dataset`` (ImageFolder
   style) with the same PIL transform.

Without ``--data`` it first makes photo-sized JPEGs (``--size``, default 500x375, from
scikit-learn's two bundled photographs, randomly cropped, scaled, mirrored and colour-shifted) as
a class-per-folder tree, and shards them with ``vitscale.data.tools.write.write_dataset``.

Rates are images per CPU-second (all loader processes; "per core") and per wall-clock second;
loaders are measured in interleaved rounds and the median round is kept, so load from other users
of the machine hits all three alike. Prints a table and the ratios against ``webdataset+PIL``.

    python benchmarks/data_throughput.py --seconds 8 --rounds 3 [--workers 1] [--data DIR --jpegs DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from photos import bundled_photos, photo_like  # benchmarks/photos.py, beside this script
from vitscale.data.loader.stream import ShardStream
from vitscale.data.tools.bench import measure

# ----------------------------------------------------------------------------- synthetic photos


def make_jpeg_folder(root: Path, images: int, size: tuple[int, int], classes: int, seed: int) -> Path:
    """``root/class_k/img_n.jpg`` photo-like JPEGs (quality 90): `photos.photo_like` views of sklearn's photos."""
    photos = bundled_photos()
    rng = random.Random(seed)
    for n in range(images):
        folder = root / f"class_{n % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        photo_like(photos[n % len(photos)], rng, size).save(folder / f"img_{n:06d}.jpg", quality=90)
    return root


# ----------------------------------------------------------------------------- the peers' transform


def rrc_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (scale (0.08, 1), ratio (3/4, 4/3))."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return x, y, w, h
    return 0, 0, width, height


class PilTrainTransform:
    """RandomResizedCrop + RandomHorizontalFlip + ToTensor, the way a torchvision user writes it."""

    def __init__(self, resolution: int) -> None:
        self.resolution = resolution
        self.rng = random.Random(0)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        img = img.convert("RGB")
        x, y, w, h = rrc_box(img.width, img.height, self.rng)
        img = img.crop((x, y, x + w, y + h)).resize((self.resolution,) * 2, Image.Resampling.BILINEAR)
        if self.rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # torchvision.transforms.functional.to_tensor for an RGB PIL image:
        t = torch.from_numpy(np.array(img, np.uint8, copy=True)).permute(2, 0, 1).contiguous()
        return t.to(torch.float32).div(255)


class JpegFolder(Dataset):
    """ImageFolder-style: one file per sample, decoded with PIL."""

    def __init__(self, root: Path, resolution: int) -> None:
        self.files = sorted(root.rglob("*.jpg"))
        classes = sorted({f.parent.name for f in self.files})
        self.labels = [classes.index(f.parent.name) for f in self.files]
        self.transform = PilTrainTransform(resolution)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with open(self.files[i], "rb") as f:
            img = Image.open(io.BytesIO(f.read()))
            return self.transform(img), self.labels[i]


# ----------------------------------------------------------------------------- loaders


def loaders(data: str, jpegs: Path, args: argparse.Namespace) -> dict[str, Any]:
    """name -> (make_epoch_iterable, images_in_batch)."""
    nw = 0 if args.workers == 1 else args.workers
    bs, res = args.batch_size, args.resolution
    stream = ShardStream(data, "train", batch_size=bs, resolution=res, num_workers=nw, error_budget=0.5)
    shards = sorted(str(p) for p in Path(data).glob("train-*.tar"))

    def webdataset_epoch() -> Any:
        ds = (
            wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False)
            .shuffle(1000)
            .decode("pil")
            .to_tuple("jpg", "cls")
            .map_tuple(PilTrainTransform(res), int)
        )
        return wds.WebLoader(ds, batch_size=bs, num_workers=nw)

    folder = JpegFolder(jpegs, res)

    def folder_epoch() -> Any:
        return DataLoader(folder, batch_size=bs, shuffle=True, num_workers=nw, drop_last=True)

    return {
        "vitscale": (lambda: stream, lambda b: len(b["key"])),
        "webdataset+PIL": (webdataset_epoch, lambda b: len(b[1])),
        "jpeg folder": (folder_epoch, lambda b: len(b[1])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="an existing shard set (local folder); default: make one")
    p.add_argument("--jpegs", help="the JPEG folder the shards were made from (with --data)")
    p.add_argument("--images", type=int, default=1536, help="synthetic images to make")
    p.add_argument("--size", default="500x375", help="synthetic image size WxH")
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="decode processes per loader")
    p.add_argument("--seconds", type=float, default=8.0, help="per loader per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    # One intra-op thread, as DataLoader sets in its worker processes: with workers=1 every loader
    # runs in this process, and torch's thread pool would otherwise stall the peers' float ops.
    torch.set_num_threads(1)

    tmp = tempfile.TemporaryDirectory(prefix="vitscale-bench-")
    if args.data:
        if not args.jpegs:
            p.error("--data needs --jpegs (the per-file loader reads the same images)")
        data, jpegs = args.data, Path(args.jpegs)
    else:
        from vitscale.data.tools.write import write_dataset

        w, h = (int(v) for v in args.size.lower().split("x"))
        jpegs = make_jpeg_folder(Path(tmp.name) / "jpegs", args.images, (w, h), 10, seed=0)
        data = str(Path(tmp.name) / "shards")
        t0 = time.perf_counter()
        write_dataset(f"folder:{jpegs}", data, shard_size=256, max_side=max(w, h), quality=90, progress=False)
        print(f"made {args.images} {w}x{h} JPEGs and shards in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    runs: dict[str, list[dict[str, float]]] = {}
    named = loaders(data, jpegs, args)
    for r in range(args.rounds):
        for name, (make, count) in named.items():
            m = measure(make, count, args.seconds)
            runs.setdefault(name, []).append(m)
            print(f"round {r + 1}/{args.rounds} {name:15s} {m['images_per_cpu_s']:7.1f} img/cpu-s "
                  f"{m['images_per_s']:7.1f} img/s", file=sys.stderr)  # fmt: skip
    results = {
        name: {
            "images_per_cpu_s": statistics.median(m["images_per_cpu_s"] for m in ms),
            "images_per_s": statistics.median(m["images_per_s"] for m in ms),
        }
        for name, ms in runs.items()
    }
    base = results["webdataset+PIL"]
    for v in results.values():
        v["ratio_per_core"] = v["images_per_cpu_s"] / base["images_per_cpu_s"]
        v["ratio_wall"] = v["images_per_s"] / base["images_per_s"]
    if args.json:
        print(json.dumps({"workers": args.workers, "resolution": args.resolution, "results": results}, indent=2))
    else:
        print(f"\nworkers={args.workers} resolution={args.resolution} batch={args.batch_size}")
        print("| loader | images/s per core | images/s (wall) | x per core vs webdataset+PIL | x wall |")
        print("|---|---|---|---|---|")
        for name, v in results.items():
            print(f"| {name} | {v['images_per_cpu_s']:.1f} | {v['images_per_s']:.1f} | "
                  f"{v['ratio_per_core']:.2f} | {v['ratio_wall']:.2f} |")  # fmt: skip
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
