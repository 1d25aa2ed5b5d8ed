"""Memory budgeting before a load: refuse, in one line, what would not fit rather than be OOM-killed.

A 1.5B model in float32 is 7 GB; on a 24 GB machine the judge's reference, a baseline worker and candidate
workers each hold one. Weights memory-mapped from a checkpoint are shared through the page cache (counted
once, and reclaimable), but a linear backend's or weight format's packed copy is private to its process, so
it is priced against the memory the kernel says is available now (MemAvailable) before it is built.
"""

from __future__ import annotations

from pathlib import Path

from specpilot.core.engine.config import ModelLoadError

HEADROOM = 0.9  # leave a tenth of what is available for activations, the KV cache and the interpreter
GB = 1 << 30


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where the kernel does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require(nbytes: int, what: str, advice: str) -> None:
    """Raise a one-line ModelLoadError when `what` needs more than the headroom of available memory."""
    avail = available_bytes()
    if avail is not None and nbytes > HEADROOM * avail:
        raise ModelLoadError(f"{what} needs {nbytes / GB:.1f} GB of private memory and only {avail / GB:.1f} GB "
                             f"is available; {advice}")
