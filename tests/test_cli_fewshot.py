"""`vitscale fewshot CHECKPOINT --data SHARDS`: any checkpoint, in-process, a table or JSON, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.datasets import write_test_dataset
from vitscale.cli import main
from vitscale.data.tools.write import write_dataset
from vitscale.models import create_model, export_npz, export_state_dict, timm_state_dict

SIZE = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("data")
    opts = {"count": 90, "classes": 3, "image_size": SIZE}
    write_dataset("synthetic", str(root / "synth"), splits={"train": 0.7, "test": 0.3}, source_options=opts,
                  max_side=SIZE, progress=False)
    write_dataset("synthetic", str(root / "multi"), splits={"train": 0.7, "test": 0.3},
                  source_options={**opts, "multi_label": True}, max_side=SIZE, progress=False)

    def corrupt(key: str, sample: dict[str, bytes]) -> dict[str, bytes]:
        if key in ("train000004", "test000001"):
            sample["jpg"] = sample["jpg"][:100] + b"\x00" * 50
        return sample

    write_test_dataset(root / "damaged", {"train": [30], "test": [12]}, num_classes=3, size=(20, 16), hook=corrupt)
    return {name: str(root / name) for name in ("synth", "multi", "damaged")}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # The full ViT-Ti/16 (its npz/timm files carry no overrides), on 16-pixel images: one patch.
    return create_model("ViT-Ti/16", num_classes=7, img_size=SIZE).eval()


@pytest.fixture(scope="module")
def files(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    export_state_dict(model, root / "model.pt")
    export_npz(model, root / "model.npz")
    torch.save(timm_state_dict(model), root / "model.pth")
    (root / "garbage.pt").write_bytes(b"not a checkpoint")
    (root / "opcodes.pt").write_bytes(b"garbage")  # a pickle opcode torch's weights-only reader refuses
    torch.save({"weight": torch.zeros(1), "extra": Opaque()}, root / "objects.pt")  # a pickled object: code to run
    return {"pt": str(root / "model.pt"), "npz": str(root / "model.npz"), "pth": str(root / "model.pth"),
            "garbage": str(root / "garbage.pt"), "opcodes": str(root / "opcodes.pt"),
            "objects": str(root / "objects.pt")}


class Opaque:
    """An object a checkpoint may pickle besides tensors: loading it would run this module's code."""


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["fewshot", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["fewshot", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def test_table_for_a_vitscale_export(capsys: pytest.CaptureFixture[str], files: dict, data: dict) -> None:
    assert main(["fewshot", files["pt"], "--data", data["synth"], "--shots", "1", "5", "--seeds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{files['pt']} (vitscale, ViT-Ti/16 at {SIZE})"
    assert lines[1].split() == ["dataset", "1shot", "5shot", "chance", "train", "test", "skipped"]
    row = lines[2].split()
    assert row[0] == "synth" and "±" in row[1] and row[3:] == ["0.333", "63", "27", "0"]
    assert lines[3] == f"top-1 accuracy, mean±std over 2 seed(s) [0, 1]; ridge l2 1024; resolution {SIZE}"


def test_json_and_the_same_numbers_from_every_file_format(capsys: pytest.CaptureFixture[str], files: dict,
                                                          data: dict) -> None:
    args = ["--data", data["synth"], "--data", data["damaged"], "--shots", "2", "5", "--seeds", "3",
            "--error-budget", "0.1", "--batch-size", "16"]
    report = _json(capsys, files["pt"], *args)
    assert (report["format"], report["model"], report["img_size"], report["resolution"]) == ("vitscale", "ViT-Ti/16",
                                                                                             SIZE, SIZE)
    results = report["results"]
    assert results["seeds"] == [0, 1, 2] and results["l2"] == 1024.0
    synth = results[data["synth"]]
    assert len(synth["5shot_seeds"]) == 3
    assert synth["5shot"] == pytest.approx(sum(synth["5shot_seeds"]) / 3)
    assert synth["5shot_std"] >= 0.0
    damaged = results[data["damaged"]]
    assert (damaged["train_examples"], damaged["test_examples"], damaged["skipped"]) == (29, 11, 2)
    assert results["mean_5shot"] == pytest.approx((synth["5shot"] + damaged["5shot"]) / 2)
    # npz and timm files need the architecture named; their weights give the very same probe
    for name, fmt in (("npz", "npz"), ("pth", "timm")):
        other = _json(capsys, files[name], *args, "--model", "ViT-Ti/16", "--img-size", str(SIZE))
        assert other["format"] == fmt
        for url in (data["synth"], data["damaged"]):
            for key in ("2shot_seeds", "5shot_seeds"):
                assert other["results"][url][key] == pytest.approx(results[url][key], abs=1e-9), (name, url, key)


def test_resolution_rebuilds_a_vit_file_with_resampled_position_embeddings(capsys: pytest.CaptureFixture[str],
                                                                           files: dict, data: dict) -> None:
    report = _json(capsys, files["pt"], "--data", data["synth"], "--shots", "5", "--seeds", "1",
                   "--resolution", str(2 * SIZE))
    assert report["img_size"] == report["resolution"] == 2 * SIZE
    assert any("pos_embed: 1x1 -> 2x2" in note for note in report["notes"])


def test_a_run_directory_is_consolidated_and_probed(capsys: pytest.CaptureFixture[str], data: dict, tmp_path: Path,
                                                    process_group: None) -> None:
    """A real training checkpoint (one DeepSpeed ZeRO-2 step of the real loop) is consolidated and probed."""
    import shutil

    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job
    from vitscale.train.loop import WorkerContext, train

    run = tmp_path / "run"
    job = pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/8", "img_size": SIZE, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2},
        "data": {"url": data["synth"], "num_workers": 0, "shuffle_buffer": 16},
        "train": {"global_batch": 8, "micro_batch": 8, "max_steps": 1, "warmup_steps": 0, "zero_stage": 2,
                  "precision": "fp32", "checkpoint_every": 1},
        "cluster": {"num_workers": 1, "use_gpu": False}}))

    def keep(metrics: dict, directory: Path | None) -> None:
        if directory is not None:
            shutil.copytree(directory, run / f"checkpoint_{metrics['step']:09d}")

    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "logs", report=keep))
    capsys.readouterr()  # the training above printed its own lines
    checkpoint = run / "checkpoint_000000001"
    assert main(["fewshot", str(run), "--data", data["synth"], "--shots", "5", "--seeds", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{checkpoint} (run, ViT-Ti/8 at {SIZE}, step 1)"
    probe = [str(run), "--data", data["synth"], "--shots", "5"]
    assert "`vitscale export` it" in _error(capsys, *probe, "--resolution", "32")
    assert "not ViT-B/16" in _error(capsys, *probe, "--model", "ViT-B/16")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["{pt}", "--data", "{missing}"], "no dataset at"),
        (["{pt}", "--data", "{multi}"], "multi-label"),
        (["{pt}", "--data", "{synth}", "--shots", "25"], "25 shots x 3 classes need 75 examples"),
        (["{pt}", "--data", "{damaged}", "--shots", "10", "--error-budget", "0.1"], "class 1 has 9"),
        (["{pt}", "--data", "{damaged}", "--shots", "1"], "fewshot.error_budget"),
        (["{pt}", "--data", "{synth}", "--seeds", "0"], "--seeds: must be a positive int"),
        (["{pt}", "--data", "{synth}", "--train-split", "nope"], "'nope' is not a split"),
        (["{pt}", "--data", "{synth}", "--shots", "5", "--model", "ViT-S/16"], "not ViT-S/16"),
        # a size the patches cannot tile names the flag that asked for it (was create_model's own `img_size=`)
        (["{pt}", "--data", "{synth}", "--shots", "5", "--resolution", "20"], "--resolution: img_size=20 must be"),
        (["{npz}", "--data", "{synth}", "--shots", "5", "--model", "ViT-Ti/16", "--img-size", "20"],
         "--img-size: img_size=20 must be"),
        (["{missing}.pt", "--data", "{synth}"], "no such checkpoint"),
        (["{garbage}", "--data", "{synth}", "--shots", "5"], "cannot read checkpoint"),
        # torch's refusal is paragraphs advising `weights_only=False`: one line, its reason kept.
        (["{opcodes}", "--data", "{synth}", "--shots", "5"], "not a file of tensors that loads without running "
                                                             "code (Unsupported operand 103); vitscale reads weights"),
        (["{objects}", "--data", "{synth}", "--shots", "5"], "(Unsupported global: GLOBAL test_cli_fewshot.Opaque"),
        (["{npz}", "--data", "{synth}", "--shots", "5"], "--model"),
        (["{pth}", "--data", "{synth}", "--shots", "5", "--model", "ViT-Nope/16"], "ViT-Nope/16"),
        # A location spelled wrong is refused naming its argument, not taken for a missing local file.
        (["s3:/bucket/run", "--data", "{synth}"], "checkpoint: s3:/bucket/run is not a location vitscale reads"),
        (["{pt}", "--data", "s3:bucket/data"], "--data: s3:bucket/data is not a location vitscale reads"),
    ],
)
def test_errors_are_one_line(capsys: pytest.CaptureFixture[str], files: dict, data: dict, tmp_path: Path,
                             argv: list[str], match: str) -> None:
    names = {**files, **data, "missing": str(tmp_path / "missing")}
    assert match in _error(capsys, *(a.format(**names) for a in argv))


