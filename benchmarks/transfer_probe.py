"""Does pre-training transfer? The quickstart's tiny ViT, pre-trained on a source, then fine-tuned on digits.

    python benchmarks/transfer_probe.py [--variants synthetic fractal] [--seeds 0 1 2]
        [--ft-steps 150] [--ft-batch 64] [--lr-grid 0.01 0.03 0.1 0.3] [--cache data_cache/transfer_probe]

For each seed and each pre-training variant, in one process (plain PyTorch, one thread):

1. **Pre-train** the quickstart's architecture (ViT-Ti/4 shrunk: depth 4, width 128, MLP 256, 4 heads,
   pre-logits 128, 32 px) on the variant's source with the quickstart's recipe: the source's images
   JPEG-encoded as `shards write` does, 90/10 train/test carve, 6 epochs of the train part at batch
   128 (~253 steps), AdamW (lr 1e-3, weight decay 0.05 on matrices), 40 warm-up steps, cosine decay,
   clipping at 1, softmax loss; vitscale's own Inception crop + flip (`decode_image_into`).
2. **Few-shot probe** the pre-trained representation on digits, as the quickstart's fewshot stage
   does (closed-form least squares, l2 1024, 5 and 25 shots, mean of shot seeds 0-2).
3. **Fine-tune** on digits with the paper's recipe (`vitscale finetune`'s): pre-logits dropped, a
   zero-initialised head, SGD momentum 0.9, linear warm-up over a tenth of the steps then cosine to
   0, no weight decay, clipping at 1, Inception crop + flip at 32 px. The learning rate is selected
   from `--lr-grid` on a dev carve of the training split (`data/carve.py`, 20%); the winner is
   retrained on the whole training split and tested once on the test split.

The same architecture from random weights ("scratch") gets the same steps 2-3 with the same budget.
Digits: sklearn's 1,797 8x8 digits at 64 px (the quickstart's `digits` source), carved 80/20
train/test with seed 0 as the quickstart's dataset is, for every seed (only the training runs'
seeds change).

Prints one table (test accuracy mean ± std over seeds, per variant and scratch) and the margins
over scratch. Pre-trained weights are cached under `--cache` by variant name, seed and epochs, so a
second run with other fine-tuning settings does not pre-train again (clear it when a source changes).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MODEL = {"name": "ViT-Ti/4", "img_size": 32, "depth": 4, "width": 128, "mlp_dim": 256, "heads": 4,
         "representation_size": 128}
"""The quickstart's model section (pipelines/quickstart.yaml); `--model` overrides it."""
QUICKSTART_MODEL = dict(MODEL)

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # The quickstart's source as it is.
    "synthetic": ("synthetic", {"count": 6000, "classes": 10, "image_size": 64}),
    # FractalDB-style IFS classes (vitscale/data/tools/fractal.py) with the source's defaults (dark soft
    # strokes on light ground), the quickstart's image budget.
    "fractal": ("fractal", {"count": 6000, "classes": 10, "image_size": 64}),
    # FractalDB's own look: hard-edged light patches on black.
    "fractal-light-sharp": ("fractal", {"count": 6000, "classes": 10, "image_size": 64, "ink": "light", "blur": 0}),
    # FractalDB's many categories (it has 1,000): 100 classes of 60 images.
    "fractal-c100": ("fractal", {"count": 6000, "classes": 100, "image_size": 64}),
}
"""Pre-training variants: name -> (source kind, `open_source` options). The source's seed is the run's.
`--variants` also takes ad-hoc ones written ``kind:key=value,key=value`` (e.g. ``fractal:classes=20,ink=dark``)."""


def variant(name: str) -> tuple[str, dict[str, Any]]:
    if name in VARIANTS:
        return VARIANTS[name]
    kind, _, rest = name.partition(":")
    options: dict[str, Any] = {"count": 6000, "classes": 10, "image_size": 64}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = int(value)
        except ValueError:
            try:
                options[key] = float(value)
            except ValueError:
                options[key] = value
    return kind, options


