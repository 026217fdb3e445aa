"""Does masked patch prediction (Sec. 4.6) learn something that transfers? The quickstart's setting, labels ignored.

    python benchmarks/masked_patch.py [--seeds 0 1 2] [--epochs 6] [--target mean_colour]
        [--ft-steps 50] [--lr-grid 0.01 0.03 0.1 0.3] [--supervised] [--json FILE]

For each seed, in one process (plain PyTorch, one thread), with vitscale's own parts: the corruption plan
(`data/corruption.py`, a pure function of seed, epoch and key), the model and its targets
(`models/masked_patch.py`), the crop and flip of the loader (`decode_image_into`):

1. **Pre-train by masked patch prediction** the quickstart's architecture (ViT-Ti/4 shrunk to depth 4,
   width 128, 32 px: an 8 x 8 grid, 32 patches corrupted per image: 26 [mask], 3 swapped, 3 kept) on the
   quickstart's fractal images (`fractal`, 10 categories, 6,000 images; their labels never read), 90/10
   carve, the quickstart's recipe (6 epochs at batch 128, AdamW 1e-3, weight decay 0.05, 40 warm-up steps,
   cosine, clipping at 1). Every `--every` steps, the **held-out patch accuracy**: the share of the
   held-out images' corrupted patches whose 3-bit mean colour is predicted exactly (fixed plans: epoch 0),
   against the **majority baseline** (always the held-out set's most frequent colour, the best constant
   guess in hindsight).
2. **Transfer** to digits as the quickstart does: the prediction head and [mask] dropped, a zero-initialised
   head, the 5/25-shot closed-form probe and the fine-tuning sweep (`--lr-grid` selected on a 10% dev carve,
   the winner retrained on the whole training split and tested once, `--ft-steps` steps of 64).
3. The same architecture from **random weights** gets step 2 with the same budget; with `--supervised`,
   also supervised pre-training on the fractal labels (`transfer_probe.py`'s), for reference.

The architecture has no pre-logits layer in every row (masked patch prediction's head is per patch), so
the rows differ only in where the weights start. Prints the curve, a table of test accuracy (mean ± std
over seeds) and the margin over random weights per seed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import transfer_probe as tp  # benchmarks/transfer_probe.py: the quickstart's data, fine-tuning and few-shot probe


def pixels(images: tp.Images, idx: np.ndarray, *, train: bool, seed: int, epoch: int) -> torch.Tensor:
    """uint8 (B, 3, R, R): vitscale's crop/flip/resize (the loader's) of the images at `idx`."""
    from vitscale.data.loader.decode import decode_image_into
    from vitscale.data.loader.transforms import TransformSpec, sample_rng

    spec = TransformSpec(resolution=tp.MODEL["img_size"], train=train)
    out = np.empty((len(idx), 3, spec.resolution, spec.resolution), np.uint8)
    for row, i in enumerate(idx):
        decode_image_into(images.jpegs[i], out[row], spec, sample_rng(seed, epoch, int(i)) if train else None)
    return torch.from_numpy(out)


def build(seed: int, target_name: str) -> tuple[Any, Any]:
    """(predictor, corruption) for the quickstart's architecture without pre-logits."""
    from vitscale.data.corruption import Corruption
    from vitscale.models.masked_patch import MaskedPatchPredictor, PatchTarget

    torch.manual_seed(seed)
    encoder = tp.build_model(0, seed)
    grid = encoder.cfg.grid
    corruption = Corruption(grid[0] * grid[1])
    target = PatchTarget(target_name, patch=int(encoder.patch_embed.stride))
    return MaskedPatchPredictor(encoder, target, masked=corruption.counts[1]), corruption