def test_a_bad_file_in_a_bucket_is_named_by_its_url_not_its_cached_copy(
        capsys: pytest.CaptureFixture[str], files: dict, data: dict, tmp_path: Path, moto_s3: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    monkeypatch.setenv("VITSCALE_S3_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("VITSCALE_CACHE", str(tmp_path / "cache"))
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="weights")
    boto3.client("s3", endpoint_url=moto_s3).upload_file(files["garbage"], "weights", "m/garbage.pt")
    err = _error(capsys, "s3://weights/m/garbage.pt", "--data", data["synth"], "--shots", "1")
    assert "cannot read checkpoint s3://weights/m/garbage.pt:" in err and str(tmp_path / "cache") not in err, err


def test_model_options_describe_an_npz_files_architecture(data: dict, files: dict, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # A shrunk ViT-Ti/16 (one block of width 32) as an npz file: its name alone does not say its shape.
    torch.manual_seed(0)
    small = create_model("ViT-Ti/16", num_classes=7, img_size=SIZE, depth=1, width=32, mlp_dim=64, heads=2).eval()
    export_npz(small, tmp_path / "small.npz")
    argv = [str(tmp_path / "small.npz"), "--data", data["synth"], "--model", "ViT-Ti/16", "--img-size", str(SIZE),
            "--shots", "1", "--seeds", "1"]
    report = _json(capsys, *argv, "--option", "depth=1", "--option", "width=32", "--option", "mlp_dim=64",
                   "--option", "heads=2")
    assert report["model"] == "ViT-Ti/16" and 0.0 <= report["results"]["mean_1shot"] <= 1.0
    assert "small.npz" in _error(capsys, *argv)  # without them the weights do not fit: one line
    assert "--option is for npz and timm files" in _error(capsys, files["pt"], "--data", data["synth"], "--shots", "1",
                                                          "--option", "depth=1")


@pytest.mark.parametrize(("argv", "match"), [
    (["inspect", "s3:bucket/run", "--images", "{synth}", "--out", "{out}"], "checkpoint: s3:bucket/run is not"),
    (["inspect", "{pt}", "--images", "s3://Bad_Bucket/x", "--out", "{out}"], "--images: s3://Bad_Bucket/x:"),
    (["export", "s3:/bucket/run", "--out", "{out}/model.pt"], "run_dir: s3:/bucket/run is not"),
])
def test_the_other_weights_verbs_refuse_a_malformed_location_by_its_argument(
        capsys: pytest.CaptureFixture[str], files: dict, data: dict, tmp_path: Path, argv: list[str],
        match: str) -> None:
    names = {**files, **data, "out": str(tmp_path / "out")}
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: ") and err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was written
