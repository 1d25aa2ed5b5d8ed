"""scripts/ stays part of the codebase: every Python script imports (its module-level code runs, its main does not),
every shell script parses and every C tool compiles,
none edits sys.path or imports a sibling script (shared helpers live in the package), and every one is cited
where a reader would look for it (README.md, docs/RESULTS.md, workloads/README.md) and has its line in
scripts/README.md."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
CITED_IN = [ROOT / "README.md", ROOT / "docs" / "RESULTS.md", ROOT / "workloads" / "README.md"]
SYS_PATH_EDITS = {"insert", "append", "extend"}  # sys.path.NAME(...) calls that edit it


def test_there_are_scripts():
    assert len(SCRIPTS) > 10


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_a_shell_script_parses(path):
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").glob("*.c")), ids=lambda p: p.name)
def test_a_c_tool_compiles_with_the_flags_its_header_gives(path):
    flags = re.search(r"cc (-[^`]*?) scripts/", path.read_text())
    assert flags, f"{path.name}: its header should give the cc command that builds it"
    out = subprocess.run(["cc", "-fsyntax-only", *flags.group(1).split(), str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_script_imports_without_running():
    probe = ("import runpy, sys\n"
             "for path in sys.argv[1:]:\n"
             "    runpy.run_path(path, run_name='imported_by_tests')\n")
    out = subprocess.run([sys.executable, "-c", probe, *map(str, SCRIPTS)], cwd=ROOT / "scripts",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def edits_sys_path(node: ast.AST) -> bool:
    """sys.path.insert/append/extend(...), sys.path[...] = ..., sys.path = ..., sys.path += ..."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return is_sys_path(node.func.value) and node.func.attr in SYS_PATH_EDITS
    targets = (node.targets if isinstance(node, ast.Assign)
               else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    return any(is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets)


@pytest.mark.parametrize("code", ["sys.path.insert(0, 'x')", "sys.path.append('x')", "sys.path.extend(['x'])",
                                  "sys.path[0] = 'x'", "sys.path[:0] = ['x']", "sys.path = ['x']",
                                  "sys.path += ['x']"])
def test_the_sys_path_check_catches(code):
    assert any(edits_sys_path(n) for n in ast.walk(ast.parse(code)))


@pytest.mark.parametrize("code", ["print(sys.path)", "x = sys.path[0]", "os.path.join('a', 'b')",
                                  "paths = [p for p in sys.path]"])
def test_the_sys_path_check_lets_reads_through(code):
    assert not any(edits_sys_path(n) for n in ast.walk(ast.parse(code)))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_guards_its_work_and_imports_only_the_package(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    siblings = {p.stem for p in SCRIPTS}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] not in siblings, f"{path.name} imports scripts/{node.module}.py"
        assert not edits_sys_path(node), f"{path.name} edits sys.path: {ast.unparse(node)}"
    guarded = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    assert guarded, f"{path.name} runs at import; put its work under `if __name__ == \"__main__\":`"


def test_every_script_is_cited():
    text = "\n".join(p.read_text() for p in CITED_IN)
    tools = [p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh", ".c")]
    uncited = [p.name for p in tools if f"scripts/{p.name}" not in text]
    assert not uncited, f"cite these where their figures are, or remove them: {uncited}"


def test_scripts_readme_lists_every_file_and_no_other():
    """scripts/README.md has one `- `NAME`: ...` line per .py/.sh/.c file in scripts/, and names no missing file."""
    readme = (ROOT / "scripts" / "README.md").read_text()
    listed = re.findall(r"^- `([^`/]+)`", readme, flags=re.M)
    named = set(listed) | set(re.findall(r"\bscripts/([\w.-]+\.(?:py|sh|c))\b", readme))
    tools = {p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh", ".c")}
    assert len(listed) == len(set(listed)), "a file listed twice in scripts/README.md"
    assert not tools - set(listed), f"add a line to scripts/README.md for: {sorted(tools - set(listed))}"
    assert not named - tools, f"scripts/README.md names files that do not exist: {sorted(named - tools)}"
