"""Scrub API keys out of anything that is stored, shown or returned.

Error messages, agent replies and configs can echo a key by accident; the store, the agents and the UI all
pass their text through `redact` so a key never lands in store.db or on screen.
"""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "[redacted]"
KEY_ENV = "ANTHROPIC_API_KEY"
_KEY_PATTERN = re.compile(r"sk-ant-[A-Za-z0-9_-]+")


def redact_text(text: str) -> str:
    """`text` with the current ANTHROPIC_API_KEY value and anything shaped like an Anthropic key replaced."""
    key = os.environ.get(KEY_ENV, "")
    if len(key) >= 8 and key in text:
        text = text.replace(key, REDACTED)
    return _KEY_PATTERN.sub(REDACTED, text)


def redact(value: Any) -> Any:
    """`value` with every string in it (recursively through dicts, lists and tuples) passed through redact_text."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact(k): redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
