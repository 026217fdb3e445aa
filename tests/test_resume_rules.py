"""Resume refuses a changed run: `changed_keys` (pure, property-tested) and the driver's check before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vitscale.config.checks import ConfigError
from vitscale.train.resume import (
    ABSENT,
    FINETUNE_SCOPE,
    PRETRAIN_SCOPE,
    RESUME_MAY_CHANGE,
    changed_keys,
    flatten,
    refuse_changed_run,
)

leaf = st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=3), st.booleans(), st.none(),
                 st.lists(st.integers(0, 3), max_size=3))
name = st.sampled_from(["a", "b", "seed", "global_batch", "url"])
tree = st.recursive(leaf, lambda inner: st.dictionaries(name, inner, min_size=1, max_size=4), max_leaves=6)
config = st.fixed_dictionaries({s: st.dictionaries(name, tree, max_size=3)
                                for s in ("model", "data", "train", "fewshot", "cluster")})
# A shared, loaded machine must not fail a property test on generation speed.
quick = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@quick
@given(config)
def test_a_config_never_differs_from_itself(cfg: dict) -> None:
    assert changed_keys(cfg, cfg) == []


@quick
@given(config, config)
def test_changes_are_exactly_the_differing_in_scope_keys(old: dict, new: dict) -> None:
    changes = changed_keys(old, new)
    a, b = flatten(old), flatten(new)
    for key, va, vb in changes:
        assert key.split(".")[0] in ("model", "data", "train")  # cluster only for num_workers; fewshot never
        assert va == a.get(key, ABSENT) and vb == b.get(key, ABSENT) and va != vb
    # Symmetric: the same keys with the values swapped.
    assert changed_keys(new, old) == [(k, vb, va) for k, va, vb in changes]
    # Nothing in scope that differs is missed.
    missed = {k for k in set(a) | set(b) if a.get(k, ABSENT) != b.get(k, ABSENT) and k.split(".")[0] in
              ("model", "data", "train") and not any(k == p or k.startswith(p + ".") for p in RESUME_MAY_CHANGE)}
    assert missed == {k for k, _, _ in changes}


@quick
@given(config, st.sampled_from(["train.global_batch", "train.micro_batch", "train.epochs", "train.max_steps",
                                "train.base_lr", "train.warmup_steps", "train.lr_decay", "train.end_lr",
                                "data.url", "data.split", "data.seed", "data.shuffle_buffer", "model.name",
                                "model.depth", "cluster.num_workers"]), leaf)
def test_every_key_that_fixes_the_run_is_refused(cfg: dict, key: str, value: object) -> None:
    section, field = key.split(".")
    old = {**cfg, section: {**cfg[section], field: "before"}}
    new = {**cfg, section: {**cfg[section], field: value if value != "before" else "after"}}
    assert [c[0] for c in changed_keys(old, new)] == [key]


@quick
@given(config, st.sampled_from(["train.log_every", "train.metrics_port", "train.checkpoint_every",
                                "train.keep_checkpoints", "data.num_workers", "data.error_budget",
                                "cluster.max_failures", "cluster.cpus_per_worker", "fewshot.shots"]), leaf)
def test_keys_that_may_change_are_not_refused(cfg: dict, key: str, value: object) -> None:
    section, field = key.split(".")
    new = {**cfg, section: {**cfg[section], field: value}}
    assert changed_keys(cfg, new) == []


def test_fault_drills_may_change_and_finetuning_has_its_own_scope() -> None:
    old = {"train": {"fault": {"kill_rank": 0, "kill_at_step": 3}}, "finetune": {"train": {"base_lr": 0.01}}}
    new = {"train": {"fault": {"kill_rank": None, "kill_at_step": None}}, "finetune": {"train": {"base_lr": 0.03}}}
    assert changed_keys(old, new) == []
    assert changed_keys(old, new, FINETUNE_SCOPE) == [("finetune.train.base_lr", 0.01, 0.03)]


def test_keys_the_objective_never_reads_may_change_and_no_others() -> None:
    mpp = {"train": {"objective": "masked_patch", "loss": "softmax", "label_smoothing": 0.0,
                     "masked_patch": {"mask": 0.8}}}
    assert changed_keys(mpp, {"train": {**mpp["train"], "loss": "sigmoid", "label_smoothing": 0.1}}) == []
    assert changed_keys(mpp, {"train": {**mpp["train"], "masked_patch": {"mask": 0.7}}}) == [
        ("train.masked_patch.mask", 0.8, 0.7)]
    supervised = {"train": {"loss": "softmax", "masked_patch": {"mask": 0.8}}}  # the default objective
    assert changed_keys(supervised, {"train": {**supervised["train"], "masked_patch": {"mask": 0.5}}}) == []
    assert changed_keys(supervised, {"train": {**supervised["train"], "loss": "sigmoid"}}) == [
        ("train.loss", "softmax", "sigmoid")]
    # Another objective is refused, and with it every key that one of the two reads.
    switched = {"train": {**mpp["train"], "objective": "supervised", "loss": "sigmoid"}}
    assert [key for key, _, _ in changed_keys(mpp, switched)] == ["train.loss", "train.objective"]


def test_the_allow_list_comes_from_the_fields_and_covers_finetuning_alike() -> None:
    # Marked where declared (config/fields.py RESUME_FREE), read the same under train: and finetune.train:.
    for key in ("train.log_every", "train.checkpoint_every", "train.fault", "data.num_workers", "data.error_budget"):
        assert key in RESUME_MAY_CHANGE and f"finetune.{key}" in RESUME_MAY_CHANGE
    for key in ("train.base_lr", "train.global_batch", "data.seed", "data.shuffle_buffer", "data.url"):
        assert key not in RESUME_MAY_CHANGE and f"finetune.{key}" not in RESUME_MAY_CHANGE
    assert len(set(RESUME_MAY_CHANGE)) == len(RESUME_MAY_CHANGE)  # each key once
    old = {"finetune": {"train": {"log_every": 5, "max_steps": 10}, "data": {"error_budget": 0.0}}}
    new = {"finetune": {"train": {"log_every": 50, "max_steps": 20}, "data": {"error_budget": 0.1}}}
    assert changed_keys(old, new, FINETUNE_SCOPE) == [("finetune.train.max_steps", 10, 20)]


def test_refusal_names_every_key_and_both_values() -> None:
    old = yaml.safe_dump({"train": {"global_batch": 16, "base_lr": 0.001}, "data": {"seed": 0}})
    new = yaml.safe_dump({"train": {"global_batch": 32, "base_lr": 0.001}, "data": {"seed": 7}})
    with pytest.raises(ConfigError) as info:
        refuse_changed_run(old, new, PRETRAIN_SCOPE, "checkpoint X", 2, 4)
    text = str(info.value)
    for part in ("data.seed 0 -> 7", "train.global_batch 16 -> 32", "world size 2 -> 4", "checkpoint X"):
        assert part in text
    refuse_changed_run(old, old, PRETRAIN_SCOPE, "checkpoint X", 2, 2)  # the same run resumes


# -- on the driver: `vitscale run` refuses before Ray starts ------------------------------------------------


@pytest.fixture(scope="module")
def dataset(small_synthetic: str) -> str:
    return small_synthetic


def _pipeline(dataset: str, storage: Path, **train: object) -> dict:
    return {"name": "resumed", "stages": ["pretrain"], "data": {"url": dataset},
            "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "heads": 2, "mlp_dim": 32},
            "train": {"global_batch": 8, "micro_batch": 4, "max_steps": 2, **train},
            "cluster": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1, "storage_path": str(storage)}}


def _fake_checkpoint(directory: Path, config_yaml: str, world_size: int = 2) -> None:
    """A checkpoint's vitscale files (no DeepSpeed state: the driver reads only config and manifests)."""
    from vitscale.train.checkpoint import TrainState, write_rank_part

    directory.mkdir(parents=True)
    for rank in range(world_size):
        write_rank_part(directory, rank=rank, stream_state={"epoch": 0, "position": 8, "seed": 0},
                        train_state=TrainState(step=1, world_size=world_size), config_yaml=config_yaml)


