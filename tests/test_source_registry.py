"""The source registry: one module and one registry line per source kind, no import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from vitscale.data.tools.source_base import SourceKind
from vitscale.data.tools.sources import (
    REGISTRY,
    RENAMED,
    get_source_kind,
    open_source,
    source_specs,
)

TOOLS = Path(__file__).resolve().parents[1] / "vitscale" / "data" / "tools"


def _tools_imports(path: Path) -> set[str]:
    """The data/tools modules a file imports, lazy imports inside functions included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        out |= {n.rsplit(".", 1)[-1] for n in names if n.startswith("vitscale.data.tools.")}
    return out


def test_data_tools_import_graph_has_no_cycle() -> None:
    graph = {p.stem: _tools_imports(p) for p in TOOLS.glob("*.py") if p.stem != "__init__"}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_each_source_is_one_module_that_imports_no_other_source() -> None:
    modules = {name: mod.rsplit(".", 1)[-1] for name, mod in REGISTRY.items()}
    assert len(set(modules.values())) == len(modules), "two sources share a module"
    for name, module in modules.items():
        imported = _tools_imports(TOOLS / f"{module}.py")
        assert "sources" not in imported, f"{module}.py imports the registry (a cycle)"
        others = imported & (set(modules.values()) - {module})
        assert not others, f"source {name!r} ({module}.py) imports other sources {sorted(others)}"
        kind = get_source_kind(name)
        assert isinstance(kind, SourceKind) and kind.name == name


def test_a_source_module_imports_alone() -> None:
    # A fresh interpreter importing one source module first: no partly-initialised module on the way.
    code = "; ".join(f"import {m}" for m in REGISTRY.values())
    for module in REGISTRY.values():
        done = subprocess.run([sys.executable, "-c", f"import {module}; {code}"], capture_output=True, text=True,
                              check=False)
        assert done.returncode == 0, done.stderr


def test_one_name_per_dataset_and_old_names_say_the_new_one() -> None:
    assert "flowers" in REGISTRY and not set(RENAMED) & set(REGISTRY)
    assert all(new in REGISTRY for new in RENAMED.values())
    for old, new in RENAMED.items():
        with pytest.raises(ValueError, match=f"'{old}' is now named '{new}'"):
            open_source(f"{old}:/tmp")
    assert source_specs()[:5] == ["folder:PATH", "list:FILE", "digits", "synthetic", "fractal"]


def test_unknown_source_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match="did you mean 'fractal'") as exc:
        open_source("fractl")
    assert "flowers:DIR" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="takes no path"):
        open_source("digits:/x")


def test_a_new_source_is_one_module_and_one_registry_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitscale.config.checks import ConfigError
    from vitscale.data.config import SourceConfig
    from vitscale.data.tools import sources
    from vitscale.data.tools.verify import verify_dataset
    from vitscale.data.tools.write import write_dataset

    (tmp_path / "stripes_source.py").write_text('''
import numpy as np
from PIL import Image
from vitscale.data.tools.source_base import Sample, Source, SourceKind

class Stripes(Source):
    def __init__(self, *, count: int = 6) -> None:
        self.name, self.classes, self.multi_label, self.samples = "stripes", ("h", "v"), False, count
    def __len__(self) -> int:
        return self.samples
    def __getitem__(self, i: int) -> Sample:
        i = self._check_index(i)
        img = np.zeros((16, 16, 3), np.uint8)
        img[::2] = 255
        return Sample(f"s{i}", Image.fromarray(img if i % 2 else img.transpose(1, 0, 2)), (i % 2,))

SOURCE = SourceKind("stripes", Stripes, "stripes, across or down", options=("count",))
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sources.REGISTRY, "stripes", "stripes_source")  # the one line
    assert "stripes" in sources.source_specs()
    SourceConfig(kind="stripes").validate("data.create_if_missing")
    with pytest.raises(ConfigError, match="data.create_if_missing.kind: source 'stripes' takes no path"):
        SourceConfig(kind="stripes:/x").validate("data.create_if_missing")
    write_dataset("stripes", str(tmp_path / "out"), source_options={"count": 8}, shard_size=3, progress=False)
    assert verify_dataset(str(tmp_path / "out")) == []
