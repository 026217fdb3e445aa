"""One home per rule: the URL test, where a run is stored, the batch split, each shared default, the
loader's override mappings and moved keys, and typed section access."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vitscale.config import ConfigError
from vitscale.config.fields import overrides
from vitscale.config.loader import build_section, to_dict
from vitscale.config.location import is_url, run_location
from vitscale.config.pipeline import ClusterConfig
from vitscale.data.config import DEFAULT_ERROR_BUDGET, MAX_LOADER_WORKERS, DataConfig
from vitscale.data.order import DEFAULT_SHUFFLE_BUFFER
from vitscale.stages import build_pipeline
from vitscale.train.config import TrainConfig
from vitscale.train.finetune import FinetuneConfig

ROOT = Path(__file__).resolve().parents[1]


def test_is_url_is_the_only_spelling_of_the_rule() -> None:
    assert is_url("s3://bucket/prefix") and is_url("file:///tmp/x") and not is_url("/data/x") and not is_url("runs")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "vitscale").rglob("*.py")
                 if p.name != "location.py" and '"://" in' in p.read_text()]
    assert offenders == []


def test_a_run_is_stored_in_one_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.launch.run_place import run_place

    monkeypatch.chdir(tmp_path)
    local = ClusterConfig(storage_path="runs")
    assert local.run_storage("r") == run_location("runs", "r") == str(tmp_path / "runs" / "r")
    assert run_place(local, "r").local_dir() == tmp_path / "runs" / "r"
    assert run_place(local, "r").ray_storage() == (str(tmp_path / "runs"), "r")
    remote = ClusterConfig(storage_path="s3://bucket/runs/")
    assert remote.run_storage("r") == "s3://bucket/runs/r" and run_place(remote, "r").ray_storage() == ("s3://bucket/runs", "r")
    # A part of the run (its fine-tuning) is stored inside it, and Ray Train is told so.
    assert run_place(remote, "r", "finetune").ray_storage() == ("s3://bucket/runs/r", "finetune")


def test_shared_defaults_have_one_home() -> None:
    from vitscale.data.loader.stream import ShardStream, StreamSpec
    from vitscale.eval.config import FewshotConfig

    assert DataConfig().shuffle_buffer == DEFAULT_SHUFFLE_BUFFER == StreamSpec.__dataclass_fields__["shuffle_buffer"].default
    for default in (DataConfig().error_budget, FewshotConfig().error_budget,
                    StreamSpec.__dataclass_fields__["error_budget"].default):
        assert default == DEFAULT_ERROR_BUDGET
    # The loader's settings have one list, StreamSpec's: the stream takes them through it, declaring none.
    assert not {"shuffle_buffer", "error_budget", "batch_size"} & set(inspect.signature(ShardStream.__init__).parameters)
    # The most loader processes a rank may fork: one limit, which the config and the loader both hold to.
    assert StreamSpec(url="data", num_workers=MAX_LOADER_WORKERS).num_workers == MAX_LOADER_WORKERS
    with pytest.raises(ConfigError, match=f"^num_workers: at most {MAX_LOADER_WORKERS} loader processes"):
        StreamSpec(url="data", num_workers=MAX_LOADER_WORKERS + 1)
    with pytest.raises(ConfigError, match=f"^data.num_workers: at most {MAX_LOADER_WORKERS} loader processes"):
        DataConfig(num_workers=MAX_LOADER_WORKERS + 1).validate()


@given(st.integers(1, 5000), st.integers(1, 256), st.integers(1, 32))
def test_the_batch_rule_is_derive_batchs(global_batch: int, micro: int, workers: int) -> None:
    from vitscale.train.batch import derive_batch

    config = TrainConfig(global_batch=global_batch, micro_batch=micro)
    try:
        derive_batch(config.global_batch, config.micro_batch, workers)
        fits = True
    except ValueError:
        fits = False
    try:
        config.check_batch_split(workers, "finetune.train", "sweep.workers_per_trial")
        assert fits
    except ConfigError as exc:
        assert not fits and exc.key == "finetune.train.global_batch"
        assert "sweep.workers_per_trial" in exc.message
        # The micro-batch is named where it is part of the problem: not where the shares themselves are uneven.
        assert ("finetune.train.micro_batch" in exc.message) == (global_batch >= micro * workers or micro == 1), exc.message


def test_a_small_global_batch_needs_no_micro_batch_of_its_own() -> None:
    """`train.micro_batch` (64 by default) is the most one pass takes: 8 images over 2 workers are passes of 4,
    checked as such before Ray starts; an uneven split is still refused, naming the workers' key."""
    from vitscale.stages.pretrain import check_pretrain

    raw = {"train": {"global_batch": 8}, "cluster": {"num_workers": 2, "use_gpu": False}}
    check_pretrain(build_pipeline(raw))
    with pytest.raises(ConfigError, match=r"^train.global_batch: 9 does not split evenly over cluster.num_workers=2"):
        check_pretrain(build_pipeline({**raw, "train": {"global_batch": 9}}))


