"""Where a run lives: one spelling of its storage, a node cache keyed by its whole location, everything
inside the run.

- `canonical_location` (property-tested): idempotent, every alias of a place gives one form, what has
  no one spelling is refused naming `cluster.storage_path`;
- two runs of one name in two buckets (moto on loopback) keep two node caches, and neither's files
  reach the other's bucket; a node whose home cannot hold the cache uses its own fallback, never the
  driver's path;
- a second spelling of a held run's storage is refused by the lease, before Ray starts;
- a run's fine-tuning is found inside it (and in the older sibling layout), locally and in a bucket.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import string
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from vitscale.config import ConfigError
from vitscale.config.location import bucket_problem, canonical_location, run_cache_name
from vitscale.config.pipeline import ClusterConfig
from vitscale.data.storage import open_storage
from vitscale.data.storage.mirror import RunMirror
from vitscale.data.storage.run_cache import ROOT_ENV

# -- one spelling of a storage location ----------------------------------------------------------

RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def aws_accepts(name: str) -> bool:
    """AWS's general-purpose bucket naming rules, one rule a line, written from its documentation."""
    return (3 <= len(name) <= 63
            and all(c in string.ascii_lowercase + string.digits + ".-" for c in name)
            and name[0].isalnum() and name[-1].isalnum()
            and ".." not in name and ".-" not in name and "-." not in name
            and not (name.count(".") == 3 and all(part.isdigit() for part in name.split(".")))
            and not name.startswith(RESERVED_PREFIXES) and not name.endswith(RESERVED_SUFFIXES))


BUCKETS = st.from_regex(r"[a-z0-9][a-z0-9-]{1,12}[a-z0-9]", fullmatch=True).filter(aws_accepts)
SEGMENTS = st.lists(st.text(string.ascii_letters + string.digits + "-_ =+", min_size=1, max_size=6)
                    .filter(lambda s: s not in (".", "..")), max_size=4)


@st.composite
def s3_spellings(draw: st.DrawFn) -> tuple[str, str]:
    """(the plain spelling of an s3 place, another spelling of it: scheme case, `./`, `x/..`, `//`, trailing `/`)."""
    bucket, segments = draw(BUCKETS), draw(SEGMENTS)
    plain = "/".join([f"s3://{bucket}", *segments])
    scheme = "".join(c.upper() if draw(st.booleans()) else c for c in "s3")
    parts = []
    for segment in segments:
        parts += draw(st.sampled_from([[], ["."], [""], ["detour", ".."], [".", ""]]))
        parts.append(segment)
    tail = draw(st.sampled_from(["", "/", "//", "/./"]))
    return plain, f"{scheme}://{bucket}/" + "/".join(parts) + tail


@given(s3_spellings())
def test_every_spelling_of_an_s3_place_has_one_canonical_form(spellings: tuple[str, str]) -> None:
    plain, other = spellings
    assert canonical_location(other) == canonical_location(plain) == plain


@given(s3_spellings())
def test_the_canonical_form_is_its_own_canonical_form(spellings: tuple[str, str]) -> None:
    once = canonical_location(spellings[1])
    assert canonical_location(once) == once


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "c d"]), max_size=6))
def test_local_spellings_resolve_to_one_absolute_path(parts: list[str]) -> None:
    spelled = "/tmp/vitscale-canonical/" + "/".join(parts)
    once = canonical_location(spelled)
    assert once == os.path.realpath(spelled) and canonical_location(once) == once
    assert canonical_location("file://" + spelled) == once  # file:// is the same local place


