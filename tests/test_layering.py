"""The layers import one way (docs/design.md, module ownership): nothing under algos/ imports sharding.py or the
cost package (sharding.py and the cost model import algos; the layouts' positions live in algos/_layout.py), and
the cost package imports nothing above it (the integration, the trainer, inference, the benchmarks). Every
import statement counts, those inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megatron_cp_plugin"


def imports(path: Path, root: Path = PKG) -> set[str]:
    """Every megatron_cp_plugin module `path` (a file under `root`, the package's folder) imports: relative
    imports resolved, `from .. import x` giving both the package and package.x, at any depth of the file."""
    pkg = ("megatron_cp_plugin",) + path.relative_to(root).parts[:-1]     # the package the file is in
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[:len(pkg) - node.level + 1]) if node.level else ""
            mod = ".".join(x for x in (base, node.module) if x)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "megatron_cp_plugin" or m.startswith("megatron_cp_plugin.")}


def _within(mod: str, pkgs) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in pkgs)


def _offenders(folder: str, banned) -> list[tuple[str, str]]:
    pkgs = tuple(f"megatron_cp_plugin.{b}" for b in banned)
    files = sorted((PKG / folder).rglob("*.py"))
    assert files, folder
    return [(str(f.relative_to(PKG)), m) for f in files for m in sorted(imports(f)) if _within(m, pkgs)]


def test_the_import_resolver_sees_every_form(tmp_path):
    algos = tmp_path / "algos"
    algos.mkdir()
    (algos / "x.py").write_text("from ..sharding import a\nfrom .. import cost\ndef f():\n"
                                "    import megatron_cp_plugin.cost_model\n    from ..cost.model import p\n")
    (algos / "__init__.py").write_text("from ..sharding import b\nfrom . import registry\n")
    assert imports(algos / "x.py", tmp_path) == {"megatron_cp_plugin.sharding", "megatron_cp_plugin.sharding.a",
                                       "megatron_cp_plugin", "megatron_cp_plugin.cost",
                                       "megatron_cp_plugin.cost_model", "megatron_cp_plugin.cost.model",
                                       "megatron_cp_plugin.cost.model.p"}
    assert imports(algos / "__init__.py", tmp_path) == {"megatron_cp_plugin.sharding", "megatron_cp_plugin.sharding.b",
                                              "megatron_cp_plugin.algos", "megatron_cp_plugin.algos.registry"}


def test_algos_import_neither_sharding_nor_the_cost_model():
    assert _offenders("algos", ("sharding", "cost", "cost_model")) == []


def test_the_cost_package_imports_nothing_above_it():
    assert _offenders("cost", ("bench", "training", "megatron", "megatron_lm", "inference")) == []


def test_comm_and_the_grid_sit_below_the_algorithms():
    """comm.py and cp_grid.py import nothing above them, and cp_grid.py reaches torch.distributed only as `comm.dist`
    (the rank benchmark's replay swaps that one name: bench/_replay_comm.py)."""
    above = tuple(f"megatron_cp_plugin.{b}" for b in ("algos", "sharding", "cost", "cost_model", "bench", "training",
                                                      "megatron", "megatron_lm", "inference"))
    for name in ("comm.py", "cp_grid.py"):
        assert [m for m in imports(PKG / name) if _within(m, above)] == [], name
    nodes = list(ast.walk(ast.parse((PKG / "cp_grid.py").read_text())))
    mods = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    mods += [n.module or "" for n in nodes if isinstance(n, ast.ImportFrom)]
    assert [m for m in mods if m.startswith("torch")] == []
