"""Strict application of agent edits: unified diffs and SEARCH/REPLACE blocks.

Agents write edits as text; a wrong edit must fail loudly with a reason the agent (or a person) can act on,
never half-apply or silently skip. Every hunk or block must match the current file exactly once; line
numbers in hunk headers are hints only, because models get them wrong far more often than the content.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable

from specpilot.core.recipe import Recipe

RECIPE_FILE = "recipe.toml"
PLUGIN_GLOB = "plugins/*.py"

SEARCH_MARK = "<<<<<<< SEARCH"
DIVIDER_MARK = "======="
REPLACE_MARK = ">>>>>>> REPLACE"
DEV_NULL = "/dev/null"

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_FILE_LINE = re.compile(r"^\s*\**FILE:\s*`?([^`*\s]+)`?\**\s*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_PREAMBLE = ("diff ", "index ", "new file mode", "similarity", "rename ")


class DiffError(ValueError):
    """An edit that cannot be applied; the message names the file, the hunk or block, and why."""


@dataclass
class FileEdit:
    """One edit to one file, as found in an agent's reply."""

    path: str
    kind: str  # "unified" | "search_replace"
    body: str
    creates: bool = False  # the edit says it creates the file (diff from /dev/null, or empty SEARCH)


class AllowList:
    """Paths an agent may touch, as glob patterns matched component by component (`*` stays in one folder)."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        self.description = "allowed: " + ", ".join(self.patterns)

    def __call__(self, path: str) -> bool:
        parts = PurePosixPath(path).parts
        for pattern in self.patterns:
            want = PurePosixPath(pattern).parts
            if len(want) == len(parts) and all(fnmatchcase(p, w) for p, w in zip(parts, want)):
                return True
        return False


def _split(text: str) -> tuple[list[str], bool]:
    """Lines without their endings, and whether the text ended with a newline (empty text counts as yes)."""
    if text == "":
        return [], True
    lines = text.split("\n")
    if lines[-1] == "":
        return lines[:-1], True
    return lines, False


def _join(lines: list[str], eol: bool) -> str:
    if not lines:
        return ""
    return "\n".join(lines) + ("\n" if eol else "")


def _find(lines: list[str], block: list[str]) -> list[int]:
    """Every index where `block` occurs as consecutive whole lines."""
    n = len(block)
    return [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block]


def _is_file_header(lines: list[str], i: int, stop: int) -> bool:
    return lines[i].startswith("--- ") and i + 1 < stop and lines[i + 1].startswith("+++ ")


def _first(block: list[str]) -> str:
    return next((line for line in block if line.strip()), block[0] if block else "")


# --- unified diffs -------------------------------------------------------------------------------


@dataclass
class _Hunk:
    number: int
    old_start: int
    old: list[str]
    new: list[str]
    new_no_eol: bool


def _parse_hunks(diff: str, path: str) -> list[_Hunk]:
    """Hunks read by their header's line counts, so a removed '-- x' line is never taken for a file header."""
    lines = diff.split("\n")
    if lines[-1] == "":
        lines.pop()
    hunks: list[_Hunk] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("@@"):
            if _is_file_header(lines, i, len(lines)) or line.startswith(_PREAMBLE) or not line.strip():
                i += 2 if _is_file_header(lines, i, len(lines)) else 1
                continue
            if hunks and line[:1] in (" ", "-", "+"):
                raise DiffError(f"{path}: hunk {len(hunks)}: wrong line counts: line {i + 1} {line[:80]!r} "
                                "comes after the lines its header counts")
            raise DiffError(f"{path}: unexpected line {i + 1} outside any hunk: {line[:80]!r}; "
                            "every change must be inside an '@@ -a,b +c,d @@' hunk")
        number = len(hunks) + 1
        match = _HUNK_HEADER.match(line)
        if not match:
            raise DiffError(f"{path}: hunk {number}: malformed header {line[:80]!r}; "
                            "expected '@@ -start,count +start,count @@'")
        old_count = int(match.group(2)) if match.group(2) is not None else 1
        new_count = int(match.group(4)) if match.group(4) is not None else 1
        hunk = _Hunk(number, int(match.group(1)), [], [], False)
        i += 1
        last = ""
        while i < len(lines) and not lines[i].startswith("@@") and (
                len(hunk.old) < old_count or len(hunk.new) < new_count or lines[i].startswith("\\")):
            raw = lines[i]
            i += 1
            if raw.startswith("\\"):
                hunk.new_no_eol = hunk.new_no_eol or last in ("+", " ")
                continue
            last, text = (raw[:1], raw[1:]) if raw else (" ", "")
            if last not in (" ", "-", "+"):
                raise DiffError(f"{path}: hunk {number}: line {raw[:80]!r} does not start with ' ', '-' or '+'")
            if last in (" ", "-"):
                hunk.old.append(text)
            if last in (" ", "+"):
                hunk.new.append(text)
        if len(hunk.old) != old_count or len(hunk.new) != new_count:
            raise DiffError(f"{path}: hunk {number}: wrong line counts: the header says -{old_count} +{new_count} "
                            f"but the hunk has {len(hunk.old)} old and {len(hunk.new)} new lines")
        hunks.append(hunk)
    if not hunks:
        raise DiffError(f"{path}: the diff has no hunks; expected at least one '@@ -a,b +c,d @@' hunk")
    return hunks