def test_a_symlinked_folder_and_its_target_are_one_place(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert canonical_location(str(tmp_path / "link" / "runs")) == canonical_location(str(tmp_path / "real/./runs/"))


@pytest.mark.parametrize("spelling, says", [
    ("s3://bar/runs%2Fexp", "%-encoding"), ("s3://bar/runs?versionId=1", "query"), ("s3://bar/runs#x", "fragment"),
    ("s3://bar/runs\\exp", "backslash"), ("s3://bar/../other/runs", "climbs out of the bucket"),
    ("s3://Bar/runs", "not an S3 bucket name"), ("s3://b/runs", "not an S3 bucket name"),
    ("s3://my..bucket/runs", "not an S3 bucket name"), ("gs://bar/runs", "use a local path"),
    ("file://host/runs", "not a host"), ("s3://bar/ru\nns", "control character"),
])
def test_a_location_with_no_one_spelling_is_refused_in_one_line(spelling: str, says: str, tmp_path: Path) -> None:
    from vitscale.stages import build_pipeline

    with pytest.raises(ConfigError) as err:
        build_pipeline({"name": "r", "cluster": {"storage_path": spelling}}, str(tmp_path / "p.yaml"))
    assert err.value.key == "cluster.storage_path" and says in err.value.message
    assert "\n" not in str(err.value) and str(tmp_path / "p.yaml") in str(err.value)


NAME_PARTS = st.sampled_from(["a", "z", "0", "9", ".", "-", "..", ".-", "-.", "xn--", "sthree-", "amzn-s3-demo-",
                               "-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3", "192", "168.0.1", "B", "_",
                               "bucket", "x" * 30])


@given(st.one_of(st.lists(NAME_PARTS, max_size=8).map("".join), st.text(max_size=70)))
def test_a_bucket_name_is_accepted_exactly_when_aws_accepts_it(name: str) -> None:
    assert (bucket_problem(name) is None) == aws_accepts(name), name


@given(BUCKETS, st.sampled_from(RESERVED_PREFIXES), st.sampled_from(RESERVED_SUFFIXES))
def test_reserved_bucket_prefixes_and_suffixes_are_refused(name: str, prefix: str, suffix: str) -> None:
    assert bucket_problem(name) is None
    assert "reserved by AWS" in (bucket_problem(prefix + name) or "")
    assert "reserved by AWS" in (bucket_problem(name + suffix) or "")


@pytest.mark.parametrize("spelling, says", [
    ("s3:/bar/runs", "an S3 location is written s3://bucket/prefix"), ("s3:bar/runs", "s3://bucket/prefix"),
    ("S3:/bar/runs", "s3://bucket/prefix"), ("file:runs", "a file URL names an absolute path"),
    ("gs:bar/runs", "'gs:' reads as a URL scheme"), ("my+scheme.v1:x", "reads as a URL scheme"),
    ("s3://192.168.0.1/runs", "IP address"), ("s3://xn--bar/runs", "'xn--' is reserved"),
    ("s3://bar.-baz/r", "period beside a hyphen"), ("s3://bar-.baz/r", "period beside a hyphen"),
    ("s3://sthree-bar/r", "reserved"), ("s3://amzn-s3-demo-bar/r", "reserved"), ("s3://bar-s3alias/r", "reserved"),
    ("s3://bar--ol-s3/r", "reserved"), ("s3://bar.mrap/r", "reserved"), ("s3://bar--x-s3/r", "reserved"),
    ("s3://bar--table-s3/r", "reserved"), ("s3://bar_baz/r", "lower-case letters"), ("s3://-bar/r", "beginning"),
])
def test_a_malformed_location_is_refused_naming_the_key_wherever_it_is_given(spelling: str, says: str,
                                                                            tmp_path: Path) -> None:
    from vitscale.stages import build_pipeline

    for raw, key in (({"cluster": {"storage_path": spelling}}, "cluster.storage_path"),
                     ({"data": {"url": spelling}}, "data.url"),
                     ({"stages": ["finetune"], "finetune": {"checkpoint": spelling, "data": {"url": str(tmp_path)}}},
                      "finetune.checkpoint")):
        with pytest.raises(ConfigError) as err:
            build_pipeline({"name": "r", **raw}, str(tmp_path / "p.yaml"))
        assert err.value.key == key and says in err.value.message and spelling in err.value.message, str(err.value)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=f"^storage location: {re.escape(spelling)}.*{re.escape(says)}"):
        open_storage(spelling)  # every dataset and shard destination is opened through the same spelling
    assert not (Path.cwd() / spelling.partition(":")[0]).exists()


