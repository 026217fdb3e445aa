"""The shape of the package: imports point one way, Ray and DeepSpeed stay at their edges.

Layers, lowest first (docs/architecture.md):
  config  <-  models, data, scaling.flops  <-  train, eval, inspect, scaling.study  <-  launch, stages  <-  cli
A module may import its own layer and the layers below it, never one above. The study is one package
(`scaling/study/`) whose Ray-free parts sit with `eval` and whose stage modules (`stage`, `cell_pipelines`,
`runner`) sit with `stages`: a module's layer is that of its longest matching prefix in LAYERS.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vitscale"

LAYERS = {
    "config": 0, "_version": 0, "say": 0,
    "models": 1, "data": 1, "scaling": 1, "scaling.flops": 1, "scaling.catalog": 1,
    "train": 2, "eval": 2, "inspect": 2, "scaling.study": 2,
    "launch": 3, "stages": 3,
    "scaling.study.stage": 3, "scaling.study.cell_pipelines": 3, "scaling.study.runner": 3,
    "cli": 4, "__main__": 4,
}


def layer_of(module: str) -> int:
    """The layer of a dotted module name inside vitscale (longest matching prefix)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"vitscale.{module} belongs to no layer; add it to LAYERS and docs/architecture.md")


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if parts:
            out.append((".".join(parts), path))
    return out


def imports_of(path: Path) -> list[str]:
    """Every module imported anywhere in the file (lazy imports inside functions count too)."""
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("module, path", modules(), ids=[m for m, _ in modules()])
def test_imports_point_down(module: str, path: Path) -> None:
    mine = layer_of(module)
    upward = [name for name in imports_of(path) if name.startswith("vitscale.")
              and layer_of(name.removeprefix("vitscale.")) > mine]
    assert not upward, f"vitscale.{module} (layer {mine}) imports from a layer above: {upward}"


EDGE = LAYERS["stages"]
"""Ray's layer: `launch/`, `stages/` and the study's stage modules; nothing below it and not the CLI."""


def test_ray_only_at_the_edge() -> None:
    offenders = [m for m, path in modules()
                 if any(n == "ray" or n.startswith("ray.") for n in imports_of(path))
                 and layer_of(m) != EDGE]
    assert not offenders, f"modules outside the launch/stages layer that import Ray: {offenders}"


def test_the_study_stage_is_registered_from_its_package() -> None:
    """The study lives in one package; the stage registry still finds it by name."""
    from vitscale.stages import REGISTRY, get_stage

    assert REGISTRY["study"] == "vitscale.scaling.study.stage"
    assert get_stage("study").name == "study"
    assert not list((PACKAGE / "stages").glob("study*.py"))


def test_deepspeed_only_in_the_engine() -> None:
    offenders = [m for m, path in modules()
                 if any(n == "deepspeed" or n.startswith("deepspeed.") for n in imports_of(path))]
    assert offenders == ["train.engine"]


def test_vitscale_lines_are_said_in_one_place() -> None:
    """The "[vitscale]" prefix is written once (`vitscale/say.py`); every line goes through `say` or `line`."""
    typed = [m for m, path in modules() if m != "say" and any(
        isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("[vitscale]")
        for node in ast.walk(ast.parse(path.read_text())))]
    assert not typed, f"modules that type the prefix by hand: {typed}"


def test_models_import_nothing_distributed() -> None:
    for module, path in modules():
        if module.startswith("models"):
            bad = [n for n in imports_of(path) if n.split(".")[0] in ("ray", "deepspeed", "torch.distributed")
                   or n.startswith("torch.distributed")]
            assert not bad, (module, bad)


def test_no_second_list_of_model_options() -> None:
    """The model's options are named in models/options.py; no other layer lists them."""
    for module, path in modules():
        if module.startswith("models"):
            continue
        text = path.read_text()
        for option in ("pos_emb_placement", "attention_dropout", "activation_checkpointing"):
            assert option not in text, f"vitscale.{module} names the model option {option!r}"


TRAIN_FUNCTION_LINES = 80


def test_every_function_under_train_is_short() -> None:
    """The worker loop is components (set-up, step, observers, stop vote, checkpointer, evaluation): the next
    feature lands in one of them or a new one, not as another stretch of a long function."""
    long = []
    for module, path in modules():
        if not module.startswith("train"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > TRAIN_FUNCTION_LINES:
                    long.append(f"vitscale.{module}.{node.name}: {length} lines")
    assert not long, f"functions under train/ over {TRAIN_FUNCTION_LINES} lines: {long}"


def test_the_training_loop_reads_at_a_glance() -> None:
    """nanoGPT's loop is about 60 lines; vitscale's `train` stays in that range."""
    tree = ast.parse((PACKAGE / "train" / "loop.py").read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert (loop.end_lineno or loop.lineno) - loop.lineno + 1 <= 60


def _runtime_imports(path: Path) -> set[str]:
    """vitscale modules `path` imports when it runs (lazy imports included; `if TYPE_CHECKING:` left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n.removeprefix("vitscale.") for n in names if n.startswith("vitscale.")}


def test_no_two_modules_import_each_other() -> None:
    """A circle held together by a lazy import is a design left half-done: what both need lives in a third."""
    known = dict(modules())
    imports = {m: _runtime_imports(p) for m, p in known.items()}
    circles = sorted({tuple(sorted((a, b))) for a, deps in imports.items() for b in deps
                      if b != a and b in imports and a in imports[b]})
    assert not circles, circles


def test_every_module_is_in_the_architecture_docs() -> None:
    """docs/architecture.md's "Every module" table lists each module of the package: a newcomer finds all."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", text.split("## Every module", 1)[1], re.M))
    missing = [path.relative_to(PACKAGE).as_posix() for _, path in modules()
               if path.relative_to(PACKAGE).as_posix() not in listed]
    assert not missing, f"add these to docs/architecture.md's module table: {missing}"


TESTS = Path(__file__).resolve().parent


def test_every_module_is_in_the_map_of_the_tests() -> None:
    """tests/README.md maps each module of the package to its tests, and names only files that exist: a
    newcomer finds the tests of a module, and every test file and helper, from one page."""
    text = (TESTS / "README.md").read_text()
    section = text.split("## Module to tests", 1)[1].split("\n## ", 1)[0]
    mapped = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, re.M))
    missing = [path.relative_to(PACKAGE).as_posix() for _, path in modules()
               if path.relative_to(PACKAGE).as_posix() not in mapped]
    assert not missing, f"add these to tests/README.md's module map: {missing}"
    stale = sorted(m for m in mapped if not (PACKAGE / m).is_file())
    assert not stale, f"tests/README.md maps modules that do not exist: {stale}"
    named = set(re.findall(r"\b(test_\w+\.py)\b", text))
    gone = sorted(n for n in named if not (TESTS / n).is_file())
    assert not gone, f"tests/README.md names test files that do not exist: {gone}"
    unnamed = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in named)
    assert not unnamed, f"test files tests/README.md does not name: {unnamed}"
    helpers = set(re.findall(r"`helpers/([\w/.-]+)`", text))
    gone = sorted(h for h in helpers if not (TESTS / "helpers" / h).exists())
    assert not gone, f"tests/README.md names helpers that do not exist: {gone}"
    unlisted = sorted(p.name for p in (TESTS / "helpers").glob("*.py") if p.name != "__init__.py" and p.name not in helpers)
    assert not unlisted, f"helpers tests/README.md does not list: {unlisted}"