def apply_unified_diff(original: str, diff: str, path: str) -> str:
    """Apply every hunk of `diff` to `original`, each matched by content exactly once, or raise DiffError."""
    lines, eol = _split(original)
    for hunk in _parse_hunks(diff, path):
        if not hunk.old:
            at = min(hunk.old_start, len(lines))
        else:
            found = _find(lines, hunk.old)
            if len(found) != 1:
                where = "not found" if not found else (
                    f"found {len(found)} times (lines {', '.join(str(f + 1) for f in found[:5])}); "
                    "add context lines to make it unique")
                raise DiffError(f"{path}: hunk {hunk.number}: context and removed lines {where} "
                                f"(first line: {_first(hunk.old)!r})")
            at = found[0]
        lines[at:at + len(hunk.old)] = hunk.new
        if at + len(hunk.new) == len(lines):
            eol = not hunk.new_no_eol
    return _join(lines, eol)


def make_unified_diff(old: str, new: str, path: str) -> str:
    """A unified diff from `old` to `new` (3 lines of context) that apply_unified_diff applies back exactly."""
    old_lines = old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    out: list[str] = []
    for line in difflib.unified_diff(old_lines, new_lines, DEV_NULL if old == "" else f"a/{path}", f"b/{path}"):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


# --- SEARCH/REPLACE blocks ---------------------------------------------------------------------


def _parse_blocks(blocks_text: str, path: str) -> list[tuple[list[str], list[str]]]:
    lines = blocks_text.split("\n")
    blocks: list[tuple[list[str], list[str]]] = []
    i = 0
    while i < len(lines):
        if lines[i].rstrip() != SEARCH_MARK:
            if lines[i].strip() in (DIVIDER_MARK, REPLACE_MARK):
                raise DiffError(f"{path}: block {len(blocks) + 1}: {lines[i].strip()!r} without a "
                                f"preceding {SEARCH_MARK!r}")
            if lines[i].strip():
                raise DiffError(f"{path}: unexpected text outside SEARCH/REPLACE blocks: {lines[i][:80]!r}")
            i += 1
            continue
        number = len(blocks) + 1
        search, replace, part = [], [], "search"
        i += 1
        while True:
            if i >= len(lines):
                missing = DIVIDER_MARK if part == "search" else REPLACE_MARK
                raise DiffError(f"{path}: block {number}: malformed, missing {missing!r}")
            line = lines[i]
            if part == "search" and line.rstrip() == DIVIDER_MARK:
                part = "replace"
            elif part == "replace" and line.rstrip() == REPLACE_MARK:
                break
            elif line.rstrip() == SEARCH_MARK:
                raise DiffError(f"{path}: block {number}: malformed, a new {SEARCH_MARK!r} before "
                                f"{REPLACE_MARK!r}")
            else:
                (search if part == "search" else replace).append(line)
            i += 1
        blocks.append((search, replace))
        i += 1
    if not blocks:
        raise DiffError(f"{path}: no SEARCH/REPLACE blocks found; expected '{SEARCH_MARK}' ... "
                        f"'{DIVIDER_MARK}' ... '{REPLACE_MARK}'")
    return blocks


