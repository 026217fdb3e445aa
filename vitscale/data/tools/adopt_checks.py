"""What ``vitscale shards index`` refuses in tars other tools wrote, each said in one line naming the tar.

- a gzip-compressed shard (``.tar.gz``, ``.tgz``, or gzip bytes under a ``.tar`` name): WebDataset reads
  those as a stream, but vitscale reads each sample by its byte range, which a compressed file has not.
  Left out of a folder's listing unsaid, its samples were silently missing from the dataset.
- a tar whose samples' members are not consecutive (``tar cf x.tar *.jpg *.cls``, or a folder tarred in
  directory order): WebDataset, and the index, group a sample's members as they come, so each member became a
  sample of its own, without an image or a label, and the index ended on "more than 100 bad samples ... no
  readable .cls label member; --label-member none indexes the images without labels": labels the tar has.
  A key repeated whole (every group with an image) is not this: it is kept, each a sample.
"""

from __future__ import annotations

from vitscale.data.format import DatasetError
from vitscale.data.loader.sample import IMAGE_MEMBERS
from vitscale.data.storage import Storage

__all__ = ["COMPRESSED_SUFFIXES", "refuse_compressed", "refuse_gzip_bytes", "refuse_scattered"]

COMPRESSED_SUFFIXES = (".tar.gz", ".tgz")
"""Names of gzip-compressed tars, as WebDataset's own shard lists spell them."""

_GZIP_MAGIC = b"\x1f\x8b"


def _line(url: str) -> str:
    return (f"{url} is a gzip-compressed tar: vitscale reads each sample by its byte range, which needs "
            "uncompressed shards; decompress them (gunzip) and index the .tar files")


def refuse_compressed(storage: Storage, names: list[str]) -> None:
    """Refuse the first gzip-compressed tar among ``names`` (named shards or a folder's listing)."""
    compressed = [n for n in names if n.lower().endswith(COMPRESSED_SUFFIXES)]
    if compressed:
        more = f" ({len(compressed)} such under {storage.url})" if len(compressed) > 1 else ""
        raise DatasetError(_line(storage.url_of(compressed[0])) + more)


def refuse_gzip_bytes(storage: Storage, shard: str) -> None:
    """Refuse ``shard`` when it holds gzip bytes under a tar's name (it was found not to be a readable tar)."""
    try:
        with storage.open_read(shard) as f:
            head = f.read(len(_GZIP_MAGIC))
    except OSError:
        return  # unreadable: the caller's own error says so
    if head == _GZIP_MAGIC:
        raise DatasetError(_line(storage.url_of(shard)))


def refuse_scattered(storage: Storage, shard: str, found: list[tuple[str, int, int, dict[str, bytes | None]]]) -> None:
    """Refuse ``shard`` when one key's members lie in groups apart and one group has no image: a sample split up.

    ``found``: the shard's member groups in tar order, (key, offset, size, {ext: ...}) as the index walks them.
    """
    seen: dict[str, tuple[int, bool]] = {}
    for key, offset, _, members in found:
        has_image = any(ext in members for ext in IMAGE_MEMBERS)
        if key in seen and not (has_image and seen[key][1]):
            raise DatasetError(f"{storage.url_of(shard)}: the members of sample {key[:100]!r} are not consecutive "
                               f"(at bytes {seen[key][0]} and {offset}): a WebDataset tar keeps each sample's files "
                               "together; pack it again in name order (tar --sort=name) and index it")
        seen.setdefault(key, (offset, has_image))
