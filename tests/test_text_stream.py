"""Incremental detokenisation (core/server/text.py) against a whole decode, on real tokenizers: the demo's
byte-level BPE and SmolLM2's. The streamed chunks must join to exactly the whole decode, hold back nothing
at the end, never release half a multi-byte character, and decode O(n) tokens for an n-token stream."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from specpilot.core.deployment import DEMO_TARGET
from specpilot.core.server.text import REPLACEMENT, TextStream


class CountingTokenizer:
    """A real tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TARGET)


def _tokens(tokenizer, n: int, seed: int) -> list[int]:
    """n ids: real text (with multi-byte characters) encoded, then random ids, so that pieces end mid-character."""
    text = "def f(x):\n    return x * 2  # ünïcödé → ✓ 日本語 🙂\n" * 200
    ids = tokenizer.encode(text, add_special_tokens=False)[: n // 2]
    rng = random.Random(seed)
    ids += [rng.randrange(len(tokenizer)) for _ in range(n - len(ids))]
    return ids


def _stream(tokenizer, ids: list[int], seed: int, stop: list[str] | None = None,
            eos: set[int] | None = None) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stop or [], eos or set())
    rng, chunks, i = random.Random(seed), [], 0
    while i < len(ids) and not stream.stopped:
        k = rng.choice([1, 1, 1, 2, 3, 5])
        chunks.append(stream.feed(ids[i:i + k], final=i + k >= len(ids)))
        i += k
    return chunks, stream


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_chunks_join_to_the_whole_decode(demo_tokenizer, seed):
    ids = _tokens(demo_tokenizer, 600, seed)
    chunks, _ = _stream(demo_tokenizer, ids, seed)
    assert "".join(chunks) == demo_tokenizer.decode(ids, skip_special_tokens=True)


def test_smollm2_stream_joins_to_the_whole_decode(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = _tokens(tokenizer, 500, 3)
    eos = {tokenizer.eos_token_id}
    ids[100:100] = [tokenizer.eos_token_id]
    chunks, _ = _stream(tokenizer, ids, 3, eos=eos)
    assert "".join(chunks) == tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)


def test_multibyte_characters_are_never_released_in_halves(demo_tokenizer):
    ids = demo_tokenizer.encode("日本語のテキスト 🙂🙃 ✓✓", add_special_tokens=False)
    stream = TextStream(demo_tokenizer, [], set())
    released = [stream.feed([t], final=False) for t in ids]
    assert all(REPLACEMENT not in c for c in released)
    assert "".join(released) + stream.feed([], final=True) == demo_tokenizer.decode(ids)


def test_stop_string_cuts_the_stream_where_a_whole_decode_would(demo_tokenizer):
    ids = demo_tokenizer.encode("x = 1\ny = 2\nSTOP here\nz = 3\n", add_special_tokens=False)
    chunks, stream = _stream(demo_tokenizer, ids, 5, stop=["STOP"])
    assert stream.stopped and "".join(chunks) == "x = 1\ny = 2\n"


def test_a_2000_token_stream_decodes_linear_work(demo_tokenizer):
    ids = _tokens(demo_tokenizer, 2000, 7)
    counting = CountingTokenizer(demo_tokenizer)
    chunks, _ = _stream(counting, ids, 7)
    assert "".join(chunks) == demo_tokenizer.decode(ids, skip_special_tokens=True)
    # re-decoding the whole output on every feed would cost about n^2 / (2 * mean chunk) = ~460,000 ids
    assert counting.decoded <= 8 * len(ids), counting.decoded
