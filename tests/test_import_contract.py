"""Layering: the core and the kernels never import the UI toolkit (Harlequin-style), and the judge never
imports agent code (what applies a candidate's diff lives in core, beside the judge)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path, full: bool = False) -> set[str]:
    """Top-level names of the modules `path` imports (dotted names with `full`), local imports included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name if full else a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module if full else node.module.split(".")[0])
    return names


def test_core_and_kernels_do_not_import_textual_or_app():
    offenders = []
    files = list((ROOT / "core").rglob("*.py")) + list((ROOT / "kernels").rglob("*.py"))
    assert len(files) > 10
    for path in files:
        bad = imported_modules(path) & {"textual", "textual_plotext", "app", "rich"}
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, offenders


def test_checker_detects_a_textual_import(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("from textual.app import App\nimport os\n")
    assert "textual" in imported_modules(sample)


def test_the_judge_imports_no_agent_code():
    judged = [ROOT / "core" / "judge.py", ROOT / "core" / "workers.py", ROOT / "core" / "forcing.py"]
    for path in judged:
        agents = {m for m in imported_modules(path, full=True) if m.startswith("core.agents")}
        assert not agents, f"{path.relative_to(ROOT)} imports {sorted(agents)}"
    assert "core.diffs" in imported_modules(judged[0], full=True)
