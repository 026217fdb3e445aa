"""Which member of an adopted sample holds its label (`shards index --label-member`), and how it is read.

``cls`` (a class id), ``txt`` (a class name), ``json:KEY`` (an id, a name or a list of either under KEY),
or ``none``: images alone, a dataset without labels (``num_classes`` 0, for masked patch pre-training).
"""

from __future__ import annotations

from vitscale.config.errors import UserError
from vitscale.data.loader.labels import LabelError, parse_class_id, parse_json_label, parse_text_label
from vitscale.say import say

__all__ = ["LABEL_EXTS", "NO_LABELS_HINT", "LabelMember", "default_member"]

LABEL_EXTS = ("cls", "txt", "json")
"""Members that hold a label."""


class LabelMember:
    """Class ids from a sample's label member, by ``--label-member``; names mapped as they come.

    Parsing is :mod:`vitscale.data.loader.labels`' (bounded size and depth, the training loader's
    own parser): anything that cannot be a label raises ``LabelError``.
    """

    def __init__(self, member: str, classes: list[str] | None) -> None:
        kind, _, self.json_key = member.partition(":")
        if kind not in ("cls", "txt", "json", "none") or (kind == "json") != bool(self.json_key):
            raise UserError(f"--label-member must be cls, txt, json:KEY or none (images alone), got {member!r}")
        if kind == "none" and classes is not None:
            raise UserError("--classes names classes, but --label-member none indexes images without labels")
        self.member, self.kind, self.fixed = member, kind, classes is not None
        self.names: dict[str, int] = {c: i for i, c in enumerate(classes or [])}

    @property
    def ext(self) -> str:
        return self.kind

    def _id(self, value: int | str) -> int | str:
        if isinstance(value, str) and not self.fixed:
            return value  # mapped to an index once all names are known (sorted)
        if isinstance(value, str):
            if value not in self.names:
                raise LabelError(f"class {value[:64]!r} is not in --classes")
            return self.names[value]
        return value

    def parse(self, data: bytes) -> list[int | str]:
        if self.kind == "cls":
            return [parse_class_id(data)]
        if self.kind == "txt":
            return [self._id(parse_text_label(data))]
        return [self._id(v) for v in parse_json_label(data, self.json_key)]


CONTRACT_JSON = "json:labels"
"""The label member of vitscale's own multi-label samples: ``{key}.json`` holding ``{"labels": [...]}``."""


def default_member(found: list[tuple[str, int, int, dict[str, bytes | None]]], where: str, announce: bool) -> str:
    """The default ``--label-member``, decided by the first tar's samples (`found`): ``cls`` when one has a
    ``.cls`` member; ``json:labels`` when there is none but every ``.json`` member holds ``{"labels": ...}``
    (vitscale's own multi-label member); else ``none`` (images alone), said in one line that names the
    flags reading a label from the other members.

    Any other ``.txt`` or ``.json`` member is not taken for a label unasked: in crawled tars (img2dataset)
    they are the caption and the URL metadata, and a caption cannot be told from a class name by its bytes.
    """
    if not found or any("cls" in members for _, _, _, members in found):
        return "cls"
    jsons = [members.get("json") for _, _, _, members in found if "json" in members]
    if jsons and all(data is not None and _holds_labels(data) for data in jsons):
        return CONTRACT_JSON
    if announce:
        others = sorted({f".{ext}" for _, _, _, members in found for ext in members if ext in ("txt", "json")})
        read_them = (f"; its {' and '.join(others)} members are not read as labels (captions, metadata): "
                     "--label-member txt (a class name) or json:KEY reads one from them") if others else ""
        say(f"{where}: no sample has a .cls label member: indexing images without labels (num_classes 0, for "
            f"train.objective: masked_patch){read_them}; --label-member cls to require labels")
    return "none"


NO_LABELS_HINT = ("--label-member none indexes the images without labels (num_classes 0, for train.objective: "
                  "masked_patch)")
"""What the index says when it finds no label: how to index images alone."""


def _holds_labels(data: bytes) -> bool:
    """Whether a ``.json`` member is vitscale's label member (``{"labels": ...}`` of ids or names)."""
    try:
        parse_json_label(data, "labels")
    except LabelError:
        return False
    return True