def test_a_malformed_storage_path_from_the_command_line_is_one_line_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.cli import main

    monkeypatch.chdir(tmp_path)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(yaml.safe_dump({"name": "tiny", "stages": ["pretrain"]}))
    for spelling in ("s3:/bar/runs", "s3:bar/runs"):
        assert main(["run", str(pipeline), "--set", f"cluster.storage_path={spelling}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("vitscale: error: cluster.storage_path: ") and spelling in err
    assert main(["shards", "write", "--source", "synthetic", "--count", "4", "--out", "s3:/bar/ds"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--out: s3:/bar/ds is not a location" in err, err
    assert os.listdir(tmp_path) == ["p.yaml"]  # no folder named s3: anywhere


def test_a_file_url_in_its_short_form_is_the_local_path(tmp_path: Path) -> None:
    """RFC 8089: `file:/path` is `file:///path`; both are the local path (docs/resume.md)."""
    assert canonical_location(f"file:{tmp_path}/runs") == canonical_location(f"file://{tmp_path}/runs") \
        == str(tmp_path / "runs")
    assert ClusterConfig(storage_path=f"file:{tmp_path}/runs").run_storage("tiny") == str(tmp_path / "runs" / "tiny")


def test_the_run_storage_is_canonical() -> None:
    spelled = ClusterConfig(storage_path="S3://bar/./runs//")
    assert spelled.storage_root == "s3://bar/runs" and spelled.run_storage("exp1") == "s3://bar/runs/exp1"


def test_each_train_runs_metrics_are_labelled_with_its_pipeline_run(tmp_path: Path) -> None:
    from vitscale.launch.run_place import run_place

    # Two pipelines' fine-tunings and sweeps: each Train run's `run` label names its pipeline run, not only
    # the last segment every pipeline shares ("finetune", "final").
    for storage in (str(tmp_path / "runs"), "s3://bucket/runs/"):
        cluster = ClusterConfig(storage_path=storage)
        assert run_place(cluster, "vit-b16").label == "vit-b16"
        assert run_place(cluster, "vit-b16", "finetune").label == "vit-b16/finetune"
        assert run_place(cluster, "vit-l16", "finetune").label == "vit-l16/finetune"
        trials = run_place(cluster, "vit-b16", "sweep-pretrained/trials")
        assert trials.sub("a1b2").label == "vit-b16/sweep-pretrained/trials/a1b2"
        assert run_place(cluster, "vit-b16", "sweep-pretrained/final").label == "vit-b16/sweep-pretrained/final"


# -- a node cache per run location -------------------------------------------------------------


def test_a_cache_name_is_keyed_by_location_and_endpoint_not_the_name() -> None:
    a, b = "s3://team-a/runs/exp1", "s3://team-b/runs/exp1"
    assert run_cache_name(a, None) != run_cache_name(b, None)
    assert run_cache_name(a, "http://minio:9000") != run_cache_name(a, "http://other:9000") != run_cache_name(a, None)
    assert run_cache_name(a, "HTTP://MinIO:9000/") == run_cache_name(a, "http://minio:9000")
    assert run_cache_name(a, None).startswith("exp1-")  # readable: the run's name first


@pytest.fixture
def node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "node"
    monkeypatch.setenv(ROOT_ENV, str(root))
    return root


def _bucket(endpoint: str, name: str) -> str:
    bucket = f"{name}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket


def test_two_buckets_one_run_name_two_caches_and_nothing_crosses(moto_s3: str, node_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.launch.run_place import run_place

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    team_a, team_b = _bucket(moto_s3, "team-a"), _bucket(moto_s3, "team-b")
    places = {team: run_place(ClusterConfig(storage_path=f"s3://{team}/runs"), "exp1") for team in (team_a, team_b)}
    dirs = {team: place.local_dir() for team, place in places.items()}
    assert dirs[team_a] != dirs[team_b] and all(d.parent == node_cache for d in dirs.values())
    # Team A's run writes its records on this node and pushes them, as `vitscale run` does.
    (dirs[team_a] / "metrics").mkdir(parents=True)
    (dirs[team_a] / "metrics" / "rank0.jsonl").write_text('{"team": "a"}\n')
    (dirs[team_a] / "summary.json").write_text('{"team": "a"}')
    RunMirror(dirs[team_a], open_storage(places[team_a].storage)).push()
    # Team B's run of the same name on the same node: pull, write, push.
    b = RunMirror(dirs[team_b], open_storage(places[team_b].storage))
    dirs[team_b].mkdir(parents=True)
    b.pull()
    (dirs[team_b] / "config.yaml").write_text("team: b\n")
    b.push()
    assert open_storage(places[team_b].storage).list() == ["config.yaml"]  # nothing of team A's
    assert open_storage(places[team_a].storage).list() == ["metrics/rank0.jsonl", "summary.json"]
    # Another spelling of team A's storage is team A's cache.
    assert run_place(ClusterConfig(storage_path=f"S3://{team_a}/./runs/"), "exp1").local_dir() == dirs[team_a]


WORKER = """
import pickle, sys
place = pickle.loads(bytes.fromhex(sys.argv[1]))
print(place.local_dir())
"""


def _on_a_node(place: object, home: Path, tmp: Path) -> Path:
    """Where `place` (shipped as the driver ships it to a Ray worker) lands on a node whose user has `home`."""
    env = {k: v for k, v in os.environ.items() if k != ROOT_ENV} | {"HOME": str(home), "TMPDIR": str(tmp)}
    done = subprocess.run([sys.executable, "-c", WORKER, pickle.dumps(place).hex()], env=env, capture_output=True,
                          text=True, check=True, timeout=120)
    return Path(done.stdout.strip())


def test_each_node_resolves_its_own_cache_folder(moto_s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.launch.run_place import run_place

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.delenv(ROOT_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "driver-home"))
    place = run_place(ClusterConfig(storage_path="s3://team-a/runs"), "exp1", "finetune")
    (tmp_path / "tmp").mkdir()
    worker = _on_a_node(place, tmp_path / "worker-home", tmp_path / "tmp")
    assert worker.is_relative_to(tmp_path / "worker-home" / "vitscale-runs-local") and worker.name == "finetune"
    # A node whose user cannot create a folder in its home (here: a home under a plain file).
    (tmp_path / "a-file").write_text("")
    fallback = _on_a_node(place, tmp_path / "a-file" / "home", tmp_path / "tmp")
    root = tmp_path / "tmp" / f"vitscale-runs-local-{os.getuid()}"
    assert fallback.is_relative_to(root) and root.is_dir()
    assert not (tmp_path / "driver-home").exists()  # nothing of the driver's home reached a node


# -- the lease sees one place ----------------------------------------------------------------------


def test_a_second_spelling_of_a_held_run_is_refused_by_its_lease(tmp_path: Path, moto_s3: str, small_synthetic: str,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    import ray

    from helpers.leases import holder as _holder
    from helpers.leases import kill as _kill
    from vitscale.cli import main

    bucket = _bucket(moto_s3, "bar")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    raw = {"name": "lease", "stages": ["pretrain"], "data": {"url": small_synthetic},
           "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
           "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 1, "warmup_steps": 0},
           "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1,
                       "storage_path": f"S3://{bucket}/./runs/", "run_name": "shared"}}
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(raw))
    proc = _holder(f"s3://{bucket}/runs/shared", endpoint=moto_s3)
    try:
        code = main(["run", str(pipeline)])
    finally:
        _kill(proc)
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"run s3://{bucket}/runs/shared is being written by pid {proc.pid}" in lines[0]
    assert not ray.is_initialized()
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["runs/shared/.vitscale-lease"]  # nothing written under ./runs or anywhere else


# -- everything inside the run -----------------------------------------------------------------------


def test_a_runs_finetuning_is_found_inside_it_and_in_the_older_sibling_layout(moto_s3: str, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.checkpoints import complete_checkpoint
    from vitscale.train.export import find_checkpoint

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    bucket = _bucket(moto_s3, "runs")
    for run, part in (("new", "new/finetune"), ("old", "old-finetune")):
        local = complete_checkpoint(tmp_path / part / "checkpoint_000000002", 2)
        storage = open_storage(f"s3://{bucket}/runs/{part}/checkpoint_000000002")
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            storage.write_file(path.relative_to(local).as_posix(), path)
        found = find_checkpoint(f"s3://{bucket}/runs/{run}")
        assert found.name == "checkpoint_000000002" and found.parent.name == Path(part).name, found


def test_resuming_a_finetuning_of_the_older_layout_is_refused_naming_the_new_place(tmp_path: Path) -> None:
    from helpers.checkpoints import complete_checkpoint
    from vitscale.stages import build_pipeline
    from vitscale.stages.finetune import refuse_sibling_finetune

    config = build_pipeline({"name": "r", "stages": ["finetune"],
                             "finetune": {"checkpoint": str(tmp_path / "w.pt"), "data": {"url": str(tmp_path / "d")},
                                          "train": {"base_lr": 0.01}},
                             "cluster": {"storage_path": str(tmp_path / "runs"), "num_workers": 1}})
    refuse_sibling_finetune(config)  # nothing anywhere: a new run
    complete_checkpoint(tmp_path / "runs" / "r-finetune" / "checkpoint_000000002", 2)
    with pytest.raises(ConfigError) as err:
        refuse_sibling_finetune(config)
    assert err.value.key == "cluster.run_name" and str(tmp_path / "runs" / "r" / "finetune") in err.value.message
    complete_checkpoint(tmp_path / "runs" / "r" / "finetune" / "checkpoint_000000004", 4)
    refuse_sibling_finetune(config)  # moved (or begun) in the new place: that one resumes


def test_the_mirror_leaves_every_train_runs_checkpoints_to_ray(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    cache = tmp_path / "cache"
    for name in ("finetune/checkpoint_000000002/rank0.pt", "sweep/trials/t1/checkpoint_000000004/rank0.pt",
                 "sweep/trials/t1/checkpoint_manager_snapshot.json", "finetune/metrics/rank0.jsonl",
                 "sweep/trials/t1/metrics/rank0.jsonl"):
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_text(json.dumps(name))
    assert RunMirror(cache, open_storage(str(storage))).push() == ["finetune/metrics/rank0.jsonl",
                                                                    "sweep/trials/t1/metrics/rank0.jsonl"]
    for name in ("finetune/checkpoint_000000006/rank0.pt", "sweep/final/checkpoint_000000001/rank0.pt"):
        open_storage(str(storage)).write_bytes(name, b"ray train's")
    assert RunMirror(tmp_path / "elsewhere", open_storage(str(storage))).pull() == [
        "finetune/metrics/rank0.jsonl", "sweep/trials/t1/metrics/rank0.jsonl"]  # no checkpoint copied to a driver


# -- end to end: two teams, one run name, one node ------------------------------------------------


def _keys(s3, bucket: str) -> dict[str, str]:
    """Every object and its ETag, less the empty folder markers pyarrow writes (`runs/`)."""
    return {o["Key"]: o["ETag"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", []) if not o["Key"].endswith("/")}


@pytest.mark.slow
def test_two_teams_runs_of_one_name_stay_in_their_own_buckets(moto_s3: str, small_synthetic: str, tmp_path: Path,
                                                              node_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Team A pre-trains and fine-tunes `exp1` in its bucket, then team B pre-trains its own `exp1` on the same
    machine. Each bucket holds its own run only, all of it inside `runs/exp1/` (the fine-tuning too), and
    team B's run changes nothing in team A's bucket."""
    from helpers.ray_runs import run
    from vitscale.data.tools.write import write_dataset

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)  # the drivers and, through them, their workers
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    team_a, team_b = _bucket(moto_s3, "team-a"), _bucket(moto_s3, "team-b")
    digits = tmp_path / "digits"
    write_dataset("digits", str(digits), shard_size=500, seed=0, progress=False, splits={"train": 0.8, "test": 0.2})
    tiny = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32}
    outputs = {}
    for bucket, stages, steps in ((team_a, ["pretrain", "finetune"], 2), (team_b, ["pretrain"], 3)):
        raw = {"name": "exp1", "stages": stages, "data": {"url": small_synthetic}, "model": tiny,
               "train": {"global_batch": 8, "micro_batch": 8, "max_steps": steps, "warmup_steps": 0, "log_every": 1,
                         "precision": "fp32"},
               "finetune": {"dev_fraction": 0.2, "resolution": 16, "data": {"url": str(digits), "num_workers": 0},
                            "train": {"base_lr": 0.01, "max_steps": 2, "warmup_steps": 0, "global_batch": 16,
                                      "micro_batch": 16, "precision": "fp32"}},
               "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "max_failures": 0,
                           "storage_path": f"s3://{bucket}/runs"}}
        pipeline = tmp_path / f"{bucket}.yaml"
        pipeline.write_text(yaml.safe_dump(raw))
        if bucket == team_b:
            before = _keys(s3, team_a)
        outputs[bucket] = run(pipeline, tmp_path / f"{bucket}.log")
        assert '"ok": true' in outputs[bucket]
    assert _keys(s3, team_a) == before  # team B's run wrote nothing into team A's bucket

    a, b = _keys(s3, team_a), _keys(s3, team_b)
    assert all(k.startswith("runs/exp1/") for k in [*a, *b]), sorted(k for k in [*a, *b] if not k.startswith("runs/exp1/"))
    assert any(k.startswith("runs/exp1/finetune/checkpoint_000000002/") for k in a)  # fine-tuning inside the run
    assert "runs/exp1/finetune/metrics/rank0.jsonl" in a
    assert not any("/finetune/" in k for k in b)
    for bucket, steps in ((team_a, 2), (team_b, 3)):
        body = s3.get_object(Bucket=bucket, Key="runs/exp1/metrics/rank0.jsonl")["Body"].read().decode()
        assert [json.loads(line)["step"] for line in body.splitlines()] == list(range(1, steps + 1)), (bucket, body)
        config = yaml.safe_load(s3.get_object(Bucket=bucket, Key="runs/exp1/config.yaml")["Body"].read())
        assert config["cluster"]["storage_path"] == f"s3://{bucket}/runs"
    caches = sorted(p.name for p in node_cache.iterdir())
    assert len(caches) == 2 and all(name.startswith("exp1-") for name in caches)
