"""``pets:DIR``: Oxford-IIIT Pets as distributed, splits ``train`` (trainval) and ``test``.

``DIR/images/{name}.jpg``, ``DIR/annotations/trainval.txt`` (split ``train``) and
``annotations/test.txt`` (``test``), lines ``Abyssinian_100 1 1 1`` (image name, class id 1..37,
species, breed id; ``#`` starts a comment). Class index = class id - 1; a class's name is its
images' name prefix (all before the last ``_``: ``Abyssinian``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitscale.config.errors import UserError
from vitscale.data.tools.downstream import (
    PredefinedSplitSource,
    need_dir,
    need_file,
    split_indices,
)
from vitscale.data.tools.keys import unique_keys
from vitscale.data.tools.source_base import Sample, SourceKind

__all__ = ["SOURCE", "PetsSource"]


PETS_FILES = (("train", "trainval.txt"), ("test", "test.txt"))
PETS_CLASSES = 37


class PetsSource(PredefinedSplitSource):
    """Oxford-IIIT Pets: ``images/*.jpg`` + ``annotations/{trainval,test}.txt``."""

    def __init__(self, root: str | Path) -> None:
        kind = "pets"
        root = need_dir(Path(root).expanduser(), kind)
        images = need_dir(root / "images", kind)
        self.root, self.name, self.multi_label = root, "pets", False
        names: dict[int, str] = {}
        rows: list[tuple[str, int]] = []
        sizes: list[tuple[str, int]] = []
        seen: dict[str, str] = {}
        for split, fname in PETS_FILES:
            path = need_file(root / "annotations" / fname, kind, "the annotations archive")
            count = 0
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                fields = line.split()
                if not fields or fields[0].startswith("#"):
                    continue
                where = f"{path}:{n}"
                try:
                    image, class_id = fields[0], int(fields[1])
                except (IndexError, ValueError):
                    raise UserError(f"{kind}: {where}: expected 'IMAGE CLASS_ID SPECIES BREED_ID', "
                                    f"got {line.strip()!r}") from None
                if not 1 <= class_id <= PETS_CLASSES:
                    raise UserError(f"{kind}: {where}: class id {class_id} outside 1..{PETS_CLASSES}")
                prefix, sep, _ = image.rpartition("_")
                if not sep or not prefix:
                    raise UserError(f"{kind}: {where}: image name {image!r} has no '<breed>_<n>' form")
                if names.setdefault(class_id, prefix) != prefix:
                    raise UserError(f"{kind}: {where}: class id {class_id} is {names[class_id]!r} "
                                    f"elsewhere, {prefix!r} here")
                if image in seen:
                    raise UserError(f"{kind}: {where}: image {image!r} is listed twice (also in {seen[image]})")
                seen[image] = where
                need_file(images / f"{image}.jpg", kind, f"listed in {where}")
                rows.append((image, class_id - 1))
                count += 1
            if not count:
                raise UserError(f"{kind}: {path} lists no images")
            sizes.append((split, count))
        k = max(names)
        missing = [c for c in range(1, k + 1) if c not in names]
        if missing:
            raise UserError(f"{kind}: class id {missing[0]} appears in no annotation file, so it has no name")
        self.classes = tuple(names[c] for c in range(1, k + 1))
        self._images = images
        self._names = [r[0] for r in rows]
        self._labels = np.array([r[1] for r in rows], dtype=np.int64)
        self._keys = unique_keys(self._names)
        self._splits = split_indices(sizes)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        data = (self._images / f"{self._names[i]}.jpg").read_bytes()
        return Sample(self._keys[i], data, (int(self._labels[i]),))


SOURCE = SourceKind("pets", PetsSource, "Oxford-IIIT Pets (its own train/test splits)", arg="DIR",
                    predefined_splits=True)
