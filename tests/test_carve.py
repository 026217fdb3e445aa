"""The dev carve (minival): reproducible, nested, disjoint and complete; the stream reads one part of it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitscale.data.carve import Carve, in_dev, key_hash
from vitscale.data.format import open_dataset, read_index
from vitscale.data.loader.stream import ShardStream
from vitscale.data.tools.write import write_dataset

keys = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=200, unique=True)


@given(keys, st.floats(0.01, 0.99), st.integers(0, 2**31))
def test_dev_and_rest_partition_the_split_exactly(ks: list[str], fraction: float, seed: int) -> None:
    dev = Carve(fraction, seed, "dev").resolved(ks).select(ks)
    rest = Carve(fraction, seed, "rest").resolved(ks).select(ks)
    assert np.all(dev ^ rest)  # each key in exactly one part
    assert dev.sum() == round(fraction * len(ks))  # exact: 200 of 1000 for VTAB-1k, not "about 200"
    assert np.array_equal(dev, in_dev(list(reversed(ks)), fraction, seed)[::-1])  # order-free
    # A shard placed on its own, with the split's threshold, agrees with the whole split.
    half = ks[: len(ks) // 2]
    assert np.array_equal(Carve(fraction, seed, "dev").resolved(ks).select(half), dev[: len(half)])


@given(keys, st.floats(0.01, 0.98), st.floats(0.0, 1.0), st.integers(0, 1000))
def test_smaller_carves_are_nested_in_larger_ones(ks: list[str], small: float, extra: float, seed: int) -> None:
    large = small + (0.99 - small) * extra
    assert not np.any(in_dev(ks, small, seed) & ~in_dev(ks, large, seed))


@settings(max_examples=20)
@given(st.floats(0.02, 0.5), st.integers(0, 1000))
def test_the_dev_share_is_the_fraction_and_unbiased(fraction: float, seed: int) -> None:
    n = 4000
    picked = in_dev([f"sample-{i:06d}" for i in range(n)], fraction, seed)
    assert picked.sum() == round(fraction * n)
    # ...and it is a uniform choice: the dev part has no bias toward early or late keys.
    positions = np.flatnonzero(picked)
    assert abs(positions.mean() - (n - 1) / 2) < 4 * n / np.sqrt(12 * max(len(positions), 1))


def test_bad_carves_are_refused() -> None:
    for fraction in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="fraction"):
            Carve(fraction)
    with pytest.raises(ValueError, match="part"):
        Carve(0.1, part="test")
    with pytest.raises(ValueError, match="resolve"):
        Carve(0.1).select(["a"])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("carve") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=23, max_side=32, progress=False,
                  source_options={"count": 120, "classes": 3, "image_size": 32})
    return str(out)


def test_stream_reads_exactly_one_part(dataset: str) -> None:
    train_keys = [k for k, s in zip(read_index(dataset).column("key").to_pylist(),
                                    read_index(dataset).column("split").to_pylist()) if s == "train"]
    expected_dev = {k for k, d in zip(train_keys, in_dev(train_keys, 0.2, 7)) if d}
    assert len(expected_dev) == round(0.2 * len(train_keys))
    seen = {}
    for part in ("dev", "rest"):
        carve = Carve(0.2, 7, part)
        ds = open_dataset(dataset, "train", carve=carve)
        stream = ShardStream(dataset, "train", batch_size=8, resolution=16, train=False, carve=carve)
        got = [k for batch in stream for k, v in zip(batch["key"], batch["valid"]) if v]
        assert len(got) == sum(ds.counts) == len(set(got))
        seen[part] = set(got)
    assert seen["dev"] == expected_dev
    assert seen["dev"] | seen["rest"] == set(train_keys) and not seen["dev"] & seen["rest"]


@given(st.lists(st.integers(0, 30), min_size=2, max_size=120), st.floats(0.01, 0.99), st.integers(0, 2**31))
def test_a_key_written_twice_stays_in_one_part_and_the_count_stays_nearest(ids: list[int], fraction: float,
                                                                          seed: int) -> None:
    """Samples that share a key share a part (a copy of a dev sample never trains), and the dev count is the
    nearest to round(fraction x n) that keeps every key's samples together, in neither part empty if it can be."""
    ks = [f"k{i}" for i in ids]
    dev = in_dev(ks, fraction, seed)
    for key in set(ks):
        assert len({bool(d) for d, k in zip(dev, ks, strict=True) if k == key}) == 1, key
    # Every count a whole-key carve by this hash order can reach: the prefixes of the keys sorted by hash.
    sizes = sorted((key_hash(k, seed), ks.count(k)) for k in set(ks))
    reachable = np.cumsum([0] + [n for _, n in sizes])
    target = round(fraction * len(ks))
    if target in (0, len(ks)):  # as for distinct keys: round(fraction x n) is all or nothing
        assert dev.sum() == target
        return
    proper = [int(c) for c in reachable if 0 < c < len(ks)]
    if not proper:  # one key names every sample: it cannot be split
        assert dev.sum() in (0, len(ks))
        return
    assert int(dev.sum()) in proper and abs(int(dev.sum()) - target) == min(abs(c - target) for c in proper), \
        (dev.sum(), target, proper)


def test_tars_that_each_number_their_samples_from_0_get_a_dev_part() -> None:
    """Ten adopted tars of keys 000000-000099 (each key ten times): a 0.5% carve (5 of 1,000) is one key's ten
    copies, not an empty dev part; 1% is exactly ten."""
    ks = [f"{i:06d}" for _ in range(10) for i in range(100)]
    for fraction in (0.005, 0.01):
        dev = in_dev(ks, fraction, 0)
        assert dev.sum() == 10 and len({k for k, d in zip(ks, dev, strict=True) if d}) == 1