@torch.no_grad()
def patch_accuracy(model: Any, corruption: Any, held: tp.Images, x: torch.Tensor) -> tuple[float, float]:
    """(held-out patch accuracy, majority baseline) over the held-out images' corrupted patches (epoch 0 plans)."""
    from vitscale.data.corruption import corrupted_positions
    from vitscale.data.loader.transforms import normalize_on_device
    from vitscale.models.masked_patch import patch_targets

    model.eval()
    hits, picked = [], []
    for lo in range(0, len(held), 256):
        keys = held.keys[lo:lo + 256]
        pos, src = (torch.from_numpy(a) for a in corrupted_positions(0, 0, keys, corruption))
        raw = x[lo:lo + 256]
        out = model(normalize_on_device(raw), pos, src)
        targets = patch_targets(raw, model.target)
        hits.append(model.hits(out, targets, pos).flatten())
        picked.append(targets.gather(1, pos).flatten())
    model.train()
    classes = torch.cat(picked)
    majority = float(torch.bincount(classes).max()) / classes.numel()
    return float(torch.cat(hits).float().mean()), majority


def source_images(source: str, seed: int, digits: tp.Digits) -> tp.Images:
    """The pre-training images: the quickstart's fractal source, or the digits' own training split (in-domain,
    labels never read; the test split is never seen)."""
    if source == "digits":
        return digits.train
    kind, options = tp.variant("fractal")
    return tp.encode_source(kind, {**options, "seed": seed})


