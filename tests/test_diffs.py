"""Strict diff application: exact-once matching, useful errors, allow-list, nothing skipped."""

from __future__ import annotations

import pytest

from specpilot.core.diffs import (
    AllowList, DiffError, FileEdit, apply_edits, apply_search_replace, apply_unified_diff, make_unified_diff,
    parse_agent_output,
)
from specpilot.core.recipe import builtin

ORIGINAL = "alpha\nbeta\ngamma\ndelta\nepsilon\n"
ALLOW = AllowList(("recipe.toml", "plugins/*.py"))


def sr(search: str, replace: str) -> str:
    return f"<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n"


# --- unified diffs ----------------------------------------------------------------------------


def test_unified_diff_applies_by_content_not_line_numbers() -> None:
    diff = "--- a/f\n+++ b/f\n@@ -40,3 +40,3 @@\n beta\n-gamma\n+GAMMA\n delta\n"
    assert apply_unified_diff(ORIGINAL, diff, "f") == "alpha\nbeta\nGAMMA\ndelta\nepsilon\n"


def test_unified_diff_several_hunks_and_insertion() -> None:
    diff = "@@ -1,2 +1,3 @@\n alpha\n+inserted\n beta\n@@ -4,2 +5,1 @@\n delta\n-epsilon\n"
    assert apply_unified_diff(ORIGINAL, diff, "f") == "alpha\ninserted\nbeta\ngamma\ndelta\n"


def test_unified_diff_not_found_names_hunk() -> None:
    diff = "@@ -1,2 +1,2 @@\n alpha\n-beta\n+BETA\n@@ -3,1 +3,1 @@\n-zeta\n+ZETA\n"
    with pytest.raises(DiffError) as err:
        apply_unified_diff(ORIGINAL, diff, "f")
    assert str(err.value) == "f: hunk 2: context and removed lines not found (first line: 'zeta')"


def test_unified_diff_ambiguous_match_is_an_error() -> None:
    text = "x = 1\ny = 2\nx = 1\ny = 2\n"
    with pytest.raises(DiffError) as err:
        apply_unified_diff(text, "@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n", "f")
    assert "hunk 1: context and removed lines found 2 times (lines 1, 3)" in str(err.value)
    assert "add context lines" in str(err.value)


def test_unified_diff_malformed_header() -> None:
    with pytest.raises(DiffError) as err:
        apply_unified_diff(ORIGINAL, "@@ -1,x +1 @@\n-alpha\n", "f")
    assert "hunk 1: malformed header '@@ -1,x +1 @@'" in str(err.value)


def test_unified_diff_wrong_line_counts() -> None:
    with pytest.raises(DiffError) as err:
        apply_unified_diff(ORIGINAL, "@@ -1,3 +1,3 @@\n alpha\n-beta\n+BETA\n", "f")
    assert str(err.value) == ("f: hunk 1: wrong line counts: the header says -3 +3 "
                              "but the hunk has 2 old and 2 new lines")


def test_unified_diff_without_hunks() -> None:
    with pytest.raises(DiffError, match="has no hunks"):
        apply_unified_diff(ORIGINAL, "--- a/f\n+++ b/f\n", "f")


@pytest.mark.parametrize("old,new", [
    (ORIGINAL, "alpha\nBETA\ngamma\ndelta\nepsilon\nzeta\n"),
    ("", "brand\nnew\n"),
    ("no newline", "no newline\nnow two"),
    ("a\nb", "a\nb\n"),
    (builtin("stock").to_toml(), builtin("dynamic").to_toml()),
])
def test_make_unified_diff_round_trips(old: str, new: str) -> None:
    assert apply_unified_diff(old, make_unified_diff(old, new, "f"), "f") == new


# --- SEARCH/REPLACE ---------------------------------------------------------------------------


def test_search_replace_applies_blocks_in_order() -> None:
    blocks = sr("beta\n", "BETA\n") + "\n" + sr("delta\nepsilon\n", "end\n")
    assert apply_search_replace(ORIGINAL, blocks, "f") == "alpha\nBETA\ngamma\nend\n"


def test_search_replace_zero_matches() -> None:
    with pytest.raises(DiffError) as err:
        apply_search_replace(ORIGINAL, sr("beta\n", "B\n") + sr("Gamma\n", "G\n"), "f")
    assert str(err.value) == ("f: block 2: SEARCH text found 0 times (first line: 'Gamma'); it must match the "
                              "file exactly once, whitespace included")


def test_search_replace_two_matches() -> None:
    with pytest.raises(DiffError) as err:
        apply_search_replace("x\ny\nx\n", sr("x\n", "z\n"), "f")
    assert str(err.value) == ("f: block 1: SEARCH text found 2 times (first line: 'x'); "
                              "it must match the file exactly once")