@dataclass(frozen=True)
class Toy:
    MOVED: ClassVar[dict[str, str]] = {"lr": "train.base_lr", "shards": "data.url"}
    train: dict[str, Any] = field(default_factory=dict, metadata=overrides(TrainConfig))
    data: dict[str, Any] = field(default_factory=dict, metadata=overrides(DataConfig))


def test_override_mappings_are_checked_against_their_class() -> None:
    toy = build_section(Toy, {"train": {"base_lr": "1e-3", "fault": {"kill_rank": 0, "kill_at_step": 2}},
                              "data": {"seed": 3.0}}, "toy")
    assert toy.train["base_lr"] == 0.001 and toy.data["seed"] == 3  # coerced as the section would be
    assert to_dict(toy) == {"train": {"base_lr": 0.001, "fault": {"kill_rank": 0, "kill_at_step": 2, "kill_with": "exit"}},
                            "data": {"seed": 3}}
    for raw, key in (({"train": {"base_rl": 1.0}}, "toy.train.base_rl"), ({"data": {"seed": "x"}}, "toy.data.seed"),
                     ({"train": [1]}, "toy.train")):
        with pytest.raises(ConfigError) as err:
            build_section(Toy, raw, "toy")
        assert err.value.key == key
    with pytest.raises(ConfigError, match="did you mean 'base_lr'"):
        build_section(Toy, {"train": {"base_rl": 1.0}}, "toy")


def test_moved_keys_are_one_line_naming_each_new_home() -> None:
    with pytest.raises(ConfigError) as err:
        build_section(Toy, {"lr": 0.1, "shards": "x"}, "toy")
    assert err.value.key == "toy.lr" and "\n" not in str(err.value)
    assert "toy.lr moved to toy.train.base_lr" in err.value.message
    assert "toy.shards moved to toy.data.url" in err.value.message


def test_sections_are_typed() -> None:
    config = build_pipeline({"finetune": {"data": {"url": "d"}}})
    assert config.section("train", TrainConfig) is config.train
    assert isinstance(config.section("finetune", FinetuneConfig), FinetuneConfig)
    with pytest.raises(TypeError, match="not a TrainConfig"):
        config.section("data", TrainConfig)
    with pytest.raises(KeyError):
        config.section("nope", TrainConfig)


@dataclass(frozen=True)
class _Typed:
    count: int = 0
    label: str = ""
    where: str = field(default="x", metadata={"path": True})


@given(st.integers() | st.floats(allow_nan=True, allow_infinity=True))
def test_a_number_is_taken_only_where_it_converts_without_loss(value: int | float) -> None:
    """An integer field takes a whole number within 64 bits (torch, numpy, Ray and Arrow hold no bigger one);
    a text field takes a finite number as its text (`peak_flops: 9.89e14`), never YAML's .nan or .inf; a path
    field takes no number at all (`storage_path: 0` is a slip, not a folder named "0")."""
    whole = isinstance(value, int) or (value == value and abs(value) != float("inf") and float(value).is_integer())
    fits = whole and -(2**63) <= int(value) < 2**63
    if fits:
        assert build_section(_Typed, {"count": value}, "s").count == int(value)
    else:
        with pytest.raises(ConfigError, match=r"^s\.count: "):
            build_section(_Typed, {"count": value}, "s")
    finite = isinstance(value, int) or (abs(value) != float("inf") and value == value)
    if finite:
        assert build_section(_Typed, {"label": value}, "s").label == str(value)
    else:
        with pytest.raises(ConfigError, match=r"^s\.label: "):
            build_section(_Typed, {"label": value}, "s")
    with pytest.raises(ConfigError, match=r"^s\.where: expected a path or URL"):
        build_section(_Typed, {"where": value}, "s")


@given(st.text(min_size=1, max_size=120))
def test_a_name_is_refused_exactly_when_its_utf8_bytes_are_too_many_for_a_file_name(name: str) -> None:
    from vitscale.config.checks import NAME_MAX_BYTES, name_length

    size = len(name.encode("utf-8", "surrogatepass"))
    try:
        name_length(name, "cluster.run_name")
        assert size <= NAME_MAX_BYTES
    except ConfigError as exc:
        assert size > NAME_MAX_BYTES and exc.key == "cluster.run_name" and f"is {size} bytes long" in exc.message
    assert NAME_MAX_BYTES + len(".-finetune.0123456789ab.part") < 255  # the longest name vitscale makes of one
