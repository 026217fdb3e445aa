"""What ``vitscale shards index`` refuses in tars other tools wrote, each said in one line naming the tar.

- a gzip-compressed shard (``.tar.gz``, ``.tgz``, or gzip bytes under a ``.tar`` name): WebDataset reads
  those as a stream, but vitscale reads each sample by its byte range, which a compressed file has not.
  Left out of a folder's listing unsaid, its samples were silently missing from the dataset.
"""

from __future__ import annotations

from vitscale.data.format import DatasetError
from vitscale.data.storage import Storage

__all__ = ["COMPRESSED_SUFFIXES", "refuse_compressed", "refuse_gzip_bytes"]

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