def apply_search_replace(original: str, blocks_text: str, path: str) -> str:
    """Apply SEARCH/REPLACE blocks in order, each SEARCH matching whole lines exactly once, or raise DiffError.

    An empty SEARCH creates the file and is only accepted when the file is empty.
    """
    lines, eol = _split(original)
    for number, (search, replace) in enumerate(_parse_blocks(blocks_text, path), start=1):
        if not search:
            if lines:
                raise DiffError(f"{path}: block {number}: empty SEARCH only creates a new file, but {path} "
                                "already has content; search for the lines to change")
            lines, eol = list(replace), True
            continue
        found = _find(lines, search)
        if len(found) != 1:
            raise DiffError(f"{path}: block {number}: SEARCH text found {len(found)} times "
                            f"(first line: {_first(search)!r}); it must match the file exactly once"
                            + ("" if found else ", whitespace included"))
        lines[found[0]:found[0] + len(search)] = replace
    return _join(lines, eol)


# --- agent replies ------------------------------------------------------------------------------


def _header_path(line: str) -> str:
    raw = line[4:].split("\t")[0].strip()
    if raw == DEV_NULL:
        return raw
    return raw[2:] if raw.startswith(("a/", "b/")) else raw


def _classify(path: str, body: str, where: str) -> FileEdit:
    if any(line.rstrip() == SEARCH_MARK for line in body.split("\n")):
        blocks = _parse_blocks(body, path)
        return FileEdit(path, "search_replace", body, creates=not blocks[0][0])
    if re.search(r"^@@", body, re.M):
        preamble = body.split("\n@@", 1)[0].split("\n") if not body.startswith("@@") else []
        old = [ln for ln in preamble if ln.startswith("--- ")]
        new = [ln for ln in preamble if ln.startswith("+++ ")]
        if new and _header_path(new[0]) not in (path, DEV_NULL):
            raise DiffError(f"{where}: the diff header names {_header_path(new[0])!r} but the block is for {path!r}")
        old_counts = re.findall(r"^@@ -\d+(?:,(\d+))? ", body, re.M)
        creates = bool(old and _header_path(old[0]) == DEV_NULL) or all(n == "0" for n in old_counts)
        return FileEdit(path, "unified", body, creates)
    raise DiffError(f"{where}: the block for {path} is neither a unified diff nor SEARCH/REPLACE blocks; "
                    "send a diff (a new file as a diff from /dev/null or an empty SEARCH)")


def _fenced(lines: list[str], start: int, where: str) -> tuple[str, int]:
    """The body of the fenced block opening at `start`, and the index after its closing fence."""
    opener = _FENCE.match(lines[start])
    assert opener is not None
    fence = opener.group(1)
    for end in range(start + 1, len(lines)):
        if lines[end].strip() == fence:
            return "\n".join(lines[start + 1:end]) + "\n", end + 1
    raise DiffError(f"{where}: the fenced block never closes; end it with {fence}")


def _bare_diffs(lines: list[str], start: int, stop: int) -> list[FileEdit]:
    """Unified diffs with ---/+++ headers found in lines[start:stop], split per file."""
    edits: list[FileEdit] = []
    i = start
    while i < stop:
        if not _is_file_header(lines, i, stop):
            i += 1
            continue
        old_path, new_path = _header_path(lines[i]), _header_path(lines[i + 1])
        if new_path == DEV_NULL:
            raise DiffError(f"{old_path}: deleting files is not supported; edit the file instead")
        j = i + 2
        while j < stop and not (_is_file_header(lines, j, stop) or _FENCE.match(lines[j])
                                or lines[j].startswith("diff ")):
            j += 1
        edits.append(_classify(new_path, "\n".join(lines[i:j]) + "\n", f"diff for {new_path}"))
        i = j
    return edits


