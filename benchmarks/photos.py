"""Photo-like images for the loader benchmarks: random views of scikit-learn's two bundled photographs.

One recipe (`photo_like`) for every benchmark that writes JPEGs (`data_throughput.py`, `train_data.py`),
so their decode costs are comparable: a random crop of 40-100% of a 640x427 photo, scaled to the target
size, mirrored half the time, and a colour shift per channel.
"""

from __future__ import annotations

import random
from typing import Any


def bundled_photos() -> list[Any]:
    """sklearn's two bundled 640x427 photographs as PIL images (no download)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    return [Image.fromarray(a) for a in load_sample_images().images]


def photo_like(src: Any, rng: random.Random, size: tuple[int, int]) -> Any:
    """A (w, h) view of the PIL image `src` drawn from `rng`: crop, scale, mirror, colour shift."""
    import numpy as np
    from PIL import Image

    w, h = size
    f = rng.uniform(0.4, 1.0)
    cw, ch = int(src.width * f), int(src.height * f)
    x, y = rng.randint(0, src.width - cw), rng.randint(0, src.height - ch)
    img = src.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    gains = [rng.uniform(0.7, 1.3) for _ in range(3)]
    # The colour shift as one lookup table per channel, applied in C (multiply, clip, truncate).
    return img.point([min(255, int(np.float32(i) * np.float32(g))) for g in gains for i in range(256)])
