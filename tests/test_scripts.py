"""scripts/ stays part of the codebase: every script imports (its module-level code runs, its main does not),
none edits sys.path or imports a sibling script (shared helpers live in the package), and every one is cited
where a reader would look for it (README.md, docs/RESULTS.md, workloads/README.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
CITED_IN = [ROOT / "README.md", ROOT / "docs" / "RESULTS.md", ROOT / "workloads" / "README.md"]


def test_there_are_scripts():
    assert len(SCRIPTS) > 10


def test_every_script_imports_without_running():
    probe = ("import runpy, sys\n"
             "for path in sys.argv[1:]:\n"
             "    runpy.run_path(path, run_name='imported_by_tests')\n")
    out = subprocess.run([sys.executable, "-c", probe, *map(str, SCRIPTS)], cwd=ROOT / "scripts",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_guards_its_work_and_imports_only_the_package(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    siblings = {p.stem for p in SCRIPTS}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] not in siblings, f"{path.name} imports scripts/{node.module}.py"
        if isinstance(node, ast.Attribute) and node.attr == "insert" and isinstance(node.value, ast.Attribute):
            assert node.value.attr != "path", f"{path.name} edits sys.path"
    guarded = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    assert guarded, f"{path.name} runs at import; put its work under `if __name__ == \"__main__\":`"


def test_every_script_is_cited():
    text = "\n".join(p.read_text() for p in CITED_IN)
    tools = [p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh", ".c")]
    uncited = [p.name for p in tools if f"scripts/{p.name}" not in text]
    assert not uncited, f"cite these where their figures are, or remove them: {uncited}"
