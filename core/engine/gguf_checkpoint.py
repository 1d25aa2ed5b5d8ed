"""GGUF files as checkpoints: config, tokenizer and exactly dequantised float32 weights, converted once.

A `.gguf` path is accepted wherever a checkpoint directory is. The first use materialises it into the
SpecPilot cache, keyed by the file's sha256 (`gguf/<sha16>/`): config.json and generation_config.json from
the file's metadata, the tokenizer and chat template as transformers converts them, and model.safetensors
with every tensor dequantised by `gguf.quants.dequantize` (bit-equal to transformers' own GGUF load, which
the tests check). The directory is an ordinary Hugging Face checkpoint, so the engine, the reference and the
baselines all read the same float32 numbers; its tensors are laid out so that each layer's q/k/v and
gate/up rows are adjacent, which lets the engine's fused projections be views of one memory-mapped file
shared by every process. The quantised blocks stay reachable through `source.json` for the `gguf` weight
format, which multiplies by them as stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from specpilot.core.engine.config import ModelLoadError
from specpilot.kernels import cache_dir

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
SOURCE_FILE = "source.json"
_DONE = ".complete"


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be used; the message names the problem and what to do."""


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def reader(path: str | Path):
    """The file's GGUFReader (memory-mapped; its arrays read at numpy speed, gguf_reader.py); a missing,
    truncated or non-GGUF file is a one-line error."""
    from specpilot.core.engine.gguf_reader import FastArraysReader

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist; run `specpilot fetch NAME` or pass a local .gguf file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (wrong magic); pass a .gguf file or a checkpoint directory")
    try:
        return FastArraysReader(str(path), "r")
    except Exception as exc:  # gguf-py raises ValueError/IndexError/struct errors on damaged files
        raise GGUFError(f"{path} could not be read as GGUF ({type(exc).__name__}: {exc}); the file is truncated "
                        "or corrupt: fetch it again") from None


def _field(r, key: str, default=None):
    field = r.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def hf_config(r) -> dict:
    """A Hugging Face config.json for the file's architecture, from its metadata and tensor shapes."""
    arch = _field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name: t for t in r.tensors}
    if "token_embd.weight" not in names:
        raise GGUFError("GGUF file has no token_embd.weight; it is incomplete: fetch it again")
    heads = int(_field(r, f"{arch}.attention.head_count"))
    hidden = int(_field(r, f"{arch}.embedding_length"))
    scaling = _field(r, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"GGUF rope scaling {scaling!r} is not supported; supported: none")
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(r, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(r, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(r, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(r, f"{arch}.context_length")),
        "rope_theta": float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    bos = _field(r, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    return cfg


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None for tensors the Llama family does not use)."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, index, rest = gguf_name.split(".", 2)
        if rest in LAYER_NAMES:
            return f"model.layers.{index}.{LAYER_NAMES[rest]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (llama architecture only); a pure reordering."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def ordered(r, cfg: dict) -> list[tuple[str, object]]:
    """(hf_name, GGUF tensor) in engine order: top-level tensors, then each layer's q, k, v and gate, up
    adjacent (so fused projections can be views); a missing layer tensor (biases aside) is an error."""
    by_name = {hf_name(t.name): t for t in r.tensors if hf_name(t.name) is not None}
    order = [n for n in TOP_NAMES.values() if n in by_name]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for part in _LAYER_ORDER:
            if p + part in by_name:
                order.append(p + part)
            elif not part.endswith("bias"):
                raise GGUFError(f"GGUF file has no tensor for {p + part}; it is incomplete or not a "
                                f"{cfg['model_type']} model")
    return [(n, by_name[n]) for n in order]


def shape(t) -> list[int]:
    """A GGUF tensor's shape in torch order (GGUF lists the contiguous dimension first)."""
    return [int(d) for d in reversed(t.shape)]


def dequantised(r, cfg: dict):
    """(hf_name, float32 array) for every tensor in `ordered` order; values equal `gguf.quants.dequantize`
    bit for bit (llama's q/k rows un-permuted)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for name, t in ordered(r, cfg):
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            supported = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K"
            raise GGUFError(f"GGUF tensor {t.name} has block type {GGMLQuantizationType(t.tensor_type).name}, "
                            f"which cannot be dequantised; supported: {supported}") from None
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape(t))
        if cfg["model_type"] == "llama" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            values = np.ascontiguousarray(unpermute(values, heads))
        yield name, values


def sha256(path: str | Path) -> str:
    """The file's sha256, remembered by (path, size, mtime) so a 1 GB file is hashed once."""
    path = Path(path).resolve()
    st = path.stat()
    stamps = cache_dir() / "gguf" / "stamps.json"
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(stamps.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    known[key] = h.hexdigest()
    stamps.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamps.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, stamps)
    return known[key]


def materialise(path: str | Path) -> Path:
    """The cached checkpoint directory for a GGUF file, building it on first use (see module docstring)."""
    path = Path(path)
    r = reader(path)
    cfg = hf_config(r)
    digest = sha256(path)
    out = cache_dir() / "gguf" / digest[:16]
    if (out / _DONE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{digest[:16]}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen))
        _save_tokenizer(path, tmp)
        _write_safetensors_streaming(tmp / "model.safetensors", r, cfg)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(path.resolve()), "sha256": digest}))
        (tmp / _DONE).write_text(digest)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename a finished build to `out`. Another process may have built the same file meanwhile (judge
    workers, parallel tests): a complete `out` is kept and this copy dropped, an incomplete one replaced."""
    if (out / _DONE).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / _DONE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _write_safetensors_streaming(dest: Path, r, cfg: dict) -> None:
    """model.safetensors from the file's tensors, dequantising one tensor at a time (two passes over the
    blocks: shapes for the header, then values) so a 1.5B model never sits in memory as float32."""
    header, offset = {}, 0
    for name, t in ordered(r, cfg):
        nbytes = 4 * int(np.prod(shape(t)))
        header[name] = {"dtype": "F32", "shape": shape(t), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(dest, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, values in dequantised(r, cfg):
            f.write(values.tobytes())


_LAYER_ORDER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")


def _save_tokenizer(path: Path, dest: Path) -> None:
    """The tokenizer and chat template as transformers converts them from the file."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise GGUFError(f"the tokenizer in {path} could not be converted ({type(exc).__name__}: {exc})") from None
    finally:
        hf_logging.set_verbosity(level)
    tok.save_pretrained(str(dest))


def source(checkpoint: str | Path) -> dict | None:
    """The GGUF file a materialised checkpoint came from ({"gguf": path, "sha256": ...}), or None."""
    f = Path(checkpoint) / SOURCE_FILE
    if not f.is_file():
        return None
    return json.loads(f.read_text())


def resolve(path: str | Path) -> str:
    """A checkpoint directory for `path`: the directory itself, or a GGUF file's materialised cache."""
    return str(materialise(path)) if is_gguf(path) else str(path)
