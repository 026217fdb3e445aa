"""The CLI's manners: one line for the user's errors and a traceback for bugs, "did you mean" for a
mistyped verb, flag or config key, errors that name the --set they came from, defaults in every --help,
Ctrl-C as one line and exit 130, a wrong --address refused within seconds."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers.pipelines import tiny_pipeline
from vitscale import cli
from vitscale.cli import build_parser, main
from vitscale.config.suggest import closest, did_you_mean


def _parsers(parser: argparse.ArgumentParser, path: str = "vitscale") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _parsers(sub, f"{path} {name}")
    return out


def test_every_help_shows_every_default() -> None:
    missing = []
    for path, parser in _parsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            default = action.default
            if (not action.option_strings or default is None or default is False or default == [] or default is argparse.SUPPRESS
                    or isinstance(action, argparse._HelpAction)):
                continue
            shown = str(default)
            if f"default: {shown}" not in text and f"default {shown}" not in text and f"default: {shown}" not in text:
                missing.append(f"{path} {action.option_strings[0]} (default {shown})")
    assert not missing, missing


def test_closest_name() -> None:
    assert closest("base_lrr", ["base_lr", "end_lr", "warmup_steps"]) == "base_lr"
    assert closest("zzzz", ["base_lr", "end_lr"]) is None
    assert did_you_mean("trian", ["train", "data"]) == " (did you mean 'train'?)"
    assert did_you_mean("qqqq", ["train"]) == ""


@pytest.mark.parametrize(("argv", "hint"), [
    (["rnu", "quickstart"], "(did you mean 'run'?)"),
    (["shards", "wirte"], "(did you mean 'write'?)"),
    (["run", "quickstart", "--adress", "x:1"], "(did you mean '--address'?)"),
    (["export", "run", "--out", "x", "--format", "npy"], "(did you mean 'npz'?)"),
])
def test_mistyped_verbs_flags_and_choices(argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(hint), err


def _pipeline(tmp_path: Path) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "stages": ["pretrain"], "data": {"url": str(tmp_path / "d")}}))
    return path


def test_unknown_config_key_gets_did_you_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _pipeline(tmp_path)
    assert main(["config", str(path), "--set", "train.base_lrr=0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.base_lrr: unknown key (did you mean 'base_lr'?)" in err, err
    assert "(from --set train.base_lrr=0.1)" in err and str(path) not in err


def test_a_bad_set_value_names_the_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _pipeline(tmp_path)
    assert main(["config", str(path), "--set", "train.base_lr=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: train.base_lr: ") and err.rstrip().endswith(
        "(from --set train.base_lr=-1)"), err
    # The same value from the file names the file.
    raw = yaml.safe_load(path.read_text())
    raw["train"] = {"base_lr": -1}
    path.write_text(yaml.safe_dump(raw))
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "--set" not in err


def test_a_rule_over_two_keys_names_the_set_of_either(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _pipeline(tmp_path)
    for item in ("train.masked_patch.mask=0.95", "train.masked_patch.swap=0.5"):  # mask + swap > 1
        assert main(["config", str(path), "--set", "train.objective=masked_patch", "--set", item]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vitscale: error: train.masked_patch.swap: mask + swap") and err.rstrip().endswith(
            f"(from --set {item})"), err


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise ValueError("an internal bug")

    monkeypatch.setattr(cli.models, "cmd_models", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["models"])


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.models, "cmd_models", interrupted)
    assert main(["models"]) == 130
    assert capsys.readouterr().err == "vitscale: interrupted\n"


@pytest.mark.parametrize("argv", [["models"], ["flops", "ViT-B/16", "--json"]])
def test_a_reader_that_went_away_is_no_traceback(argv: list[str]) -> None:
    """`vitscale shards order ... | head`: the reader closes the pipe early. The verb stops quietly, exit
    141 (128 + SIGPIPE, as a shell's own commands), not a BrokenPipeError traceback nor "Exception ignored"."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: any write (or the final flush) breaks
    try:
        done = subprocess.run([sys.executable, "-m", "vitscale", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[2])})
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 141, (done.returncode, done.stderr)


