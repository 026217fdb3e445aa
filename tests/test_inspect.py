"""`vitscale inspect`: the analyses' maths on constructed cases with known answers, and the verb end to end."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from helpers.models import TINY
from vitscale.cli import main
from vitscale.data.tools.write import write_dataset
from vitscale.inspect.analyses import (
    attention_rollout,
    filter_components,
    mean_attention_distance,
    patch_distances,
    position_similarity,
    rollout_map,
    uniform_attention_distance,
)
from vitscale.inspect.extract import images_per_pass, patch_filters, position_table
from vitscale.models import create_model, export_state_dict
from vitscale.models.factory import model_meta

# --- mean attention distance (Figure 7 right) -----------------------------------------------------------


def test_attention_to_self_only_has_distance_zero() -> None:
    grid, prefix = (3, 4), 1
    t = prefix + 12
    attention = np.broadcast_to(np.eye(t), (2, 3, t, t))
    assert np.array_equal(mean_attention_distance(attention, grid, stride=16, prefix=prefix), np.zeros((2, 3)))


def test_uniform_attention_on_a_2x2_grid() -> None:
    # From any corner of a 2x2 grid: itself (0), two neighbours (1) and the diagonal (sqrt 2).
    attention = np.full((1, 1, 4, 4), 0.25)
    expected = 16 * (0 + 1 + 1 + math.sqrt(2)) / 4
    assert mean_attention_distance(attention, (2, 2), stride=16)[0, 0] == pytest.approx(expected)
    assert uniform_attention_distance((2, 2), stride=16) == pytest.approx(expected)  # the plot's reference line


def test_uniform_attention_on_a_large_grid_is_the_mean_distance_in_a_square() -> None:
    # Two uniform random points in a square of side s are (2 + sqrt 2 + 5 ln(1 + sqrt 2)) / 15 * s apart
    # on average; the n x n grid of patch centres approaches it as n grows.
    n, stride = 32, 4
    attention = np.full((1, 2, n * n, n * n), 1.0 / (n * n))
    square = (2 + math.sqrt(2) + 5 * math.log(1 + math.sqrt(2))) / 15
    got = mean_attention_distance(attention, (n, n), stride=stride)
    assert got == pytest.approx(np.full((1, 2), square * n * stride), rel=1e-3)


def test_mass_on_the_class_token_is_left_out_not_counted_as_distance_zero() -> None:
    n = 3
    uniform = np.full((1, 1, 1 + n * n, 1 + n * n), 1.0 / (1 + n * n))
    patches_only = np.zeros_like(uniform)
    patches_only[..., 1:] = 1.0 / (n * n)
    a = mean_attention_distance(uniform, (n, n), stride=8, prefix=1)
    b = mean_attention_distance(patches_only, (n, n), stride=8, prefix=1)
    assert a == pytest.approx(b) and a[0, 0] > 0


def test_patch_distances_are_pixels_between_centres() -> None:
    d = patch_distances((2, 3), stride=10)  # tokens row-major: (0,0) (0,1) (0,2) (1,0) ...
    assert d[0, 2] == pytest.approx(20) and d[0, 3] == pytest.approx(10)
    assert d[0, 5] == pytest.approx(math.hypot(10, 20))
    assert np.allclose(d, d.T) and np.all(np.diag(d) == 0)


def test_attention_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="1 prefix token"):
        mean_attention_distance(np.zeros((1, 1, 4, 4)), (2, 2), stride=1, prefix=1)


# --- attention rollout (Figure 6) -------------------------------------------------------------------------


def test_rollout_of_identity_attention_is_the_identity() -> None:
    t = 5
    layers = [np.broadcast_to(np.eye(t), (2, 4, t, t)) for _ in range(3)]
    assert np.allclose(attention_rollout(layers), np.broadcast_to(np.eye(t), (2, t, t)))


def test_rollout_adds_the_residual_and_multiplies_later_layers_on_the_left() -> None:
    first = np.array([[[0.0, 1.0], [0.0, 1.0]]])  # every token reads token 1: with residual [[.5, .5], [0, 1]]
    second = np.array([[[1.0, 0.0], [1.0, 0.0]]])  # every token reads token 0: [[1, 0], [.5, .5]]
    expected = np.array([[1.0, 0.0], [0.5, 0.5]]) @ np.array([[0.5, 0.5], [0.0, 1.0]])
    assert np.allclose(attention_rollout([first, second])[0], expected)  # [[.5, .5], [.25, .75]]


def test_rollout_averages_heads_and_keeps_rows_stochastic() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2, 4, 7, 7))  # layers, B, heads, T, T
    layers = list(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
    rollout = attention_rollout(layers)
    assert np.allclose(rollout.sum(-1), 1.0)
    assert np.allclose(rollout, attention_rollout([a.mean(axis=1) for a in layers]))


def test_rollout_map_reads_the_class_token_row_or_the_mean_of_patch_rows() -> None:
    rng = np.random.default_rng(1)
    rollout = rng.random((2, 5, 5))
    assert np.array_equal(rollout_map(rollout, (2, 2), prefix=1)[1], rollout[1, 0, 1:].reshape(2, 2))
    gap = rng.random((1, 4, 4))
    assert np.allclose(rollout_map(gap, (2, 2), prefix=0)[0], gap[0].mean(axis=0).reshape(2, 2))


# --- position-embedding similarity (Figure 7 centre) -------------------------------------------------------


def sincos_2d(rows: int, cols: int, dim: int) -> np.ndarray:
    """(rows * cols, dim): half the dims sin/cos of the row at several frequencies, half of the column."""
    quarter = dim // 4
    freq = 1.0 / 10.0 ** (np.arange(quarter) / quarter)

    def enc(pos: np.ndarray) -> np.ndarray:
        angles = pos[:, None] * freq[None, :]
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return np.concatenate([enc(r.ravel().astype(float)), enc(c.ravel().astype(float))], axis=1)


def test_a_2d_sincos_table_is_most_similar_along_its_own_row_and_column() -> None:
    rows, cols = 5, 6
    sim = position_similarity(sincos_2d(rows, cols, 32), (rows, cols))
    assert sim.shape == (rows, cols, rows, cols)
    for r in range(rows):
        for c in range(cols):
            assert sim[r, c, r, c] == pytest.approx(1.0)
            for r2 in range(rows):
                for c2 in range(cols):
                    if r2 != r and c2 != c:  # off both lines: below the same column / row in the same row / col
                        assert sim[r, c, r, c2] > sim[r, c, r2, c2]
                        assert sim[r, c, r2, c] > sim[r, c, r2, c2]


def test_a_2d_learned_model_table_is_expanded_per_patch() -> None:
    model = create_model("ViT-Ti/8", num_classes=2, img_size=32, pos_emb="learn_2d", **TINY)
    table, note = position_table(model)
    assert table is not None and table.shape == (16, TINY["width"]) and note is None
    sim = position_similarity(table, (4, 4))
    assert sim[0, 0, 0, 3] > sim[0, 0, 3, 3]  # row 0's half of the embedding is shared along row 0


def test_models_without_absolute_positions_say_so() -> None:
    table, note = position_table(create_model("ViT-Ti/8", num_classes=2, img_size=32, pos_emb="relative", **TINY))
    assert table is None and "no absolute position embeddings" in note


# --- embedding-filter components (Figure 7 left) -----------------------------------------------------------


def test_pca_of_filters_built_from_known_components_recovers_them() -> None:
    rng = np.random.default_rng(0)
    c, p, d = 3, 4, 300
    basis = np.linalg.qr(rng.normal(size=(c * p * p, c * p * p)))[0][:, :3].T  # 3 orthonormal filters
    stds = np.array([5.0, 3.0, 1.5])
    z = rng.normal(size=(d, 3))
    coeff = np.linalg.qr(z - z.mean(axis=0))[0] * stds  # centred, uncorrelated, spreads in the ratio of stds
    mean_filter = rng.normal(size=c * p * p)
    filters = (mean_filter + coeff @ basis).reshape(d, c, p, p)
    components, explained = filter_components(filters, 28)
    assert components.shape == (min(28, d, c * p * p), c, p, p)
    for i in range(3):
        assert abs(float(components[i].ravel() @ basis[i])) == pytest.approx(1.0, abs=1e-3)
    assert explained[:3] == pytest.approx(stds**2 / (stds**2).sum())
    flat = components.reshape(len(components), -1)
    assert np.allclose(flat @ flat.T, np.eye(len(components)), atol=1e-8)
    assert np.all(flat[np.arange(len(flat)), np.abs(flat).argmax(axis=1)] > 0)  # one sign, rerun after rerun


def test_a_hybrid_has_no_pixel_filters_and_says_why() -> None:
    model = create_model("R50x1+ViT-Ti/16", num_classes=2, img_size=32, resnet_layers=(1, 1, 1), **TINY)
    filters, why = patch_filters(model)
    assert filters is None and "hybrid" in why


# --- attention probabilities from the model -----------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"pos_emb": "relative"}, {"classifier": "gap"}])
def test_explicit_attention_path_gives_the_fused_path_output(options: dict) -> None:
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=2, img_size=32, **TINY, **options).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fused = model.forward_encoder(x)
        explicit, maps = model.forward_attention(x)
    t = 16 + model.num_prefix_tokens
    assert torch.allclose(fused, explicit, atol=1e-5)
    assert len(maps) == TINY["depth"] and maps[0].shape == (2, TINY["heads"], t, t)
    assert torch.allclose(maps[0].sum(-1), torch.ones(2, TINY["heads"], t), atol=1e-5)


def test_large_models_look_at_fewer_images_per_pass() -> None:
    with torch.device("meta"):
        small = create_model("ViT-Ti/8", num_classes=2, img_size=32, **TINY)
        large = create_model("ViT-L/16", num_classes=2, img_size=384)
    assert images_per_pass(small) == 16
    assert images_per_pass(large) == 2  # 24 layers x 16 heads x 577^2 x 4 bytes = 511 MiB per image


# --- the verb -----------------------------------------------------------------------------------------------

SIZE = 32
PNGS = ["attention_distance.png", "attention_rollout.png", "filter_components.png", "posemb_similarity.png"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("images") / "synth"
    write_dataset("synthetic", str(root), splits={"train": 0.8, "test": 0.2}, max_side=SIZE, progress=False,
                  source_options={"count": 20, "classes": 3, "image_size": SIZE})
    return str(root)


def _export(model: torch.nn.Module, path: Path) -> str:
    export_state_dict(model, path, meta=model_meta(model))
    return str(path)


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscale: error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def test_inspect_writes_every_figure_and_its_numbers(images: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = create_model("ViT-Ti/8", num_classes=3, img_size=SIZE, **TINY)  # 4x4 grid, 2 layers, 2 heads
    out = tmp_path / "out"
    assert main(["inspect", _export(model, tmp_path / "vit.pt"), "--images", images, "--out", f"{out}/",
                 "--count", "3", "--split", "test"]) == 0  # `--out inspect/`, as docs/inspect.md writes it
    printed = capsys.readouterr().out
    assert f"  wrote {out}/{PNGS[0]}" in printed.splitlines() and "//" not in printed
    for name in PNGS:
        with Image.open(out / name) as png:
            assert png.format == "PNG" and min(png.size) > 200, name
    distance = pq.read_table(out / "attention_distance.parquet").to_pandas()
    assert list(distance[["layer", "head"]].itertuples(index=False, name=None)) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert ((distance.distance_px > 0) & (distance.distance_px < SIZE * math.sqrt(2))).all()
    assert (distance.images == 3).all()
    pcs = pq.read_table(out / "pcs.parquet").to_pandas()
    assert pcs.component.nunique() == 28 and len(pcs) == 28 * 3 * 8 * 8
    assert pcs.groupby("component").explained_variance_ratio.first().is_monotonic_decreasing
    sim = pq.read_table(out / "posemb_similarity.parquet").to_pandas()
    assert len(sim) == 16 * 16
    assert np.allclose(sim[(sim.row == sim.other_row) & (sim.col == sim.other_col)].cosine, 1.0)
    rollout = pq.read_table(out / "rollout.parquet").to_pandas()
    assert len(rollout) == 3 * 16 and rollout.key.nunique() == 3 and (rollout.rollout > 0).all()
    report = json.loads((out / "inspect.json").read_text())
    assert (report["model"], report["layers"], report["heads"], report["split"]) == ("ViT-Ti/8", 2, 2, "test")
    assert len(report["image_keys"]) == 3 and report["notes"] == []


def test_an_npz_file_is_read_with_model_and_img_size_as_fewshot_reads_it(images: str, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from vitscale.models import export_npz

    torch.manual_seed(0)
    model = create_model("ViT-Ti/16", num_classes=3, img_size=SIZE)  # the full Ti (npz files carry no overrides)
    export_npz(model, tmp_path / "vit.npz")
    distances = []
    for argv in ([_export(model, tmp_path / "vit.pt")], [str(tmp_path / "vit.npz"), "--model", "ViT-Ti/16",
                                                          "--img-size", str(SIZE)]):
        out = tmp_path / argv[0].rsplit(".", 1)[1]
        assert main(["inspect", *argv, "--images", images, "--out", str(out), "--count", "2"]) == 0
        distances.append(pq.read_table(out / "attention_distance.parquet").to_pandas().distance_px.to_numpy())
    capsys.readouterr()
    assert len(distances[0]) == 12 * 3 and np.allclose(distances[0], distances[1], atol=1e-4)
    assert "--model" in _error(capsys, str(tmp_path / "vit.npz"), "--images", images, "--out", str(tmp_path / "o"))


def test_a_hybrid_skips_the_filter_figure_with_a_note(images: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = create_model("R50x1+ViT-Ti/16", num_classes=3, img_size=SIZE, resnet_layers=(1, 1, 1), **TINY)
    out = tmp_path / "out"
    assert main(["inspect", _export(model, tmp_path / "hybrid.pt"), "--images", images, "--out", str(out),
                 "--count", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any("hybrid" in note and "does not apply" in note for note in report["notes"])
    assert "filter_components.png" not in report["files"] and not (out / "pcs.parquet").exists()
    assert {"attention_distance.png", "attention_rollout.png", "posemb_similarity.png"} <= set(report["files"])
    distance = pq.read_table(out / "attention_distance.parquet").to_pandas()
    assert distance.distance_px.max() <= SIZE * math.sqrt(2)  # pixels: a 2x2 grid of 16-pixel tokens


def test_a_resnet_is_refused_in_one_line(images: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resnet = create_model("R50x1", num_classes=3, img_size=SIZE, resnet_layers=(1, 1, 1, 1))
    err = _error(capsys, _export(resnet, tmp_path / "r50.pt"), "--images", images, "--out", str(tmp_path / "o"))
    assert "R50x1 is a ResNet: inspect analyses ViTs and hybrids" in err
    torch.save({}, tmp_path / "weights.pth")  # named as a ResNet: refused before the file is read
    assert "is a ResNet" in _error(capsys, str(tmp_path / "weights.pth"), "--model", "R50x1", "--images", images,
                                   "--out", str(tmp_path / "o"))


def test_sample_images_are_the_first_readable_ones(tmp_path: Path) -> None:
    from helpers.datasets import write_test_dataset
    from vitscale.inspect.images import sample_images

    def corrupt(key: str, sample: dict[str, bytes]) -> dict[str, bytes]:
        if key == "train000001":
            sample["jpg"] = sample["jpg"][:100] + b"\x00" * 50
        return sample

    write_test_dataset(tmp_path / "d", {"train": [6]}, num_classes=3, size=(20, 16), hook=corrupt)
    sample = sample_images(str(tmp_path / "d"), "train", 4, 16)
    assert sample.pixels.shape == (4, 3, 16, 16) and sample.pixels.dtype == torch.uint8
    assert sorted(sample.keys) == ["train000000", "train000002", "train000003", "train000004"]
    assert sample_images(str(tmp_path / "d"), "train", 4, 16).keys == sample.keys  # the same images every run
    assert len(sample_images(str(tmp_path / "d"), "train", 50, 16).keys) == 5  # all the split has


def test_bad_arguments_are_one_line_errors(images: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vit = _export(create_model("ViT-Ti/8", num_classes=3, img_size=SIZE, **TINY), tmp_path / "vit.pt")
    out = str(tmp_path / "o")
    assert "--count" in _error(capsys, vit, "--images", images, "--out", out, "--count", "0")
    assert "'val' is not a split" in _error(capsys, vit, "--images", images, "--out", out, "--split", "val")
    assert "--images: no dataset" in _error(capsys, vit, "--images", str(tmp_path / "nothing"), "--out", out)
    assert "no such checkpoint" in _error(capsys, str(tmp_path / "missing.pt"), "--images", images, "--out", out)
    (tmp_path / "file").write_text("x")
    assert "--out" in _error(capsys, vit, "--images", images, "--out", str(tmp_path / "file"))  # before the work
    assert "is a file, not a folder" in _error(capsys, vit, "--images", images, "--out", str(tmp_path / "file" / "o"))


def test_an_npz_file_of_a_changed_architecture_is_read_with_option(images: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`--option` builds the file's architecture where it differs from the named variant (as fewshot's does)."""
    from vitscale.models import export_npz

    torch.manual_seed(0)
    model = create_model("ViT-Ti/16", num_classes=3, img_size=SIZE, depth=2)
    export_npz(model, tmp_path / "vit.npz")
    argv = [str(tmp_path / "vit.npz"), "--model", "ViT-Ti/16", "--img-size", str(SIZE), "--images", images,
            "--count", "2"]
    assert main(["inspect", *argv, "--out", str(tmp_path / "two"), "--option", "depth=2"]) == 0
    layers = pq.read_table(tmp_path / "two" / "attention_distance.parquet").to_pandas().layer.nunique()
    assert layers == 2
    capsys.readouterr()
    assert main(["inspect", *argv, "--out", str(tmp_path / "twelve")]) != 0  # 12 layers expected, 2 in the file


