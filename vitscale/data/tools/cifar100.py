"""``cifar100:DIR``: CIFAR-100, binary version (the reader: :mod:`vitscale.data.tools.cifar`)."""

from __future__ import annotations

from functools import partial

from vitscale.data.tools.cifar import CifarSource
from vitscale.data.tools.source_base import SourceKind

SOURCE = SourceKind("cifar100", partial(CifarSource, kind="cifar100"),
                    "CIFAR-100, binary version (its own train/test splits)",
                    arg="DIR", predefined_splits=True)