def test_search_replace_malformed_block() -> None:
    with pytest.raises(DiffError) as err:
        apply_search_replace(ORIGINAL, "<<<<<<< SEARCH\nbeta\n=======\nB\n", "f")
    assert str(err.value) == "f: block 1: malformed, missing '>>>>>>> REPLACE'"


def test_search_replace_empty_search_only_creates() -> None:
    assert apply_search_replace("", sr("", "new\n"), "f") == "new\n"
    with pytest.raises(DiffError, match="empty SEARCH only creates a new file"):
        apply_search_replace(ORIGINAL, sr("", "new\n"), "f")


# --- agent output and allow-list ---------------------------------------------------------------


def test_parse_agent_output_finds_every_form() -> None:
    reply = (
        "TITLE: x\nSome reasoning with a snippet:\n```toml\ndepth = 6\n```\n"
        "FILE: recipe.toml\n```\n" + sr("depth = 4\n", "depth = 6\n") + "```\n"
        "FILE: plugins/foo.py\n```diff\n--- /dev/null\n+++ b/plugins/foo.py\n@@ -0,0 +1,1 @@\n+X = 1\n```\n"
        "--- a/plugins/bar.py\n+++ b/plugins/bar.py\n@@ -1 +1 @@\n-A = 1\n+A = 2\n"
    )
    edits = parse_agent_output(reply)
    assert [(e.path, e.kind, e.creates) for e in edits] == [
        ("recipe.toml", "search_replace", False), ("plugins/foo.py", "unified", True),
        ("plugins/bar.py", "unified", False)]


def test_parse_agent_output_refuses_unreadable_edits() -> None:
    with pytest.raises(DiffError, match="expected a fenced block"):
        parse_agent_output("FILE: recipe.toml\ndepth = 6\n")
    with pytest.raises(DiffError, match="need a 'FILE: <path>' line"):
        parse_agent_output("```\n" + sr("a\n", "b\n") + "```\n")
    with pytest.raises(DiffError, match="neither a unified diff nor SEARCH/REPLACE"):
        parse_agent_output("FILE: plugins/x.py\n```python\nX = 1\n```\n")
    with pytest.raises(DiffError, match="never closes"):
        parse_agent_output("FILE: recipe.toml\n```\n" + sr("a\n", "b\n"))


def test_apply_edits_applies_and_creates() -> None:
    recipe = builtin("stock").to_toml()
    edits = parse_agent_output("FILE: recipe.toml\n```\n" + sr("depth = 4\n", "depth = 6\n") + "```\n"
                               "FILE: plugins/foo.py\n```\n" + sr("", "def f():\n    return 1\n") + "```\n")
    out = apply_edits(edits, {"recipe.toml": recipe}, ALLOW)
    assert out["recipe.toml"] == recipe.replace("depth = 4", "depth = 6")
    assert out["plugins/foo.py"] == "def f():\n    return 1\n"


@pytest.mark.parametrize("path", ["core/judge.py", "../recipe.toml", "/etc/passwd", "plugins/sub/x.py",
                                  "plugins/x.sh"])
def test_apply_edits_refuses_paths_outside_allow_list(path: str) -> None:
    edit = FileEdit(path, "search_replace", sr("", "x\n"), creates=True)
    with pytest.raises(DiffError) as err:
        apply_edits([edit], {"recipe.toml": ""}, ALLOW)
    assert str(err.value) == f"path {path} is outside the allow-list: allowed: recipe.toml, plugins/*.py"


def test_apply_edits_new_file_needs_a_creating_edit() -> None:
    edit = FileEdit("plugins/new.py", "unified", "@@ -1,1 +1,1 @@\n-a\n+b\n")
    with pytest.raises(DiffError, match="plugins/new.py does not exist; create it with a diff from /dev/null"):
        apply_edits([edit], {}, ALLOW)


def test_unified_diff_extra_lines_and_blank_context() -> None:
    with pytest.raises(DiffError) as err:
        apply_unified_diff(ORIGINAL, "@@ -1,1 +1,1 @@\n-alpha\n+ALPHA\n beta\n", "f")
    assert str(err.value) == "f: hunk 1: wrong line counts: line 4 ' beta' comes after the lines its header counts"
    text = "a\n\n-- x\nb\n"
    diff = "@@ -1,4 +1,4 @@\n a\n\n--- x\n+++ y\n b\n"
    assert apply_unified_diff(text, diff, "f") == "a\n\n++ y\nb\n"
