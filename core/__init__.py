"""SpecPilot's core: engine, cost model, forcing, agents, judge, loop and store (never imports the UI).

Models load from local directories only: the Hugging Face hub is switched offline so that a mistyped path
is a clear local error, never a download.

The checkout's top-level kernels/ folder is installed as `specpilot.kernels`, but with the repository root on
sys.path (`python -m ...` run from it) it would stand in for Hugging Face's `kernels` package, which
transformers >= 5.25 requires and imports; importing the core then stops with one line that says what to do.
"""

import importlib.metadata
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_ROOT = Path(__file__).resolve().parent.parent  # the checkout (or site-packages/specpilot once installed)


def kernels_shadowed() -> bool:
    """Whether `import kernels` would find this checkout's kernels/ folder while Hugging Face's is installed."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    spec = importlib.util.find_spec("kernels")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve() == _ROOT / "kernels" / "__init__.py"


if kernels_shadowed():
    raise ImportError(f"{_ROOT} is on sys.path, so its kernels/ folder hides Hugging "
                      "Face's `kernels` package that transformers imports; run the installed commands "
                      "(.venv/bin/specpilot), or python with -P or PYTHONSAFEPATH=1")
