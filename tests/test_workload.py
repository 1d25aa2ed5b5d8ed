"""Workload formats, the seeded split, and their errors."""

import json

import pytest

from specpilot.core.workload import Request, WorkloadError, encode, load, split


def write(tmp_path, lines):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_three_formats(tmp_path):
    path = write(tmp_path, [
        json.dumps({"id": "m:f", "prompt": "def f(", "max_new_tokens": 32}),
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Again."]}),
        json.dumps({"prompt": "x = 1", "max_new_tokens": 8}),
    ])
    reqs = load(path, default_max_new_tokens=50)
    assert reqs[0] == Request("m:f", "def f(", 32)
    assert reqs[1] == Request("81", "Write a poem.", 50, "writing", chat=True)
    assert reqs[2].prompt == "x = 1" and reqs[2].max_new_tokens == 8 and reqs[2].id == "2"


@pytest.mark.parametrize("line, message", [
    ("{not json", "w.jsonl:2: not valid JSON"),
    ("[1, 2]", "w.jsonl:2: expected a JSON object per line"),
    (json.dumps({"prompt": ""}), "w.jsonl:2: expected 'prompt'"),
    (json.dumps({"prompt": "a", "max_new_tokens": 0}), "w.jsonl:2: max_new_tokens must be a positive integer"),
    (json.dumps({"turns": []}), "w.jsonl:2: Spec-Bench 'turns' must be a non-empty list"),
    (json.dumps({"id": "a", "prompt": "b"}), "request id 'a' appears more than once"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [json.dumps({"id": "a", "prompt": "ok"}), line])
    with pytest.raises(WorkloadError, match=message):
        load(path)


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load(tmp_path / "none.jsonl")


def test_split_is_seeded_disjoint_and_covering():
    reqs = [Request(str(i), f"p{i}", 8) for i in range(31)]
    tuning, heldout = split(reqs, "tuning"), split(reqs, "heldout")
    assert len(tuning) == 16 and len(heldout) == 15
    assert {r.id for r in tuning} | {r.id for r in heldout} == {r.id for r in reqs}
    assert not {r.id for r in tuning} & {r.id for r in heldout}
    assert split(list(reversed(reqs)), "tuning") == tuning
    assert split(reqs, "tuning", seed=1) != tuning
    with pytest.raises(WorkloadError, match="split 'train' is not one of"):
        split(reqs, "train")


def test_shipped_workloads_load():
    from specpilot.core.deployment import DEMO_WORKLOAD, WORKLOADS

    code = load(DEMO_WORKLOAD)
    assert len(code) >= 64
    assert all(not r.prompt.endswith("\n") for r in code)
    chat = load(WORKLOADS / "chat.jsonl")
    assert all(r.chat for r in chat)


def test_chat_template_applied_when_present():
    """A real transformers tokenizer with a real template: transformers 5 returns a BatchEncoding from
    apply_chat_template(tokenize=True), which must still come out as token ids."""
    from transformers import AutoTokenizer

    from specpilot.core.deployment import DEMO_TARGET

    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    ids = encode(tok, Request("1", "hi there", 4, chat=True))
    assert all(isinstance(i, int) for i in ids)
    assert ids == tok.encode("<user>hi there\n<assistant>", add_special_tokens=False)
    assert encode(tok, Request("1", "hi there", 4)) == tok.encode("hi there", add_special_tokens=False)