def test_vitscale_run_refuses_a_changed_run_before_ray(tmp_path: Path, dataset: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    import ray

    from vitscale.cli import main
    from vitscale.config.loader import to_yaml
    from vitscale.stages import build_pipeline
    from vitscale.stages.run import preflight

    storage = tmp_path / "runs"
    original = preflight(build_pipeline(_pipeline(dataset, storage)))
    _fake_checkpoint(storage / "resumed" / "checkpoint_000000001", to_yaml(original))

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_pipeline(dataset, storage, global_batch=16, log_every=3)))
    code = main(["run", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "train.global_batch 8 -> 16" in err and "log_every" not in err and str(path) in err
    assert not ray.is_initialized()

    # Only keys that may change: the same run is accepted (preflight passes).
    preflight(build_pipeline(_pipeline(dataset, storage, log_every=3, checkpoint_every=5)))


# -- the dataset: the same data.url written again with other samples or labels ------------------------------


def _write(out: Path, count: int, classes: int = 3, seed: int = 0) -> str:
    import shutil

    from vitscale.data.tools.write import write_dataset

    shutil.rmtree(out, ignore_errors=True)
    write_dataset("synthetic", str(out), shard_size=20, max_side=32, progress=False, seed=seed,
                  source_options={"count": count, "classes": classes, "image_size": 32})
    return str(out)


def test_a_dataset_written_again_under_the_same_url_is_refused(tmp_path: Path) -> None:
    """Same settings, other data: 40 samples of seed 0 trained on, then the folder rewritten. Unrefused, the run
    went on from the checkpoint with another sample order (and, from the epoch count, another schedule)."""
    from vitscale.config.loader import to_yaml
    from vitscale.data.format import read_meta
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job
    from vitscale.stages.run import preflight
    from vitscale.train.resume import dataset_identity

    url, storage = _write(tmp_path / "data", 40), tmp_path / "runs"
    original = preflight(build_pipeline(_pipeline(url, storage)))
    trained_on = dataset_identity(read_meta(url), "train")
    _fake_checkpoint(storage / "resumed" / "checkpoint_000000001",
                     pretraining_job(original).checkpoint_yaml({"dataset": trained_on}))
    for count, classes, seed in [(40, 3, 1), (44, 3, 0), (40, 5, 0)]:
        _write(tmp_path / "data", count, classes, seed)
        with pytest.raises(ConfigError) as refused:
            preflight(build_pipeline(_pipeline(url, storage)))
        assert refused.value.key == "data.url" and "not the one it was trained on" in str(refused.value)
        assert "40 samples of 3 classes" in str(refused.value)
    # The dataset put back (the writer is deterministic) resumes; so does a checkpoint without the record.
    _write(tmp_path / "data", 40)
    preflight(build_pipeline(_pipeline(url, storage)))
    _write(tmp_path / "data", 44, seed=1)
    yaml_then = pretraining_job(original).checkpoint_yaml()
    assert "dataset" not in yaml.safe_load(yaml_then)["trained"]
    refuse_changed_run(yaml_then, to_yaml(original), PRETRAIN_SCOPE, "an older checkpoint",
                       trained_on={"dataset": dataset_identity(read_meta(url), "train")})


def test_the_dataset_record_ignores_the_index_and_names_the_fine_tuning_key(tmp_path: Path) -> None:
    from vitscale.data.format import read_meta
    from vitscale.train.resume import dataset_identity

    url = _write(tmp_path / "data", 40)
    before = dataset_identity(read_meta(url), "train")
    (Path(url) / "_index.parquet").unlink()  # the index is not what the record hashes (`shards reindex` keeps it)
    assert dataset_identity(read_meta(url), "train") == before
    other = {**before, "sha256": "0" * 64}
    old = yaml.safe_dump({"finetune": {"train": {"base_lr": 0.01}}, "trained": {"dataset": before}})
    with pytest.raises(ConfigError) as refused:
        refuse_changed_run(old, yaml.safe_dump({"finetune": {"train": {"base_lr": 0.01}}}), FINETUNE_SCOPE,
                           "checkpoint c", trained_on={"dataset": other})
    assert refused.value.key == "finetune.data.url" and "40 samples of 3 classes as before" in str(refused.value)


def test_a_checkpoint_written_before_a_key_existed_resumes_at_its_default() -> None:
    """A checkpoint's config.yaml lacks the keys vitscale gained since (`train.objective` and `train.masked_patch`
    came after resume's check): it was refused as `train.objective '<absent>' -> 'supervised'`, which no setting
    can restore. A missing key is today's default; another value is refused naming that default."""
    from vitscale.config.loader import to_yaml
    from vitscale.stages import build_pipeline

    raw = _pipeline("/data/d", Path("/runs"))
    new = yaml.safe_load(to_yaml(build_pipeline(raw)))
    old = {**new, "train": {k: v for k, v in new["train"].items() if k not in ("objective", "masked_patch")},
           "finetune": {k: v for k, v in new["finetune"].items() if k != "eval_batch"}}
    refuse_changed_run(yaml.safe_dump(old), yaml.safe_dump(new), PRETRAIN_SCOPE, "an older checkpoint")
    raw["train"]["objective"] = "masked_patch"
    with pytest.raises(ConfigError) as refused:
        refuse_changed_run(yaml.safe_dump(old), to_yaml(build_pipeline(raw)), PRETRAIN_SCOPE, "an older checkpoint")
    assert refused.value.key == "train.objective" and "'supervised' -> 'masked_patch'" in str(refused.value)


def test_a_range_of_one_size_is_that_fixed_size() -> None:
    """docs/elastic.md: `[W, W]` is a fixed `W`; the same run written either way was refused as
    `cluster.num_workers 2 -> [2, 2]`. A real range is still another setting."""
    fixed, same = yaml.safe_dump({"cluster": {"num_workers": 2}}), yaml.safe_dump({"cluster": {"num_workers": [2, 2]}})
    refuse_changed_run(fixed, same, PRETRAIN_SCOPE, "checkpoint X", 2, 2)
    refuse_changed_run(same, fixed, PRETRAIN_SCOPE, "checkpoint X", 2, 2)
    with pytest.raises(ConfigError, match=r"cluster.num_workers 2 -> \[1, 4\]"):
        refuse_changed_run(fixed, yaml.safe_dump({"cluster": {"num_workers": [1, 4]}}), PRETRAIN_SCOPE, "checkpoint X")


def test_an_elastic_range_may_become_another_range_but_not_a_fixed_size() -> None:
    """`[2, 4]` -> `[2, 8]` once the cluster grew (or `[1, 2]` once it shrank) resumes: an elastic run's step is
    the global batch's mean at any world size and its checkpoints are resharded. A range and a fixed size are
    still other settings either way, `[W, W]` being the fixed `W`."""
    def workers(value: object) -> str:
        return yaml.safe_dump({"cluster": {"num_workers": value}})

    for old, new in (([2, 4], [2, 8]), ([2, 4], [1, 2]), ([1, 3], [4, 6])):
        refuse_changed_run(workers(old), workers(new), PRETRAIN_SCOPE, "checkpoint X")
        refuse_changed_run(workers(old), workers(new), FINETUNE_SCOPE, "checkpoint X")
    for old, new in (([2, 4], 4), (4, [2, 4]), ([2, 4], [4, 4]), ([2, 2], [2, 4])):
        with pytest.raises(ConfigError, match=r"cluster.num_workers") as refused:
            refuse_changed_run(workers(old), workers(new), PRETRAIN_SCOPE, "checkpoint X")
        assert refused.value.key == "cluster.num_workers"


def test_a_model_is_compared_by_the_model_its_name_names() -> None:
    """`--set model.name=vit-ti/8` builds ViT-Ti/8, the model the checkpoint was trained as: it was refused as
    `model.name 'ViT-Ti/8' -> 'vit-ti/8'`. Another model is still refused."""
    old = yaml.safe_dump({"model": {"name": "ViT-B/16", "img_size": 224}})
    for same in ("vit-b/16", "VIT-B/16", "vit_base_patch16_224"):
        refuse_changed_run(old, yaml.safe_dump({"model": {"name": same, "img_size": 224}}), PRETRAIN_SCOPE, "c")
    with pytest.raises(ConfigError, match=r"model.name 'ViT-B/16' -> 'ViT-B/32'"):
        refuse_changed_run(old, yaml.safe_dump({"model": {"name": "vit-b/32", "img_size": 224}}), PRETRAIN_SCOPE, "c")


@pytest.mark.parametrize("scope, section", [(PRETRAIN_SCOPE, ("train",)), (FINETUNE_SCOPE, ("finetune", "train"))])
def test_deepspeed_tuning_may_change_but_not_what_a_step_computes(scope: tuple[str, ...], section: tuple[str, ...]) -> None:
    """`train.deepspeed` is free but for its keys that change the arithmetic or a checkpoint's layout."""
    def config(deepspeed: dict) -> dict:
        inner = {"deepspeed": deepspeed, "base_lr": 0.1}
        return {section[0]: {section[1]: inner}} if len(section) == 2 else {section[0]: inner}

    prefix = ".".join(section) + ".deepspeed"
    tuned = {"zero_optimization": {"reduce_bucket_size": 5e8, "overlap_comm": True}}
    retuned = {"zero_optimization": {"reduce_bucket_size": 2e8, "stage3_prefetch_bucket_size": 1e7}}
    assert changed_keys(config(tuned), config(retuned), scope) == []
    assert changed_keys(config({}), config({"flops_profiler": {"enabled": True}}), scope) == []
    grouped = {"zero_optimization": {"sub_group_size": 1e8, "reduce_bucket_size": 5e8}}
    regrouped = {"zero_optimization": {"sub_group_size": 1e9}}  # (its bucket size left out: free)
    assert changed_keys(config(grouped), config(regrouped), scope) == [
        (f"{prefix}.zero_optimization.sub_group_size", 1e8, 1e9)]
    assert changed_keys(config({}), config({"communication_data_type": "fp32"}), scope) == [
        (f"{prefix}.communication_data_type", ABSENT, "fp32")]
    assert changed_keys(config({"data_types": {"grad_accum_dtype": "fp32"}}),
                        config({"data_types": {"grad_accum_dtype": "bf16"}}), scope) == [
        (f"{prefix}.data_types.grad_accum_dtype", "fp32", "bf16")]
    with pytest.raises(ConfigError, match=r"communication_data_type 'bf16' -> 'fp32' \(the dtype gradients are averaged in\)"):
        refuse_changed_run(yaml.safe_dump(config({"communication_data_type": "bf16"})),
                           yaml.safe_dump(config({"communication_data_type": "fp32"})), scope, "checkpoint_2")
