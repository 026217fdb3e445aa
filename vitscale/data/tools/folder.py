"""``folder:PATH``: ImageNet layout, one sub-folder per class; or a folder of images without labels.

Class names are the sub-folder names, sorted; image files anywhere below each
(``.jpg .jpeg .png .bmp .gif .webp .tif .tiff .ppm``, any case). A folder with no sub-folders, only
images, is a set of images without labels (``num_classes`` 0): what masked patch pre-training
(``train.objective: masked_patch``) reads; supervised training refuses it. A folder holding both images
and sub-folders is refused: which of the two was meant cannot be told.
"""

from __future__ import annotations

from pathlib import Path

from vitscale.config.errors import UserError
from vitscale.data.tools.keys import unique_keys
from vitscale.data.tools.source_base import IMAGE_EXTENSIONS, Sample, Source, SourceKind

__all__ = ["SOURCE", "FolderSource"]


def _image_file(p: Path) -> bool:
    """An image by its name: a file, or a broken link (a mirror whose targets moved), listed so that the write
    counts it among its unreadable files instead of leaving the image out without a word."""
    return (p.is_file() or (p.is_symlink() and not p.exists())) and p.suffix.lower() in IMAGE_EXTENSIONS


class FolderSource(Source):
    """ImageNet layout: ``root/<class name>/**/<image>``, classes sorted by name; or ``root/<image>`` unlabelled."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise UserError(f"folder source: {self.root} is not a directory")
        class_dirs = sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        loose = sorted(p for p in self.root.iterdir() if _image_file(p))
        if class_dirs and loose:
            raise UserError(f"folder source: {self.root} holds both images ({loose[0].name}, ...) and sub-folders "
                            f"({class_dirs[0].name}, ...): one sub-folder per class, or images alone (unlabelled)")
        self.name = self.root.name
        self.classes = tuple(p.name for p in class_dirs)
        self.multi_label = False
        self.labelled = bool(class_dirs)
        files: list[tuple[Path, int | None]] = [(p, None) for p in loose]
        for ci, d in enumerate(class_dirs):
            for p in sorted(d.rglob("*")):
                if _image_file(p):
                    files.append((p, ci))
        if not files:
            raise UserError(f"folder source: no images ({sorted(IMAGE_EXTENSIONS)}) under {self.root}: expected one "
                            "sub-folder of images per class (ImageNet layout), or images alone (no labels)")
        self._files: list[tuple[Path, int | None]] = files
        self._keys = unique_keys([p.relative_to(self.root).with_suffix("").as_posix() for p, _ in files])

    def __len__(self) -> int:
        return len(self._files)

    def origin(self, i: int) -> str:
        return str(self._files[i][0])

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        i = self._check_index(i)
        path, ci = self._files[i]
        return Sample(self._keys[i], path.read_bytes(), () if ci is None else (ci,))


SOURCE = SourceKind("folder", FolderSource, "one sub-folder of images per class (ImageNet layout), or images alone "
                    "(no labels: for masked patch pre-training)", arg="PATH", reads_tree=True)
