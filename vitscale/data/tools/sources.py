"""The source registry: every image source ``vitscale shards write --source`` and
``data.create_if_missing.kind`` accept, and opening one by name.

To add a source kind, write one module in ``data/tools/`` that subclasses
:class:`~vitscale.data.tools.source_base.Source` and defines ``SOURCE = SourceKind(...)``, and add
one line to :data:`REGISTRY`. Nothing else: the CLI, the data config's check and the writer learn
its name, its argument and its options from the entry. Source modules import only
:mod:`~vitscale.data.tools.source_base` (and helpers), never this module, so there is no import cycle.

A source is written ``NAME`` (``digits``, ``synthetic``, ``fractal``) or ``NAME:ARG``
(``folder:PATH``, ``list:FILE``, ``cifar10:DIR``, ``cifar100:DIR``, ``pets:DIR``, ``flowers:DIR``,
``imagenet:DIR``); each module's docstring describes its files and options.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import Any

from vitscale.config.errors import UserError
from vitscale.config.location import is_url
from vitscale.data.tools.source_base import (
    IMAGE_EXTENSIONS,
    Sample,
    Source,
    SourceKind,
    image_of,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "REGISTRY",
    "RENAMED",
    "Sample",
    "Source",
    "SourceKind",
    "check_outside_source",
    "get_source_kind",
    "image_of",
    "open_source",
    "source_kind_of",
    "source_specs",
]

REGISTRY: dict[str, str] = {
    "folder": "vitscale.data.tools.folder",
    "list": "vitscale.data.tools.image_list",
    "digits": "vitscale.data.tools.digits",
    "synthetic": "vitscale.data.tools.synthetic",
    "fractal": "vitscale.data.tools.fractal",
    "cifar10": "vitscale.data.tools.cifar10",
    "cifar100": "vitscale.data.tools.cifar100",
    "pets": "vitscale.data.tools.pets",
    "flowers": "vitscale.data.tools.flowers",
    "imagenet": "vitscale.data.tools.imagenet",
}
"""Source name -> the module defining its ``SOURCE`` (imported on first use)."""

RENAMED: dict[str, str] = {"flowers102": "flowers"}
"""Old name -> the one name now used (a spec with the old name is refused, naming the new one)."""


def get_source_kind(name: str) -> SourceKind:
    """The registered source kind ``name``; an unknown name is a one-line error with the known ones."""
    if name in RENAMED:
        raise UserError(f"source {name!r} is now named {RENAMED[name]!r}: write {RENAMED[name]}:... instead")
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, list(REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"unknown source {name!r}: {hint}sources: {', '.join(source_specs())}")
    kind = importlib.import_module(REGISTRY[name]).SOURCE
    if not isinstance(kind, SourceKind) or kind.name != name:
        raise RuntimeError(f"{REGISTRY[name]}.SOURCE is not the SourceKind {name!r} it is registered as")
    return kind


def source_specs() -> list[str]:
    """How each registered source is written: ``folder:PATH``, ``digits``, ... (for help and errors)."""
    return [get_source_kind(name).spec for name in REGISTRY]


def source_kind_of(spec: str) -> SourceKind:
    """The kind a ``NAME[:ARG]`` spec names, checking that it has an argument iff the kind takes one."""
    name, sep, arg = spec.partition(":")
    kind = get_source_kind(name)
    if kind.arg and not arg:
        raise UserError(f"source {name!r} needs a path: {kind.spec}")
    if not kind.arg and sep:
        raise UserError(f"source {name!r} takes no path (got {spec!r})")
    return kind


def open_source(spec: str, **options: Any) -> Source:
    """Open the source ``spec`` (``NAME`` or ``NAME:ARG``, see :data:`REGISTRY`) with its keyword options.

    An option the kind does not take is an error; options whose value is ``None`` are ignored.
    """
    kind = source_kind_of(spec)
    opts = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(opts) - set(kind.options))
    if unknown:
        raise UserError(f"source {kind.name!r} does not take option(s) {unknown}; "
                        f"it takes {sorted(kind.options)}")
    if kind.arg:
        return kind.open(spec.partition(":")[2], **opts)
    return kind.open(**opts)


def check_outside_source(spec: str, out: str) -> None:
    """Refuse to write a dataset into the folder a source that reads its folder whole (``reads_tree``:
    ``folder:DIR``) reads, or below it: its shards and index would join the source (the next read takes
    their folder for a class of no images, a class more in every model trained on it). A distribution's
    reader (``imagenet:DIR``, ``pets:DIR``) reads its own named files: a folder beside them is not read."""
    arg = spec.partition(":")[2]
    if not arg or not source_kind_of(spec).reads_tree or is_url(arg) or is_url(out) \
            or not Path(arg).expanduser().is_dir():
        return
    root, target = Path(arg).expanduser().resolve(), Path(out).expanduser().resolve()
    if target == root or root in target.parents:
        raise UserError(f"{out}: the folder the source {spec} reads, or inside it: the dataset written there "
                        "would join the source; write it to a folder outside it")
