"""``flowers:DIR``: Oxford Flowers-102 as distributed, splits ``train``, ``val`` and ``test``.

``DIR/jpg/image_00001.jpg`` .., ``imagelabels.mat`` (``labels``: 1..102, one per image) and
``setid.mat`` (``trnid``, ``valid``, ``tstid``: 1-based image ids) give splits ``train``, ``val``
and ``test``. The paper's Flowers "train" is ``train`` + ``val``. The distribution names no
classes: class index ``i`` is label ``i + 1`` and is named ``"i + 1"`` (``"1"`` .. ``"102"``).
One name for the set everywhere: ``flowers`` (the source, the fine-tuning preset).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitscale.config.errors import UserError
from vitscale.data.tools.downstream import (
    PredefinedSplitSource,
    need_dir,
    need_file,
    read_mat_ints,
    split_indices,
)
from vitscale.data.tools.source_base import Sample, SourceKind

__all__ = ["SOURCE", "FlowersSource"]


FLOWERS_SPLITS = (("train", "trnid"), ("val", "valid"), ("test", "tstid"))
FLOWERS_CLASSES = 102


class FlowersSource(PredefinedSplitSource):
    """Oxford Flowers-102: ``jpg/image_NNNNN.jpg`` + ``imagelabels.mat`` + ``setid.mat``."""

    def __init__(self, root: str | Path) -> None:
        kind = "flowers"
        root = need_dir(Path(root).expanduser(), kind)
        jpg = need_dir(root / "jpg", kind)
        self.root, self.name, self.multi_label = root, "flowers", False
        self.classes = tuple(str(c) for c in range(1, FLOWERS_CLASSES + 1))
        labels_path = root / "imagelabels.mat"
        labels = read_mat_ints(labels_path, "labels", kind)
        bad = np.flatnonzero((labels < 1) | (labels > FLOWERS_CLASSES))
        if bad.size:
            raise UserError(f"{kind}: {labels_path} gives image {bad[0] + 1} label {labels[bad[0]]}, "
                            f"outside 1..{FLOWERS_CLASSES}")
        setid = root / "setid.mat"
        ids: list[np.ndarray] = []
        sizes: list[tuple[str, int]] = []
        owner: dict[int, str] = {}
        for split, var in FLOWERS_SPLITS:
            split_ids = read_mat_ints(setid, var, kind)
            for image_id in split_ids.tolist():
                if not 1 <= image_id <= len(labels):
                    raise UserError(f"{kind}: {setid} {var} lists image {image_id}, but {labels_path} "
                                    f"labels images 1..{len(labels)}")
                if image_id in owner:
                    raise UserError(f"{kind}: {setid} lists image {image_id} twice ({owner[image_id]}, {var})")
                owner[image_id] = var
                need_file(jpg / f"image_{image_id:05d}.jpg", kind, f"listed in {setid} {var}")
            ids.append(split_ids)
            sizes.append((split, len(split_ids)))
        self._jpg = jpg
        self._ids = np.concatenate(ids)
        self._labels = labels[self._ids - 1] - 1
        self._splits = split_indices(sizes)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        name = f"image_{int(self._ids[i]):05d}"
        return Sample(name, (self._jpg / f"{name}.jpg").read_bytes(), (int(self._labels[i]),))


SOURCE = SourceKind("flowers", FlowersSource, "Oxford Flowers-102 (its own train/val/test splits)", arg="DIR",
                    predefined_splits=True)
