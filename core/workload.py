"""Request sets: our JSONL, Spec-Bench's question.jsonl, or plain prompts; and the tuning/held-out split.

Split rule (one rule for every workload): sort requests by sha256(f"{seed}:{request_id}") with seed 0;
the first half (rounded up) is `tuning`, the rest `heldout`. Agents and tuning only ever see `tuning`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("tuning", "heldout", "all")


class WorkloadError(ValueError):
    """A workload file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str
    max_new_tokens: int
    category: str = ""
    chat: bool = False


def load(path: str | Path, default_max_new_tokens: int = 64) -> list[Request]:
    """Read a JSONL workload in any of the three formats (detected per line)."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload {path} does not exist; pass a .jsonl file (see workloads/README.md)")
    requests: list[Request] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not valid JSON ({exc.msg}); fix or remove the line") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: expected a JSON object per line")
        requests.append(_parse(row, where, len(requests), default_max_new_tokens))
    if not requests:
        raise WorkloadError(f"{path} has no requests")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise WorkloadError(f"{path}: request id {dup!r} appears more than once; ids must be unique")
    return requests


def _parse(row: dict, where: str, index: int, default_new: int) -> Request:
    max_new = row.get("max_new_tokens", default_new)
    if not isinstance(max_new, int) or max_new < 1:
        raise WorkloadError(f"{where}: max_new_tokens must be a positive integer, got {max_new!r}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise WorkloadError(f"{where}: Spec-Bench 'turns' must be a non-empty list of strings")
        qid = row.get("question_id", index)
        return Request(str(qid), turns[0], max_new, str(row.get("category", "")), chat=True)
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f"{where}: expected 'prompt' (a non-empty string) or Spec-Bench 'turns'")
    chat = row.get("chat", False)
    if not isinstance(chat, bool):
        raise WorkloadError(f"{where}: 'chat' must be true or false, got {chat!r}")
    return Request(str(row.get("id", index)), prompt, max_new, str(row.get("category", "")), chat=chat)


def split(requests: list[Request], which: str = "all", seed: int = 0) -> list[Request]:
    """The seeded tuning/held-out halves (see module docstring); order within a half follows the hash."""
    if which not in SPLITS:
        raise WorkloadError(f"split {which!r} is not one of {', '.join(SPLITS)}")
    if which == "all":
        return list(requests)
    ranked = sorted(requests, key=lambda r: hashlib.sha256(f"{seed}:{r.id}".encode()).hexdigest())
    half = (len(ranked) + 1) // 2
    return ranked[:half] if which == "tuning" else ranked[half:]


def encode(tokenizer, request: Request) -> list[int]:
    """Token ids for a request; chat requests use the tokenizer's chat template when it has one."""
    if request.chat and getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": request.prompt}])
    return tokenizer.encode(request.prompt, add_special_tokens=False)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template, ready for the assistant's turn (what
    the server does with a chat request, so a benchmark's reference encodes exactly as the server does)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5 ignores return_dict for some tokenizers)
        ids = ids["input_ids"]
    return [int(i) for i in ids]