@dataclass
class Images:
    """JPEG-encoded images (as in a shard) and their labels."""

    jpegs: list[bytes]
    labels: np.ndarray
    keys: list[str] = field(default_factory=list)

    def subset(self, idx: np.ndarray) -> Images:
        return Images([self.jpegs[i] for i in idx], self.labels[idx], [self.keys[i] for i in idx])

    def __len__(self) -> int:
        return len(self.jpegs)


def encode_source(spec: str, options: dict[str, Any]) -> Images:
    from vitscale.data.tools.sources import open_source
    from vitscale.data.tools.write import encode_image

    src = open_source(spec, **options)
    jpegs, labels, keys = [], [], []
    for s in src:
        jpegs.append(encode_image(s.image, 384, 90)[0])  # the writer's defaults: max side 384, quality 90
        labels.append(s.labels[0])
        keys.append(s.key)
    return Images(jpegs, np.asarray(labels, np.int64), keys)


def decode(images: Images, idx: np.ndarray, *, train: bool, seed: int = 0, epoch: int = 0) -> torch.Tensor:
    """(B, 3, 32, 32) float in [-1, 1]: vitscale's crop/flip/resize of the images at ``idx``."""
    from vitscale.data.loader.decode import decode_image_into
    from vitscale.data.loader.transforms import (
        TransformSpec,
        normalize_on_device,
        sample_rng,
    )

    spec = TransformSpec(resolution=MODEL["img_size"], train=train)
    out = np.empty((len(idx), 3, spec.resolution, spec.resolution), np.uint8)
    for row, i in enumerate(idx):
        rng = sample_rng(seed, epoch, int(i)) if train else None
        decode_image_into(images.jpegs[i], out[row], spec, rng)
    return normalize_on_device(torch.from_numpy(out))


def build_model(num_classes: int, seed: int) -> torch.nn.Module:
    from vitscale.models import create_model

    torch.manual_seed(seed)
    opts = {k: v for k, v in MODEL.items() if k not in ("name", "img_size")}
    return create_model(MODEL["name"], num_classes=num_classes, img_size=MODEL["img_size"], **opts)


def train(model: torch.nn.Module, data: Images, *, steps: int, batch: int, optimizer: torch.optim.Optimizer,
          base_lr: float, warmup: int, seed: int, clip: float = 1.0) -> None:
    """Epochs of seeded shuffles of ``data``, ``steps`` optimiser steps, cosine after linear warm-up."""
    from vitscale.train.optim import lr_at

    model.train()
    per_epoch = len(data) // batch
    order: np.ndarray = np.empty(0, np.int64)
    for step in range(steps):
        epoch, pos = divmod(step, per_epoch)
        if pos == 0:
            order = np.random.default_rng([seed, epoch]).permutation(len(data))
        idx = order[pos * batch:(pos + 1) * batch]
        x = decode(data, idx, train=True, seed=seed, epoch=epoch)
        y = torch.from_numpy(data.labels[idx])
        lr = lr_at(step, base_lr=base_lr, total_steps=steps, warmup_steps=warmup, decay="cosine")
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}")


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = torch.cat([model(b).argmax(1) for b in x.split(256)])
    return float((pred == y).float().mean())


@torch.no_grad()
def features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return torch.cat([model.forward_features(b) for b in x.split(256)])