def test_the_figures_go_into_a_bucket_as_into_a_folder(images: str, tmp_path: Path, moto_s3: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import boto3

    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket="figures")
    vit = _export(create_model("ViT-Ti/8", num_classes=3, img_size=SIZE, **TINY), tmp_path / "vit.pt")
    assert main(["inspect", vit, "--images", images, "--out", "s3://figures/runs/vit", "--count", "2",
                 "--endpoint-url", moto_s3, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    listed = boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket="figures", Prefix="runs/vit/")
    assert {o["Key"] for o in listed["Contents"]} == {f"runs/vit/{name}" for name in [*report["files"], "inspect.json"]}
    assert set(PNGS) <= set(report["files"])


def test_inspecting_again_into_a_folder_never_mixes_the_earlier_set_with_the_new(
        images: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import vitscale.inspect.run as inspect_run

    out, argv = tmp_path / "out", ["--images", images, "--out", str(tmp_path / "out"), "--count", "2", "--json"]
    vit = create_model("ViT-Ti/8", num_classes=3, img_size=SIZE, **TINY)
    assert main(["inspect", _export(vit, tmp_path / "vit.pt"), *argv]) == 0
    assert set(json.loads(capsys.readouterr().out)["files"]) == set(inspect_run.FILES)  # FILES names them all
    # A hybrid has no filter figure: the ViT's pcs.parquet and filter_components.png do not stay beside its set.
    hybrid = create_model("R50x1+ViT-Ti/16", num_classes=3, img_size=SIZE, resnet_layers=(1, 1, 1), **TINY)
    assert main(["inspect", _export(hybrid, tmp_path / "hybrid.pt"), *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*report["files"], "inspect.json"])
    # Interrupted halfway (after the tables, before the last figure): the hybrid's inspect.json does not stay
    # to vouch for the ViT's new tables beside its own figures, and the half set goes with it.
    monkeypatch.setattr(inspect_run, "plot_rollout", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert main(["inspect", str(tmp_path / "vit.pt"), *argv]) == 130
    assert _unprogressed(capsys.readouterr().err) == ["vitscale: interrupted"] and list(out.iterdir()) == []
    # A disk that fills is one line naming what was being written (was an OSError traceback); nothing stays.
    monkeypatch.setattr(inspect_run, "plot_rollout", lambda *a, **k: (_ for _ in ()).throw(
        OSError(28, "No space left on device", "attention_rollout.png")))
    assert main(["inspect", str(tmp_path / "vit.pt"), *argv[:-1], "--out", str(tmp_path / "new" / "out")]) == 2
    err = _unprogressed(capsys.readouterr().err)
    assert err[0].startswith(f"vitscale: error: inspect into {tmp_path / 'new' / 'out'}: OSError: [Errno 28]"), err
    assert len(err) == 1 and not (tmp_path / "new").exists()


def _unprogressed(err: str) -> list[str]:
    """stderr's lines but the progress lines a slow step prints (one every 10 s in a log: a loaded machine's)."""
    return [line for line in err.splitlines() if not re.search(r"  (ETA|elapsed) \S+$", line)]
