"""The stage registry: a stage is one module plus one registry line; needs and checks are enforced."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from vitscale import stages
from vitscale.config import ConfigError, to_dict
from vitscale.stages import build_pipeline, config_sections, get_stage
from vitscale.stages.base import Pretrained, StageContext

TOY = '''
"""A toy stage, written as docs/architecture.md says: its config, its checks, its run."""
from dataclasses import dataclass

from vitscale.config.checks import check, positive
from vitscale.stages.base import Pretrained, Stage


@dataclass(frozen=True)
class ToyConfig:
    greeting: str = "hello"
    """What to say."""
    times: int = 1
    """How often."""

    def validate(self) -> None:
        positive(self.times, "toy.times")


@dataclass(frozen=True)
class Toy:
    text: str

    def summary(self):
        return {"text": self.text}

    def rows(self):
        return [("said", self.text)]


def check_toy(config):
    check(config.toy.times <= config.cluster.num_workers, "toy.times", "at most one per worker")


def run_toy(config, context):
    step = context.need(Pretrained).metrics["step"]
    return Toy(" ".join([config.toy.greeting] * config.toy.times) + f" after step {step}")


STAGE = Stage(name="toy", sections={"toy": ToyConfig}, check=check_toy, run=run_toy,
              needs=(Pretrained,), produces=Toy)
'''


@pytest.fixture
def toy_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "toy_stage.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(stages.REGISTRY, "toy", "toy_stage")  # the one registry line
    yield
    sys.modules.pop("toy_stage", None)


def test_a_new_stage_is_one_module_and_one_registry_line(toy_registered: None) -> None:
    config = build_pipeline({"stages": ["pretrain", "toy"], "toy": {"greeting": "hi", "times": 2},
                             "cluster": {"num_workers": 2}, "train": {"global_batch": 128}})
    assert config.toy.greeting == "hi" and "toy" in config_sections()
    assert to_dict(config)["toy"] == {"greeting": "hi", "times": 2}
    context = StageContext(run_dir=Path("."), run_name="x", results=[Pretrained(checkpoint=None, metrics={"step": 7})])
    result = get_stage("toy").run(config, context)
    assert result.summary() == {"text": "hi hi after step 7"}


def test_a_new_stages_checks_run_at_load(toy_registered: None) -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline({"stages": ["pretrain", "toy"], "toy": {"times": 0}, "train": {"global_batch": 4096}})
    assert err.value.key == "toy.times"  # its section's validate()
    with pytest.raises(ConfigError, match="at most one per worker") as err:
        build_pipeline({"stages": ["pretrain", "toy"], "toy": {"times": 9}, "cluster": {"num_workers": 2},
                        "train": {"global_batch": 128}})
    assert err.value.key == "toy.times"  # its cross-section check


def test_a_stage_that_needs_a_result_comes_after_its_maker(toy_registered: None) -> None:
    with pytest.raises(ConfigError, match="toy needs a Pretrained .* put pretrain before it"):
        build_pipeline({"stages": ["toy", "pretrain"]})
    with pytest.raises(ConfigError, match="fewshot needs a Pretrained"):
        build_pipeline({"stages": ["fewshot"], "fewshot": {"datasets": ["x"], "resolution": 224}})


def test_unregistered_stages_and_their_sections_cannot_be_written() -> None:
    # inspect is a verb, not a stage: neither a stage nor a section of that name is accepted.
    for raw, key in (({"stages": ["pretrain", "inspect"]}, "stages"), ({"inspect": {"images": "x"}}, "inspect")):
        with pytest.raises(ConfigError) as err:
            build_pipeline(raw)
        assert err.value.key == key


def test_every_registered_stage_is_a_stage_with_its_own_name() -> None:
    for name in stages.REGISTRY:
        stage = get_stage(name)
        assert stage.name == name and callable(stage.run)
        for section in stage.sections.values():
            assert hasattr(section, "validate")


def test_model_section_is_the_models_keyword_arguments() -> None:
    config = build_pipeline({"model": {"name": "ViT-Ti/8", "img_size": 32, "depth": 2, "pos_emb": "learn_2d"}})
    assert config.model.options == {"depth": 2, "pos_emb": "learn_2d"}
    assert to_dict(config)["model"] == {"name": "ViT-Ti/8", "img_size": 32, "depth": 2, "pos_emb": "learn_2d"}
    model = config.model.build(num_classes=3)
    assert len(model.blocks) == 2 and model.cfg.pos_emb == "learn_2d"
    for raw, key in (({"bogus_option": 1}, "model.bogus_option"), ({"name": "ViT-Q/16"}, "model.name"),
                     ({"heads": 0}, "model.heads"), ({"img_size": 100}, "model.img_size"),
                     ({"name": "R50x1", "classifier": "gap"}, "model.classifier")):
        with pytest.raises(ConfigError) as err:
            build_pipeline({"model": raw})
        assert err.value.key == key, raw


def test_fewshot_resolution_must_match_a_vits_input() -> None:
    with pytest.raises(ConfigError) as err:
        build_pipeline({"stages": ["pretrain", "fewshot"], "fewshot": {"datasets": ["d"], "resolution": 32}})
    assert err.value.key == "fewshot.resolution"
    build_pipeline({"stages": ["pretrain", "fewshot"], "model": {"name": "R50x1", "img_size": 224},
                    "fewshot": {"datasets": ["d"], "resolution": 160}})  # a ResNet takes any size


def test_the_summary_says_how_many_restarts_were_resumes_by_the_user() -> None:
    base = {"step": 60, "epoch": 2.0, "loss": 0.5, "examples_seen": 480, "cumulative_exaflops": 1e-9, "world_size": 2}
    rows = dict(Pretrained(checkpoint=None, metrics={**base, "restarts": 3, "relaunches": 2,
                                                      "restart_lost_s": 41.5}).rows())
    assert rows["restarts"] == "3 (2 by running the command again; 41.5 s without a step; last at 2 workers)"
    rows = dict(Pretrained(checkpoint=None, metrics={**base, "restarts": 1, "relaunches": 0,
                                                      "restart_lost_s": 9.0}).rows())
    assert rows["restarts"] == "1 (9 s without a step; last at 2 workers)"
    assert "restarts" not in dict(Pretrained(checkpoint=None, metrics={**base, "restarts": 0}).rows())
