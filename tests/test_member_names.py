"""Every writer refuses tar member names that would escape the directory a tar is extracted to."""

from __future__ import annotations

import pytest

from vitscale.data.storage import open_storage
from vitscale.data.tools.write import ShardWriter, safe_member_name


@pytest.mark.parametrize("name", ["../x.jpg", "a/../../x.jpg", "/etc/passwd", "a\\..\\x.jpg", "a\0.jpg", "a//b.jpg", ""])
def test_escaping_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="escape"):
        safe_member_name(name)


@pytest.mark.parametrize("name", ["x.jpg", "class_1/img-0001.jpg", "a..b.jpg"])
def test_plain_names_pass(name: str) -> None:
    assert safe_member_name(name) == name


def test_shard_writer_refuses_a_hostile_key(tmp_path) -> None:
    writer = ShardWriter(open_storage(str(tmp_path)), "train", 10, False)
    with pytest.raises(ValueError, match="escape"):
        writer.add("../../outside", b"\xff\xd8\xff\xd9", [0], 1, 1)