def pretrain(images: tp.Images, seed: int, epochs: float, target: str,
             every: int) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """Masked patch pre-training on `images`; (encoder state, held-out curve)."""
    from vitscale.data.corruption import corrupted_positions
    from vitscale.data.loader.transforms import normalize_on_device
    from vitscale.data.tools.write import assign_splits
    from vitscale.models.masked_patch import patch_targets
    from vitscale.train.optim import lr_at, param_groups, steps_for

    split = assign_splits(len(images), {"train": 0.9, "test": 0.1}, seed)
    data, held = images.subset(split["train"]), images.subset(split["test"])
    xheld = pixels(held, np.arange(len(held)), train=False, seed=seed, epoch=0)
    model, corruption = build(seed, target)
    steps = steps_for(epochs, len(data), 128)
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3, betas=(0.9, 0.999))
    curve = []
    per_epoch, order = len(data) // 128, np.empty(0, np.int64)
    for step in range(steps):
        if step % every == 0:
            acc, majority = patch_accuracy(model, corruption, held, xheld)
            curve.append({"step": step, "patch_accuracy": acc, "majority": majority})
        epoch, at = divmod(step, per_epoch)
        if at == 0:
            order = np.random.default_rng([seed, epoch]).permutation(len(data))
        idx = order[at * 128:(at + 1) * 128]
        raw = pixels(data, idx, train=True, seed=seed, epoch=epoch)
        pos, src = (torch.from_numpy(a) for a in corrupted_positions(seed, epoch, [data.keys[i] for i in idx],
                                                                      corruption))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, base_lr=1e-3, total_steps=steps, warmup_steps=40, decay="cosine")
        out = model(normalize_on_device(raw), pos, src)
        loss = model.loss(out, patch_targets(raw, model.target), pos)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    acc, majority = patch_accuracy(model, corruption, held, xheld)
    curve.append({"step": steps, "patch_accuracy": acc, "majority": majority})
    state = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    # The transfer model's head: zero-initialised, as fine-tuning's is (Sec. 3.2); `finetune_once` resets it again.
    width = model.encoder.cfg.dims.width
    state["head.weight"], state["head.bias"] = torch.zeros(10, width), torch.zeros(10)
    return state, curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="pre-training and fine-tuning seeds")
    p.add_argument("--epochs", type=float, default=6.0, help="pre-training epochs (the quickstart: 6)")
    p.add_argument("--target", default="mean_colour", help="mean_colour, downsized_4x4 or pixels")
    p.add_argument("--source", default="fractal", choices=["fractal", "digits"],
                   help="pre-training images: the quickstart's fractals, or the digits' training split itself")
    p.add_argument("--every", type=int, default=25, help="steps between held-out patch accuracy measurements")
    p.add_argument("--ft-steps", type=int, default=50, help="fine-tuning steps (the quickstart: 50)")
    p.add_argument("--ft-batch", type=int, default=64, help="fine-tuning batch (the quickstart: 64)")
    p.add_argument("--lr-grid", nargs="+", type=float, default=[0.01, 0.03, 0.1, 0.3],
                   help="fine-tuning learning rates selected on the dev carve (the quickstart's)")
    p.add_argument("--dev-fraction", type=float, default=0.1, help="dev carve of the training split")
    p.add_argument("--supervised", action="store_true", help="also supervised pre-training on the fractal labels")
    p.add_argument("--cache", type=Path, default=Path("data_cache/masked_patch"),
                   help="folder for pre-trained encoders and their curves (reused when present; '' to skip)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args()
    args.cache = args.cache if str(args.cache) else None
    torch.set_num_threads(args.threads)
    tp.MODEL.pop("representation_size", None)  # every row the same architecture: no pre-logits

    t0 = time.perf_counter()
    digits = tp.load_digits()
    inits = ["scratch", "masked_patch"] + (["supervised"] if args.supervised else [])
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in inits}
    curves: dict[int, list[dict[str, float]]] = {}
    for seed in args.seeds:
        for name in inits:
            t1 = time.perf_counter()
            state = None
            if name == "masked_patch":
                cached = args.cache / f"{args.source}-{args.target}-s{seed}-e{args.epochs:g}.pt" if args.cache else None
                if cached is not None and cached.exists():  # the encoder and its curve, from an earlier run
                    state, curves[seed] = torch.load(cached, weights_only=True).values()
                else:
                    images = source_images(args.source, seed, digits)
                    state, curves[seed] = pretrain(images, seed, args.epochs, args.target, args.every)
                    if cached is not None:
                        cached.parent.mkdir(parents=True, exist_ok=True)
                        torch.save({"state": state, "curve": curves[seed]}, cached)
                last = curves[seed][-1]
                points = " ".join(f"{c['patch_accuracy']:.3f}" for c in curves[seed])
                print(f"  masked_patch seed {seed}: held-out patch accuracy {points} (steps 0, {args.every}, ...; "
                      f"majority {last['majority']:.3f}) [{time.perf_counter() - t1:.0f} s]", flush=True)
            elif name == "supervised":
                state = tp.pretrain("fractal", seed, args.epochs, None)
            shots = tp.fewshot(state, digits, seed)
            test, lr, dev = tp.finetune(state, digits, lrs=args.lr_grid, steps=args.ft_steps, batch=args.ft_batch,
                                        seed=seed, dev_fraction=args.dev_fraction)
            rows[name].append({"seed": seed, "test": test, "lr": lr, "dev": dev, "fewshot": shots})
            print(f"  {name:>13} seed {seed}: fine-tuned test {test:.3f} (lr {lr:g}), 5/25-shot "
                  f"{shots[5]:.3f}/{shots[25]:.3f} [{time.perf_counter() - t1:.0f} s]", flush=True)

    print(f"\nDigits test accuracy, {len(args.seeds)} seeds (mean ± std), pre-training {args.epochs:g} epochs of "
          f"{args.source}:")
    print(f"{'init':>13}  {'fine-tuned':>14}  {'5-shot':>14}  {'25-shot':>14}  LRs chosen")
    for name, rs in rows.items():
        print(f"{name:>13}  {tp.mean_std([r['test'] for r in rs]):>14}  "
              f"{tp.mean_std([r['fewshot'][5] for r in rs]):>14}  {tp.mean_std([r['fewshot'][25] for r in rs]):>14}"
              f"  {[r['lr'] for r in rs]}")
    base = {r["seed"]: r for r in rows["scratch"]}
    print("\nMargin over random weights (same seed), test accuracy:")
    for name in inits[1:]:
        for what, value in (("fine-tuned", lambda r: r["test"]), ("5-shot", lambda r: r["fewshot"][5]),
                            ("25-shot", lambda r: r["fewshot"][25])):
            diffs = [value(r) - value(base[r["seed"]]) for r in rows[name]]
            print(f"{name:>13} {what:>10}  {tp.mean_std(diffs):>14}  per seed {[round(d, 3) for d in diffs]}")
    finals = [c[-1] for c in curves.values()]
    print(f"\nHeld-out patch accuracy at the end: {tp.mean_std([c['patch_accuracy'] for c in finals])} "
          f"vs majority {tp.mean_std([c['majority'] for c in finals])}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
