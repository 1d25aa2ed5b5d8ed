"""Programs the code-writing agents fill in and propose as workspace plugins. Each is a real module, a
plugin exactly as it runs with example values, so linters and the tests see it as code.

Filling is by name (`render`): every top-level `NAME = <literal>` is a parameter, set from the lower-cased
keyword (`WINDOW = 2` from `window=3`), and the keyword `name` sets the mechanism name of the file's
`register(kind, "name", impl)` call, which stays a string literal because the judge finds a plugin's
mechanisms by parsing it. The rest of the file is kept byte for byte; a missing or unknown value is an error.
"""

from __future__ import annotations

import ast
import json
from importlib.resources import files


def source(template: str) -> str:
    """The template's text, as installed with the package."""
    return files(__name__).joinpath(f"{template}.py").read_text(encoding="utf-8")


def render(template: str, **values: int | str) -> str:
    """The template with each parameter (and the registered name) set to `values`; the result is a plugin
    file the agent proposes as is."""
    text = source(template)
    spans = _slots(text)
    missing, unknown = sorted(spans.keys() - values.keys()), sorted(values.keys() - spans.keys())
    if missing or unknown:
        raise ValueError(f"template {template!r} takes {', '.join(sorted(spans))}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unknown {', '.join(unknown)}" if unknown else ""))
    data = text.encode("utf-8")
    for key, (start, end) in sorted(spans.items(), key=lambda item: -item[1][0]):
        data = data[:start] + _literal(values[key]).encode("utf-8") + data[end:]
    return data.decode("utf-8")


def _slots(text: str) -> dict[str, tuple[int, int]]:
    """Where each fillable value sits, as byte offsets into `text` (ast positions count UTF-8 bytes)."""
    starts = [0]
    for line in text.encode("utf-8").splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def span(node: ast.expr) -> tuple[int, int]:
        return starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset

    slots: dict[str, tuple[int, int]] = {}
    for node in ast.parse(text).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.isupper() and isinstance(node.value, ast.Constant)):
            slots[node.targets[0].id.lower()] = span(node.value)
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "id", "") == "register" and len(node.value.args) >= 2):
            slots["name"] = span(node.value.args[1])
    return slots


def _literal(value: int | str) -> str:
    """Python source for `value`; strings in double quotes, as the agents always wrote them."""
    return json.dumps(value) if isinstance(value, str) else repr(value)
