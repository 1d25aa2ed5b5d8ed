"""GGUF files as checkpoints, on the real SmolLM2-135M-Instruct: config, tokenizer and weights equal what
transformers' own GGUF loader makes of the same file; bad files fail in one line; converted once."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from specpilot.core.engine import Engine
from specpilot.core.engine.gguf_checkpoint import GGUFError, hf_config, materialise, reader


@pytest.fixture(scope="module")
def hf_from_gguf(smollm2_gguf):
    """transformers' own load of the GGUF file (`from_pretrained(dir, gguf_file=...)`): the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def test_weights_bitwise_equal_to_transformers_gguf_load(smollm2_dir, hf_from_gguf):
    from specpilot.core.engine.loader import load_state_dict

    ours = load_state_dict(smollm2_dir)
    theirs = hf_from_gguf[0].state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: the head is the embedding
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert different == []
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_config_matches_transformers(smollm2_dir, hf_from_gguf):
    ours = json.loads((smollm2_dir / "config.json").read_text())
    theirs = hf_from_gguf[0].config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["attention_bias"] is False


def test_tokenizer_and_chat_template_match(smollm2_dir, hf_from_gguf):
    from transformers import AutoTokenizer

    from specpilot.core.workload import Request, encode

    ours = AutoTokenizer.from_pretrained(str(smollm2_dir))
    theirs = hf_from_gguf[1]
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcode"
    assert ours.encode(text) == theirs.encode(text)
    request = Request("r", "Write a function that reverses a list.", 8, chat=True)
    ids = encode(ours, request)
    assert all(isinstance(i, int) for i in ids)
    rendered = theirs.apply_chat_template([{"role": "user", "content": request.prompt}], add_generation_prompt=True,
                                          tokenize=False)
    assert "<|im_start|>assistant" in rendered
    assert ids == theirs.encode(rendered, add_special_tokens=False)


def test_materialised_once_and_shared(smollm2_gguf, smollm2_dir):
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert materialise(smollm2_gguf) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    engine = Engine.load(smollm2_dir)
    layer = engine.target.layers[0].raw
    # q/k/v (and gate/up) are one view of the memory-mapped file, not a private concatenated copy
    assert layer["qkv"].untyped_storage().data_ptr() == engine.target.embed.untyped_storage().data_ptr()
    assert layer["gate_up"].untyped_storage().data_ptr() == engine.target.embed.untyped_storage().data_ptr()


def _write_gguf(path, arch="llama", tensors=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    for name, arr in (tensors or {"token_embd.weight": np.zeros((12, 8), np.float32)}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_fail_in_one_line(tmp_path, smollm2_gguf):
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        reader(wrong)
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as src:
        truncated.write_bytes(src.read(1 << 20))
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        reader(truncated)
    with pytest.raises(GGUFError, match="does not exist"):
        reader(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        hf_config(reader(_write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")))
    incomplete = reader(_write_gguf(tmp_path / "inc.gguf", tensors={"output_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(GGUFError, match="no token_embd.weight"):
        hf_config(incomplete)
    for e in (GGUFError("x"),):
        assert "\n" not in str(e)


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path, capsys):
    from specpilot.core.cli import main

    wrong = tmp_path / "model.gguf"
    wrong.write_bytes(b"nope" * 10)
    assert main(["profile", "--target", str(wrong), "--drafter", "none", "--recipe", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specpilot: error:") and "not a GGUF file" in err and "\n" not in err


def test_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch, smollm2_gguf):
    """A half-written cache entry (no completion marker) is never used: it is rebuilt."""
    from specpilot.core.engine import gguf_checkpoint as g

    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    small = tmp_path / "tiny.gguf"
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": rng.standard_normal((12, 8)).astype(np.float32),
               "output_norm.weight": np.ones(8, np.float32)}
    prefix = "blk.0."
    for name, shape in (("attn_norm.weight", (8,)), ("ffn_norm.weight", (8,)), ("attn_q.weight", (8, 8)),
                        ("attn_k.weight", (8, 8)), ("attn_v.weight", (8, 8)), ("attn_output.weight", (8, 8)),
                        ("ffn_gate.weight", (16, 8)), ("ffn_up.weight", (16, 8)), ("ffn_down.weight", (8, 16))):
        tensors[prefix + name] = rng.standard_normal(shape).astype(np.float32)
    _write_gguf(small, tensors=tensors)
    monkeypatch.setattr(g, "_save_tokenizer", lambda path, dest: None)
    out = g.materialise(small)
    first = (out / "model.safetensors").read_bytes()
    (out / g._DONE).unlink()
    (out / "model.safetensors").write_bytes(b"garbage")
    again = g.materialise(small)
    assert again == out and (out / "model.safetensors").read_bytes() == first
    shutil.rmtree(out)


def test_a_build_finished_meanwhile_by_another_process_is_kept(tmp_path) -> None:
    """Two processes materialising the same file: the second to finish keeps the first one's complete
    directory (readers may have it memory-mapped) and drops its own copy; an incomplete one is replaced."""
    from specpilot.core.engine import gguf_checkpoint as g

    out = tmp_path / "abcd"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"theirs")
    (out / g._DONE).write_text("abcd")
    mine = tmp_path / "abcd.mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"mine")
    (mine / g._DONE).write_text("abcd")
    g._move_into_place(mine, out)
    assert (out / "model.safetensors").read_bytes() == b"theirs" and not mine.exists()

    (out / g._DONE).unlink()
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"mine")
    (mine / g._DONE).write_text("abcd")
    g._move_into_place(mine, out)
    assert (out / "model.safetensors").read_bytes() == b"mine" and not mine.exists()