def parse_agent_output(text: str) -> list[FileEdit]:
    """Every edit in an agent's reply, in order: `FILE: path` + fenced block, or ---/+++ unified diffs.

    Raises DiffError for anything that looks like an edit but cannot be read, so nothing is skipped.
    """
    lines = text.split("\n")
    edits: list[FileEdit] = []
    i = 0
    while i < len(lines):
        file_match = _FILE_LINE.match(lines[i])
        if file_match:
            path = file_match.group(1)
            where = f"FILE: {path} (line {i + 1})"
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j >= len(lines) or not _FENCE.match(lines[j]):
                raise DiffError(f"{where}: expected a fenced block (```) right after the FILE: line")
            body, i = _fenced(lines, j, where)
            edits.append(_classify(path, body, where))
            continue
        if _FENCE.match(lines[i]):
            body, end = _fenced(lines, i, f"fenced block at line {i + 1}")
            inner = body.split("\n")
            if any(ln.rstrip() == SEARCH_MARK for ln in inner):
                raise DiffError(f"line {i + 1}: SEARCH/REPLACE blocks need a 'FILE: <path>' line before the fence")
            found = _bare_diffs(inner, 0, len(inner))
            if not found and any(_HUNK_HEADER.match(ln) for ln in inner):
                raise DiffError(f"line {i + 1}: a diff without '--- a/path' and '+++ b/path' headers needs a "
                                "'FILE: <path>' line before the fence")
            edits.extend(found)
            i = end
            continue
        if lines[i].rstrip() == SEARCH_MARK:
            raise DiffError(f"line {i + 1}: SEARCH/REPLACE blocks need a 'FILE: <path>' line and a fence")
        if _is_file_header(lines, i, len(lines)):
            stop = next((k for k in range(i, len(lines)) if _FENCE.match(lines[k]) or _FILE_LINE.match(lines[k])),
                        len(lines))
            edits.extend(_bare_diffs(lines, i, stop))
            i = stop
            continue
        i += 1
    return edits


def checked_path(path: str, allow: Callable[[str], bool]) -> str:
    """`path` relative to the workspace with `.` parts dropped, or DiffError when it is absolute, climbs out
    (`..`), uses backslashes, or is not on the allow-list: the one check every written path goes through."""
    pure = PurePosixPath(str(path))
    clean = str(PurePosixPath(*[p for p in pure.parts if p != "."])) if pure.parts else ""
    bad = pure.is_absolute() or ".." in pure.parts or "\\" in str(path) or not clean or clean == "."
    if bad or not allow(clean):
        desc = getattr(allow, "description", "the agent may only edit the files it was given")
        raise DiffError(f"path {path} is outside the allow-list: {desc}")
    return clean


def apply_edits(edits: list[FileEdit], files: dict[str, str], allow: Callable[[str], bool]) -> dict[str, str]:
    """Apply `edits` in order to a copy of `files` (path -> text); return every file, edited or not.

    A path the allow-list refuses is an error; a file not in `files` may only be created by its edit
    (a diff from /dev/null or an empty SEARCH).
    """
    result = dict(files)
    for edit in edits:
        path = checked_path(edit.path, allow)
        if path not in result and not edit.creates:
            raise DiffError(f"{path} does not exist; create it with a diff from /dev/null or a SEARCH/REPLACE "
                            "block with an empty SEARCH")
        original = result.get(path, "")
        if edit.kind == "unified":
            result[path] = apply_unified_diff(original, edit.body, path)
        elif edit.kind == "search_replace":
            result[path] = apply_search_replace(original, edit.body, path)
        else:
            raise DiffError(f"{path}: unknown edit kind {edit.kind!r}; expected unified or search_replace")
    return result


def workspace_files(workspace: Path | None, recipe: Recipe) -> dict[str, str]:
    """The files an agent may edit, as they are now: the incumbent recipe and the workspace's plugins (what
    its diff is made against, and what the judge's applies gate applies it to)."""
    files = {RECIPE_FILE: recipe.to_toml()}
    plugin_dir = Path(workspace) / "plugins" if workspace is not None else None
    if plugin_dir is not None and plugin_dir.is_dir():
        for plugin in sorted(plugin_dir.glob("*.py")):
            files[f"plugins/{plugin.name}"] = plugin.read_text()
    return files
