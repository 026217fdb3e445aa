"""``digits``: scikit-learn's bundled handwritten digits, a real image set shipped with a dependency.

1,797 8x8 grey images, 10 classes, upscaled to ``image_size`` (default 64) px with ``resample``
(``"bicubic"`` or ``"nearest"``), grey to RGB. No download.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image

from vitscale.config.checks import one_of
from vitscale.data.tools.source_base import Sample, Source, SourceKind, drawn_side

__all__ = ["SOURCE", "DigitsSource"]


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    # images: (1797, 8, 8) float in [0, 16]; target: (1797,) int
    return d.images.astype(np.float32), d.target.astype(np.int64)


class DigitsSource(Source):
    """scikit-learn's bundled 8x8 handwritten digits, upscaled and turned RGB (no download)."""

    def __init__(self, *, image_size: int = 64, resample: str = "bicubic") -> None:
        drawn_side(image_size, "digits.image_size", least=8)
        modes = {"bicubic": Image.Resampling.BICUBIC, "nearest": Image.Resampling.NEAREST}
        one_of(resample, sorted(modes), "digits.resample")
        self.image_size = image_size
        self._resample = modes[resample]
        self._images, self._targets = _digits()
        self.name = "digits"
        self.classes = tuple(str(i) for i in range(10))
        self.multi_label = False

    def __len__(self) -> int:
        return len(self._targets)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        # (8, 8) in [0, 16], ink high -> dark ink on white paper like a scan.
        grey = (255.0 - self._images[i] * (255.0 / 16.0)).round().astype(np.uint8)
        img = Image.fromarray(grey, mode="L").resize((self.image_size,) * 2, self._resample)
        return Sample(f"digits-{i:04d}", img.convert("RGB"), (int(self._targets[i]),))


SOURCE = SourceKind("digits", DigitsSource, "scikit-learn's bundled 8x8 handwritten digits, upscaled",
                    options=("image_size", "resample"))