@pytest.mark.parametrize("verb", ["run", "finetune"])
def test_ctrl_c_of_a_run_says_where_it_is_kept_and_how_to_resume(verb: str, tmp_path: Path, small_synthetic: str,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    import vitscale.stages.run as runner

    def interrupted(*args: object, **kwargs: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_pipeline", interrupted)
    if verb == "run":
        pipeline = tmp_path / "p.yaml"
        pipeline.write_text(yaml.safe_dump({
            "name": "exp1", "stages": ["pretrain"], "data": {"url": small_synthetic},
            "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
            "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 2},
            "cluster": {"num_workers": 1, "use_gpu": False, "storage_path": str(tmp_path / "runs")}}))
        argv, kept = ["run", str(pipeline), "--set", "train.base_lr=4e-4"], tmp_path / "runs" / "exp1"
    else:
        argv = ["finetune", str(tmp_path / "weights.pt"), "--data", small_synthetic, "--model", "ViT-Ti/16",
                "--lr", "0.01", "--set", f"cluster.storage_path={tmp_path / 'runs'}"]
        kept = tmp_path / "runs" / f"finetune-weights-{Path(small_synthetic).name}"
    assert main(argv) == 130
    # The command as typed resumes the run.
    assert capsys.readouterr().err == (f"vitscale: interrupted; the run is kept at {kept}: resume it from its last "
                                       f"complete checkpoint with `{shlex.join(['vitscale', *argv])}`\n")


def test_a_wrong_address_is_one_line_within_seconds(tmp_path: Path, small_synthetic: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tiny_pipeline(tmp_path, "t", small_synthetic, {"max_steps": 1})
    started = time.monotonic()
    code = main(["run", str(path), "--address", f"127.0.0.1:{port}"])
    out, err = capsys.readouterr()
    assert code == 2 and time.monotonic() - started < 30, (out, err)
    assert err.count("\n") == 1 and f"no Ray cluster answers at 127.0.0.1:{port}" in err, err
    assert not ray.is_initialized()



@pytest.fixture(scope="module")
def token_head() -> Iterator[tuple[int, Path]]:
    """A head `ray start` left on this machine, with token authentication: (its GCS port, its RAY_TMPDIR)."""
    import secrets
    import shutil
    import signal
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must fit in 107 bytes
    env.update(HOME=str(short), RAY_TMPDIR=str(short), RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                             "--include-dashboard=false", "--node-ip-address=127.0.0.1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(short.glob("ray/ray_current_cluster")):  # the head is up, and findable as Ray finds it
            assert head.poll() is None and time.monotonic() < deadline, "ray start did not come up"
            time.sleep(0.5)
        yield port, short
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # SIGTERM would drain the node for 30 s first
        head.wait(timeout=60)
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.slow
def test_a_cluster_that_wants_a_token_says_so(tmp_path: Path, small_synthetic: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str], token_head: tuple[int, Path]) -> None:
    """A head with token authentication (`ray start` with a token) refuses a driver without
    RAY_AUTH_MODE=token, and Ray says only "Failed to connect": the line says what the cluster wants."""
    import ray

    port, _ = token_head
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = tiny_pipeline(tmp_path, "t", small_synthetic, {"max_steps": 1})
    code = main(["run", str(path), "--address", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(f"vitscale: error: cluster.address: cannot join a Ray cluster at "
                                        f"127.0.0.1:{port}"), err
    assert "needs RAY_AUTH_MODE=token and its token" in err, err
    assert not ray.is_initialized()


@pytest.mark.slow
def test_without_an_address_a_run_starts_its_own_ray_beside_the_one_ray_start_left(
        monkeypatch: pytest.MonkeyPatch, token_head: tuple[int, Path]) -> None:
    """`ray.init()` joins the cluster `ray start` left on this machine: a run without an address joined it
    while saying it had started a local Ray, without its environment, and `cluster.local_num_cpus` was a
    ValueError traceback ("num_cpus ... must not be provided"). It starts a Ray of its own, as the README says
    (`--address auto` joins that one)."""
    import ray

    from vitscale.launch.ray_train import ensure_ray

    port, short = token_head
    monkeypatch.setenv("RAY_TMPDIR", str(short))  # where Ray looks for the cluster `ray start` left
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        said = ensure_ray(None, 1)
        assert said.startswith("started a local Ray with 1 CPUs"), said
        assert not ray.get_runtime_context().gcs_address.endswith(f":{port}")
    finally:
        ray.shutdown()


def test_every_argument_of_every_verb_says_what_it_is() -> None:
    """`--help` explains every argument: none is left bare (a bare --json or DEST says nothing)."""
    bare = [f"{path}: {action.dest}" for path, parser in _parsers(build_parser()) for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction))
            and not (action.help or "").strip()]
    assert not bare, bare


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


@pytest.mark.parametrize(("flags", "named"), [
    (["--rank", "5", "--world-size", "2"], "--rank: must be in [0, 2)"),
    (["--rank", "-1", "--world-size", "2"], "--rank: must be in [0, 2)"),
    (["--rank", "0", "--world-size", "0"], "--world-size: must be a positive int"),
    (["--rank", "0", "--world-size", "1", "--epoch", "-1"], "--epoch: must be an int >= 0"),
    (["--rank", "0", "--world-size", "1", "--start", "-5"], "--start: must be an int >= 0"),
    (["--rank", "0", "--world-size", "1", "--start", "100000"], "--start: must be in [0, 40]"),
    (["--rank", "0", "--world-size", "1", "--shuffle-buffer", "0"], "--shuffle-buffer: must be a positive int"),
    (["--rank", "0", "--world-size", "4", "--global-batch", "2"], "--global-batch: must be >= --world-size 4"),
    # More than the split holds: no batch fills (an empty order), and 10**20 was an OverflowError traceback.
    (["--rank", "0", "--world-size", "1", "--global-batch", "41"], "--global-batch: must be at most the 40 samples"),
    (["--rank", "0", "--world-size", "1", "--global-batch", "99999999999999999999"],
     "--global-batch: must be at most the 40 samples"),
    (["--rank", "0", "--world-size", "1", "--seed", "-1"], "--seed: must be an int in"),
])
def test_shards_order_names_the_flag_it_refuses(flags: list[str], named: str, small_synthetic: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["shards", "order", small_synthetic, *flags]
    if "--epoch" not in flags:
        argv += ["--epoch", "0"]
    assert named in _one_line(capsys, argv)


@pytest.mark.parametrize(("argv", "named"), [
    (["shards", "write", "--source", "synthetic", "--shard-size", "0"], "--shard-size: must be a positive int"),
    (["shards", "write", "--source", "synthetic", "--max-side", "0"], "--max-side: must be >= 8 px"),
    (["shards", "write", "--source", "synthetic", "--quality", "0"], "--quality: must be in [1, 95]"),
    (["shards", "write", "--source", "synthetic", "--seed", "-1"], "--seed: must be an int in"),
    (["shards", "write", "--source", "synthetic", "--max-bad", "-1"], "--max-bad: must be an integer >= 0"),
    (["shards", "write", "--source", "synthetic", "--max-pixels", "0"], "--max-pixels: must be a positive int"),
    (["shards", "write", "--source", "fractal", "--classes", "1"], "--classes: must be in [2, 100000]"),
    (["shards", "bench", "{data}", "--batch-size", "0"], "--batch-size: must be a positive int"),
    (["shards", "bench", "{data}", "--batch-size", "8", "--seconds", "0"], "--seconds: must be > 0"),
    (["inspect", "{weights}", "--model", "ViT-Ti/16", "--img-size", "-1", "--images", "{data}", "--out", "{out}"],
     "--img-size: must be a positive int"),
    # MAX_RESOLUTION: 10**20 was torch's OverflowError from the resize; 100,000 px a worker's out-of-memory
    (["shards", "bench", "{data}", "--resolution", "99999999999999999999"], "--resolution: must be at most 4096 px"),
    (["inspect", "{weights}", "--model", "ViT-Ti/16", "--img-size", "100000", "--images", "{data}", "--out", "{out}"],
     "--img-size: must be at most 4096 px"),
    (["flops", "ViT-B/16", "--resolution", "100000"], "--resolution: must be at most 4096 px"),
    # the fewshot: keys its flags set said `fewshot.l2:`; 10**20 draws said "fewshot.seed: must be in [0, -9999...]"
    (["fewshot", "{weights}", "--model", "ViT-Ti/16", "--img-size", "32", "--data", "{data}", "--l2", "0"],
     "--l2: must be > 0"),
    (["fewshot", "{weights}", "--model", "ViT-Ti/16", "--img-size", "32", "--data", "{data}", "--seeds",
      "99999999999999999999"], "--seeds: must be at most 4294967296"),
    (["fewshot", "{weights}", "--model", "ViT-Ti/16", "--img-size", "32", "--data", "{data}", "--shots", "1", "0"],
     "--shots: must be > 0"),
    # 0 was read as "not given": the file read at 224 px (train/weights.py, which fewshot reads through too)
    (["inspect", "{weights}", "--model", "ViT-Ti/16", "--img-size", "0", "--images", "{data}", "--out", "{out}"],
     "--img-size: must be a positive int, got 0"),
    (["shards", "dedup", "--train", "{data}", "--against", "{data}", "--out", "{out}", "--threshold", "64"],
     "--threshold: must be in [0, 63] bits, got 64"),
    (["shards", "dedup", "--train", "{data}", "--against", "{data}", "--out", "{out}", "--threshold", "-1"],
     "--threshold: must be in [0, 63] bits, got -1"),
])
def test_a_bad_number_names_the_flag_that_set_it(argv: list[str], named: str, small_synthetic: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Each said the parameter of the function the verb calls (`shard_size:`, `batch_size:`, `threshold:`,
    `img_size:`); and wrote nothing."""
    import torch

    from vitscale.models import create_model, timm_state_dict

    weights = tmp_path / "vit.pth"
    torch.save(timm_state_dict(create_model("ViT-Ti/16", num_classes=3, img_size=32)), weights)
    argv = [a.format(data=small_synthetic, weights=weights, out=tmp_path / "out") for a in argv]
    if argv[:2] == ["shards", "write"]:
        argv += ["--out", str(tmp_path / "out")]
    err = _one_line(capsys, argv)
    assert err.startswith(f"vitscale: error: {named}"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("classes", ["99999999999999999999", "1048577", "-1"])
def test_flops_of_more_classes_than_a_dataset_holds_is_one_line(classes: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """10**20 classes was torch's traceback from the meta device."""
    err = _one_line(capsys, ["flops", "ViT-B/16", "--classes", classes])
    assert err.startswith("vitscale: error: --classes: must be in [0, 1,048,576] (0: no classifier"), err


@pytest.mark.parametrize(("argv", "named"), [
    (["shards", "write", "--source", "synthetic", "--count", "99999999999999999999"],  # an OverflowError traceback
     "--count: must be in [1, 100,000,000], got 99999999999999999999"),
    (["shards", "write", "--source", "fractal", "--count", "9999999999"],  # a 75-GiB array's MemoryError
     "--count: must be in [1, 100,000,000], got 9999999999"),
    (["shards", "index", "{data}", "--num-classes", "1000000000"],  # a name for each class: a MemoryError
     "--num-classes must be a count in [1, 1,048,576], got 1000000000"),
])
def test_counts_that_would_exhaust_memory_are_refused_in_one_line(argv: list[str], named: str, small_synthetic: str,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line(capsys, [a.format(data=small_synthetic) for a in argv] + ["--out", str(tmp_path / "out")])
    assert named in err, err
    assert not (tmp_path / "out").exists()


def test_a_benchmark_batch_larger_than_the_split_is_one_line(small_synthetic: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line(capsys, ["shards", "bench", small_synthetic, "--batch-size", "64", "--seconds", "1"])
    assert "not one batch of 64" in err


def test_planning_a_pipeline_without_a_study_names_its_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line(capsys, ["study", "plan", str(_pipeline(tmp_path))])
    assert "stages: no study stage to plan: ['pretrain']" in err


@pytest.mark.parametrize("verb", [["flops", "ViT-B/16"], ["fewshot", "ckpt", "--data", "d"],
                                  ["inspect", "ckpt", "--images", "d", "--out", "o"]])
def test_a_malformed_option_names_option_not_set(verb: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`--option depth` (no value) said "depth: an override must look like dotted.key=value (e.g.
    train.base_lr=4e-4) (in --set)": a flag the command was not given."""
    at = [str(tmp_path / a) if a in ("ckpt", "d", "o") else a for a in verb]
    for option, words in (("depth", "must look like KEY=VALUE"), ("depth=[1", "cannot parse value")):
        assert main([*at, "--option", option]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vitscale: error: --option depth: {words}") and "--set" not in err, err
        assert err.count("\n") == 1, err


def test_finetune_names_the_flag_not_the_key_it_sets(tmp_path: Path, small_synthetic: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    weights = str(tmp_path / "weights.pt")
    argv = ["finetune", weights, "--data", small_synthetic, "--model", "ViT-Ti/16"]
    err = _one_line(capsys, argv)
    assert err.startswith("vitscale: error: --lr: the finetune stage trains one learning rate and none is set"), err
    assert "[]" not in err
    assert "--lr: must be > 0" in _one_line(capsys, [*argv, "--lr", "-1"])
    assert "--preset: must be one of" in _one_line(capsys, [*argv, "--lr", "0.1", "--preset", "nope"])
    err = _one_line(capsys, [*argv, "--lr", "0.1", "--set", "finetune.train.base_lr=-1"])
    assert err.startswith("vitscale: error: finetune.train.base_lr:") and "(from --set" in err  # the --set named
    missing = str(tmp_path / "missing")
    err = _one_line(capsys, ["finetune", weights, "--data", missing, "--model", "ViT-Ti/16", "--lr", "0.1"])
    assert err.startswith(f"vitscale: error: --data: no dataset at {missing}"), err  # found by the data's check
    # --img-size 0 was read as "not given" (224); alone, without --model, it went unread; a missing test split
    # said `finetune.test_split:`, a key the verb has no flag for until --test-split
    assert "--img-size: must be a positive int, got 0" in _one_line(capsys, [*argv, "--lr", "0.1", "--img-size", "0"])
    err = _one_line(capsys, ["finetune", weights, "--data", small_synthetic, "--lr", "0.1", "--img-size", "48"])
    assert err.startswith("vitscale: error: --img-size: goes with --model"), err
    err = _one_line(capsys, [*argv, "--lr", "0.1", "--test-split", "validation"])
    assert err.startswith("vitscale: error: --test-split: 'validation' is not a split of"), err


def test_a_list_flag_that_swallowed_the_positional_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fewshot", "--data", str(tmp_path), "--shots", "1", "5", str(tmp_path)])
    assert capsys.readouterr().err.rstrip().endswith(
        "(--shots takes every value up to the next flag: put CHECKPOINT before --shots, or end its values with --)")
    with pytest.raises(SystemExit):
        main(["fewshot", "--data", str(tmp_path), "--shots", "x", str(tmp_path)])  # a typo is said as it is
    assert capsys.readouterr().err.rstrip().endswith("invalid int value: 'x'")


def test_a_user_error_of_many_lines_is_printed_as_one(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.config.errors import UserError

    def verbose(args: argparse.Namespace) -> int:
        raise UserError("a library's message\n\twith its advice\non lines of their own")

    monkeypatch.setattr(cli.models, "cmd_models", verbose)
    assert main(["models"]) == 2
    assert capsys.readouterr().err == "vitscale: error: a library's message with its advice on lines of their own\n"


def test_a_storage_path_that_is_a_file_is_named_by_its_key(tmp_path: Path, small_synthetic: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    path = tiny_pipeline(tmp_path, "t", small_synthetic, {"max_steps": 1})
    for storage in (tmp_path / "file", tmp_path / "file" / "runs"):
        err = _one_line(capsys, ["run", str(path), "--set", f"cluster.storage_path={storage}"])
        assert err.startswith(f"vitscale: error: cluster.storage_path: {storage}") and "is a file" in err, err
        assert err.rstrip().endswith(f"(from --set cluster.storage_path={storage})"), err
    assert (tmp_path / "file").read_text() == "x"


def test_every_endpoint_url_flag_is_checked_as_data_endpoint_url_is(capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --endpoint-url is refused by the parser naming the flag, on every verb that takes it, as the
    pipeline's data.endpoint_url is; boto3 said it only at the first read, in a line naming no flag."""
    parser = build_parser()
    verbs = []
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for sub in action.choices.values():
            nested = [a for a in sub._actions if isinstance(getattr(a, "choices", None), dict)]
            for p in [q for a in nested for q in a.choices.values()] or [sub]:
                if any("--endpoint-url" in a.option_strings for a in p._actions):
                    verbs.append(p)
    assert len(verbs) >= 10, [p.prog for p in verbs]  # shards' verbs, export, fewshot, inspect, study report
    for p in verbs:
        for bad in ("http://", "http://minio 9000", "minio:9000", "http://minio:port"):
            with pytest.raises(SystemExit) as exit_:
                p.parse_known_args(["--endpoint-url", bad])
            assert exit_.value.code == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]
            assert err.startswith(f"{p.prog}: error: argument --endpoint-url: must be an http:// or https:// URL"), err
        with pytest.raises(SystemExit):  # a good endpoint passes; the verb's missing positionals are then said
            p.parse_known_args(["--endpoint-url", "http://minio:9000"])
        assert "argument --endpoint-url" not in capsys.readouterr().err