def pretrain(name: str, seed: int, epochs: float, cache: Path | None) -> dict[str, torch.Tensor]:
    """The pre-trained state dict (cached): the quickstart's recipe on the variant's source."""
    from vitscale.data.tools.write import assign_splits
    from vitscale.train.optim import param_groups, steps_for

    spec, options = variant(name)
    tag = name.replace(":", "_").replace(",", "_").replace("=", "")
    tag += "".join(f"-{k}{v}" for k, v in MODEL.items() if v != QUICKSTART_MODEL[k]).replace("/", "")
    path = cache / f"{tag}-s{seed}-e{epochs:g}.pt" if cache else None
    if path is not None and path.exists():
        return torch.load(path, weights_only=True)  # a cached state dict: tensors only
    t0 = time.perf_counter()
    images = encode_source(spec, {**options, "seed": seed})
    t_gen = time.perf_counter() - t0
    split = assign_splits(len(images), {"train": 0.9, "test": 0.1}, seed)
    data, held = images.subset(split["train"]), images.subset(split["test"])
    num_classes = int(images.labels.max()) + 1
    model = build_model(num_classes, seed)
    steps = steps_for(epochs, len(data), 128)
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3, betas=(0.9, 0.999))
    train(model, data, steps=steps, batch=128, optimizer=opt, base_lr=1e-3, warmup=40, seed=seed)
    acc = evaluate(model, decode(held, np.arange(len(held)), train=False), torch.from_numpy(held.labels))
    print(f"  pretrain {name} seed {seed}: {steps} steps, held-out acc {acc:.3f} "
          f"({t_gen:.0f} s source, {time.perf_counter() - t0:.0f} s total)", flush=True)
    state = model.state_dict()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    return state


@dataclass
class Digits:
    train: Images
    test: Images
    xtest: torch.Tensor
    ytest: torch.Tensor
    xtrain_eval: torch.Tensor
    """Training images through the evaluation transform (few-shot pool)."""


def load_digits() -> Digits:
    from vitscale.data.tools.write import assign_splits

    images = encode_source("digits", {"image_size": 64})
    split = assign_splits(len(images), {"train": 0.8, "test": 0.2}, 0)  # the quickstart's carve
    tr, te = images.subset(split["train"]), images.subset(split["test"])
    return Digits(tr, te, decode(te, np.arange(len(te)), train=False), torch.from_numpy(te.labels),
                  decode(tr, np.arange(len(tr)), train=False))


def fewshot(state: dict[str, torch.Tensor] | None, digits: Digits, seed: int) -> dict[int, float]:
    """5/25-shot closed-form probe of the pre-trained representation (random weights when state is None)."""
    from vitscale.eval.fewshot import fewshot_accuracy

    model = build_model(10, seed)
    if state is not None:
        model = build_model(int(state["head.weight"].shape[0]), seed)
        model.load_state_dict(state)
    ftr, fte = features(model, digits.xtrain_eval), features(model, digits.xtest)
    ytr = torch.from_numpy(digits.train.labels)
    return {k: float(np.mean([fewshot_accuracy(ftr, ytr, fte, digits.ytest, num_classes=10, shots=k, l2=1024.0,
                                               seed=s) for s in range(3)])) for k in (5, 25)}


