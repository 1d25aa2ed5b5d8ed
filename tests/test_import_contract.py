"""Layering: the core and the kernels never import the UI toolkit (Harlequin-style), the judge never
imports agent code (what applies a candidate's diff lives in core, beside the judge), and everything is
installed under the one `specpilot` namespace (no generic top-level core/app/kernels/themes module)."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.core.engine.plugins import PluginError, load_workspace

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
        full = imported_modules(path, full=True)
        bad = {m.split(".")[0] for m in full} & {"textual", "textual_plotext", "rich"}
        bad |= {m for m in full if m == "specpilot.app" or m.startswith("specpilot.app.")}
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
        agents = {m for m in imported_modules(path, full=True) if m.startswith("specpilot.core.agents")}
        assert not agents, f"{path.relative_to(ROOT)} imports {sorted(agents)}"
    assert "specpilot.core.diffs" in imported_modules(judged[0], full=True)


def _core_import_graph() -> dict[str, set[str]]:
    """Each core module's explicit imports of other core modules (local imports included; the implicit import
    of a submodule's parent package is not an edge)."""
    modules = {}
    for path in (ROOT / "core").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(["specpilot", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(owner(f"{node.module}.{a.name}") for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(owner(a.name) for a in node.names)
        graph[name] = targets - {None, name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in `graph`, as the path that closes it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_core_has_no_import_circle():
    graph = _core_import_graph()
    assert "specpilot.core.recipe_source" in graph["specpilot.core.cli"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_circle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_file_imports_the_old_top_level_names():
    """From the repo root `import core` still resolves to ./core, a second copy of every module: one missed
    rename would pass here and break in an installed package."""
    files = [p for d in ("core", "app", "kernels", "themes", "tests", "scripts") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 100
    offenders = [f"{p.relative_to(ROOT)}: {sorted(bad)}" for p in files
                 if (bad := imported_modules(p) & {"core", "app", "kernels", "themes"})]
    assert not offenders, offenders


def test_the_installed_package_adds_no_generic_top_level_module(tmp_path):
    """No core/app/kernels/themes module of ours outside the `specpilot` namespace (another distribution's, as
    Hugging Face's `kernels`, may exist)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = ("import importlib.util as u, os, specpilot.core, specpilot.app.app, specpilot.kernels.cpu.gguf_blocks;"
             "root = os.path.dirname(os.path.dirname(specpilot.core.__file__));"
             "print([n for n in ('core', 'app', 'kernels', 'themes') if (s := u.find_spec(n)) is not None"
             " and os.path.dirname(s.origin or '') == os.path.join(root, n)])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _workspace(tmp_path: Path, source: str) -> Path:
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "lengthy.py").write_text(source)
    return tmp_path


PLUGIN = """{imp}

def keep(depth, recent):
    return depth

register("draft_length", "ns_probe_{tag}", keep)
"""


def test_a_plugin_importing_the_old_names_gets_a_clear_error(tmp_path):
    ws = _workspace(tmp_path, PLUGIN.format(imp="from core.mechanisms import register", tag="old"))
    with pytest.raises(PluginError, match=r"lengthy.py imports core.mechanisms; .*specpilot.core.mechanisms"):
        load_workspace(ws)


def test_a_plugin_importing_the_namespace_loads(tmp_path):
    from specpilot.core.mechanisms import lookup

    ws = _workspace(tmp_path, PLUGIN.format(imp="from specpilot.core.mechanisms import register", tag="new"))
    assert load_workspace(ws) == ["lengthy"]
    assert lookup("draft_length", "plugin:ns_probe_new")(4, []) == 4


def test_the_checkouts_kernels_folder_never_stands_in_for_hugging_faces(tmp_path):
    """Run from the repository root with nothing keeping the root off sys.path (no PYTHONSAFEPATH), `import
    kernels` gives Hugging Face's `kernels` package where it is installed (transformers >= 5.25 imports it), our
    folder still imports as specpilot.kernels beside it, and where no such package is installed `import kernels`
    gives an empty namespace package (no file, no names, no submodules), which transformers' availability check
    imports and reads as not installed: the folder is never a top-level module."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHOSE = 'hugging face'\n")
    (site / "kernels" / "layer.py").write_text("NAME = 'a submodule'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    probe = ("import kernels, kernels.layer, specpilot.core, specpilot.kernels as ours;"
             "print(kernels.WHOSE, kernels.layer.NAME, hasattr(ours, 'cache_dir'), kernels.__file__)")
    got = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**env, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[:5] == ["hugging", "face", "a", "submodule", "True"]
    assert got.stdout.split()[-1] == str(site / "kernels" / "__init__.py")
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if importlib.util.find_spec("kernels") is None:  # no Hugging Face kernels in this environment
        probe = ("import kernels, specpilot.kernels as ours; from transformers.utils import is_kernels_available;"
                 "from transformers import LlamaConfig;"
                 "print(getattr(kernels, '__file__', None), hasattr(kernels, 'cache_dir'), is_kernels_available())")
        none = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=bare, capture_output=True, text=True,
                              timeout=120)
        assert none.returncode == 0, none.stderr[-2000:]
        assert none.stdout.split() == ["None", "False", "False"]
        sub = subprocess.run([sys.executable, "-c", "import kernels.cpu"], cwd=ROOT, env=bare, capture_output=True,
                             text=True, timeout=120)
        assert sub.returncode != 0 and "No module named 'kernels.cpu'" in sub.stderr.strip().splitlines()[-1]