def finetune_once(state: dict[str, torch.Tensor] | None, data: Images, xeval: torch.Tensor, yeval: torch.Tensor,
                  *, lr: float, steps: int, batch: int, seed: int) -> float:
    """Fine-tune (or train from random weights) on ``data`` and return accuracy on (xeval, yeval)."""
    if state is None:
        model = build_model(10, seed)
    else:
        model = build_model(int(state["head.weight"].shape[0]), seed)
        model.load_state_dict(state)
    model.reset_head(10)  # pre-logits dropped, zero-initialised head: the same net from either start
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
    train(model, data, steps=steps, batch=batch, optimizer=opt, base_lr=lr, warmup=steps // 10, seed=seed)
    return evaluate(model, xeval, yeval)


def finetune(state: dict[str, torch.Tensor] | None, digits: Digits, *, lrs: list[float], steps: int, batch: int,
             seed: int, dev_fraction: float) -> tuple[float, float, dict[float, float]]:
    """Select the LR on a dev carve of train, retrain on all of train, test once: (test acc, lr, dev accs)."""
    from vitscale.data.carve import in_dev

    dev_mask = in_dev(digits.train.keys, dev_fraction, 0)
    dev, rest = digits.train.subset(np.flatnonzero(dev_mask)), digits.train.subset(np.flatnonzero(~dev_mask))
    xdev, ydev = decode(dev, np.arange(len(dev)), train=False), torch.from_numpy(dev.labels)
    dev_acc = {lr: finetune_once(state, rest, xdev, ydev, lr=lr, steps=steps, batch=batch, seed=seed)
               for lr in lrs} if len(lrs) > 1 else {lrs[0]: float("nan")}
    best = max(dev_acc, key=lambda lr: (dev_acc[lr], -lr)) if len(lrs) > 1 else lrs[0]
    test = finetune_once(state, digits.train, digits.xtest, digits.ytest, lr=best, steps=steps, batch=batch,
                         seed=seed)
    return test, best, dev_acc


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    m = float(np.mean(values))
    s = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return f"{m:.3f} ± {s:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["synthetic", "fractal"],
                   help=f"named ({', '.join(VARIANTS)}) or kind:key=value,... pre-training sources")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=6.0, help="pre-training epochs (the quickstart: 6)")
    p.add_argument("--ft-steps", type=int, default=150)
    p.add_argument("--ft-batch", type=int, default=64)
    p.add_argument("--lr-grid", nargs="+", type=float, default=[0.01, 0.03, 0.1, 0.3])
    p.add_argument("--dev-fraction", type=float, default=0.2)
    p.add_argument("--no-scratch", action="store_true", help="skip the random-weights baseline")
    p.add_argument("--cache", type=Path, default=Path("data_cache/transfer_probe"),
                   help="folder for pre-trained weights (reused when present)")
    p.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override the quickstart's model section, e.g. name=ViT-Ti/8 img_size=32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for item in args.model:
        key, _, value = item.partition("=")
        MODEL[key] = int(value) if value.isdigit() else value

    t0 = time.perf_counter()
    digits = load_digits()
    print(f"digits: {len(digits.train)} train / {len(digits.test)} test; fine-tune {args.ft_steps} steps of "
          f"{args.ft_batch}, LR grid {args.lr_grid} on a {args.dev_fraction:.0%} dev carve", flush=True)
    inits = ([] if args.no_scratch else ["scratch"]) + list(args.variants)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in inits}
    for seed in args.seeds:
        for name in inits:
            t1 = time.perf_counter()
            state = None if name == "scratch" else pretrain(name, seed, args.epochs, args.cache)
            shots = fewshot(state, digits, seed)
            t2 = time.perf_counter()
            test, lr, dev = finetune(state, digits, lrs=args.lr_grid, steps=args.ft_steps, batch=args.ft_batch,
                                     seed=seed, dev_fraction=args.dev_fraction)
            rows[name].append({"seed": seed, "test": test, "lr": lr, "dev": dev, "fewshot": shots,
                               "finetune_s": time.perf_counter() - t2})
            print(f"  {name:>20} seed {seed}: fine-tuned test {test:.3f} (lr {lr:g}, dev "
                  f"{ {k: round(v, 3) for k, v in dev.items()} }), 5/25-shot {shots[5]:.3f}/{shots[25]:.3f} "
                  f"[{time.perf_counter() - t1:.0f} s]", flush=True)

    print(f"\nDigits test accuracy, {len(args.seeds)} seeds (mean ± std), pre-training {args.epochs:g} epochs:")
    print(f"{'init':>20}  {'fine-tuned':>14}  {'5-shot':>14}  {'25-shot':>14}  LRs chosen")
    for name, rs in rows.items():
        print(f"{name:>20}  {mean_std([r['test'] for r in rs]):>14}  {mean_std([r['fewshot'][5] for r in rs]):>14}  "
              f"{mean_std([r['fewshot'][25] for r in rs]):>14}  {[r['lr'] for r in rs]}")
    if "scratch" in rows:
        base = {r["seed"]: r for r in rows["scratch"]}
        print("\nMargin over scratch (same seed), fine-tuned test accuracy:")
        for name in args.variants:
            diffs = [r["test"] - base[r["seed"]]["test"] for r in rows[name]]
            ratio = np.mean([(1 - base[r["seed"]]["test"]) / max(1 - r["test"], 1e-9) for r in rows[name]])
            print(f"{name:>20}  {mean_std(diffs):>14}  per seed {[round(d, 3) for d in diffs]}  "
                  f"error ratio scratch/pre-trained {ratio:.2f}")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
