"""The q8 product kernel (kernels/cpu/q8_blocks.c) against its oracle (kernels/reference/q8_ref.py): the same bits
for every block type, K, row count, grouping, thread count and instruction set; the activation quantisation's
q, d and bsums; refusals of types q8 does not multiply."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specpilot.kernels.reference import q8_ref
from specpilot.kernels.reference.gguf_ref import FORMATS, UnsupportedBlockType, qtype_id, random_blocks

TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_1"]
# moderate f16 scales (d, dmin, m), cycled over the blocks: positive, negative, small, zero
SCALES = np.array([0.011, -0.02, 0.0034, 0.5, -0.25, 0.0], dtype=np.float16)
ISAS = ["avx2", "avx512vnni", "amx"]


def kernel():
    from specpilot.kernels.cpu import q8_blocks

    if not q8_blocks.available():
        pytest.skip("the q8 kernel cannot build or run here")
    return q8_blocks


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    """Each of the kernel's two paths in turn (AVX-512 VNNI only where the CPU has it), restoring the default."""
    qb = kernel()
    before = qb.isa()
    if qb.use_isa(request.param) != request.param:
        qb.use_isa(before)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    qb.use_isa(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 as int32: equal bits, so -0.0 differs from 0.0."""
    return t.contiguous().view(torch.int32)


def k_for(q: str) -> int:
    """A K with a short last activation block where the format allows one (32-blocks: 576 = 2 * 256 + 64)."""
    return 512 if FORMATS[qtype_id(q)][1] == 256 else 576


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """m rows of x [m, k] whose first rows are the quantiser's edge cases, then random rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    edges = []
    zero = torch.zeros(k)  # every activation block zero: d = 0, q = 0
    edges.append(zero)
    neg = torch.randn(k, generator=g)  # the largest magnitude is negative in every block
    neg[::256] = -10.0
    edges.append(neg)
    tie = torch.randn(k, generator=g)  # |max| ties, the negative one first: it sets the sign of iscale
    tie[1::256], tie[5::256] = -7.0, 7.0
    edges.append(tie)
    half = torch.arange(k, dtype=torch.float32) % 61 - 30 + 0.25  # max -63.5: iscale = 2, iscale * x = j + .5
    half[0::256] = -63.5
    edges.append(half)
    part = torch.randn(k, generator=g)  # one all-zero block in the middle of a row
    part[256:512] = 0.0
    edges.append(part)
    for i, e in enumerate(edges[:m]):
        x[i] = e
    return x


def test_quantize_equals_the_reference() -> None:
    qb = kernel()
    for k in (32, 96, 256, 576, 1536):
        x = activations(9, k, seed=k)
        got, ref = qb.quantize(x), q8_ref.quantize(x)
        assert torch.equal(got.q, ref.q) and torch.equal(bits(got.d), bits(ref.d)) and torch.equal(got.bsums,
                                                                                                       ref.bsums)
        assert got.d.shape == (9, (k + 255) // 256) and got.bsums.shape == (9, k // 16)
    assert bool((qb.quantize(activations(5, 576)).d[0] == 0).all())  # the zero row
    with pytest.raises(ValueError, match="multiple of 32"):
        qb.quantize(torch.randn(2, 40))


@pytest.mark.parametrize("q", TYPES)
def test_product_equals_the_oracle_for_every_row_count(q: str, isa: str) -> None:
    """Rows 1..33 (one pass, a short group, two passes and a remainder row), 37 weight rows (a short last
    tile): each call's rows equal the oracle's rows bit for bit, and each row equals its own 1-row call."""
    qb = kernel()
    n, k = 37, k_for(q)
    raw = random_blocks(q, n, k, np.random.default_rng(1), SCALES)
    x = activations(33, k)
    ref = q8_ref.matmul(x, raw, q, n, k)
    m = qb.Q8Matrix(raw, q, n, k)
    for rows in range(1, 34):
        y = m(x[:rows])
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert torch.equal(bits(y), bits(ref[:rows])), f"{q}: {rows} rows"
    for i in (0, 3, 16, 32):
        assert torch.equal(bits(m(x[i:i + 1])[0]), bits(ref[i]))


@pytest.mark.parametrize("q", TYPES)
def test_short_k_and_normal_scales(q: str, isa: str) -> None:
    """The smallest K of each format (one block; 96 = three 32-blocks) and scales from a normal law."""
    qb = kernel()
    for k in ((256,) if FORMATS[qtype_id(q)][1] == 256 else (32, 96)):
        raw = random_blocks(q, 17, k, np.random.default_rng(k))
        x = activations(6, k, seed=k)
        assert torch.equal(bits(qb.Q8Matrix(raw, q, 17, k)(x)), bits(q8_ref.matmul(x, raw, q, 17, k)))


@pytest.mark.parametrize("q", TYPES)
def test_threads_and_instruction_sets_do_not_change_a_bit(q: str) -> None:
    """A matrix big enough for two threads: 1 and 2 threads, and the AVX2 and AVX-512 VNNI paths, all give the
    oracle's bits (17 rows: a full pass and a second one)."""
    qb = kernel()
    n, k = 301, 2048 if FORMATS[qtype_id(q)][1] == 256 else 2080
    raw = random_blocks(q, n, k, np.random.default_rng(2), SCALES)
    x = activations(17, k, seed=2)
    ref = bits(q8_ref.matmul(x, raw, q, n, k))
    m = qb.Q8Matrix(raw, q, n, k)
    before = qb.isa()
    try:
        for path in ISAS:
            if qb.use_isa(path) != path:
                continue
            for t in (1, 2):
                assert torch.equal(bits(m(x, threads=t)), ref), f"{q} {path} {t} threads"
    finally:
        qb.use_isa(before)


def test_quantise_once_multiply_by_several_matrices() -> None:
    """q, k and v share an input: one quantize, three products, each the oracle's bits; batched leading dims."""
    qb = kernel()
    k = 512
    mats = [(q, n, random_blocks(q, n, k, np.random.default_rng(i), SCALES))
            for i, (q, n) in enumerate([("Q4_K", 48), ("Q4_K", 16), ("Q6_K", 16)])]
    x = activations(5, k)
    xq = qb.quantize(x)
    for q, n, raw in mats:
        m = qb.Q8Matrix(raw, q, n, k)
        ref = bits(q8_ref.matmul(x, raw, q, n, k))
        assert torch.equal(bits(m.product(xq)), ref)
        assert torch.equal(bits(m.product(m.quantize(x))), ref)
        assert torch.equal(bits(m(x.view(5, 1, k)).view(5, n)), ref)
    with pytest.raises(ValueError, match="features"):
        qb.Q8Matrix(mats[0][2], "Q4_K", 48, k).product(qb.quantize(torch.randn(2, 256)))


def mapping(address: int) -> tuple[str, str]:
    """(permissions, file) of the process's mapping that holds `address` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        if lo <= address < hi:
            return fields[1], fields[5] if len(fields) > 5 else ""
    return "", ""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private SpecPilot cache for repacked copies (the kernel, built already, stays loaded)."""
    kernel().library()
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("q", ["Q4_K", "Q6_K"])
def test_repacked_blocks_give_the_same_bits(q: str, isa: str) -> None:
    """A private repacked copy (two tiles of 16 rows, then 5 rows read as stored): every row count, 2 threads."""
    qb = kernel()
    n, k = 37, 768
    raw = random_blocks(q, n, k, np.random.default_rng(3), SCALES)
    x = activations(33, k, seed=3)
    ref = bits(q8_ref.matmul(x, raw, q, n, k))
    m = qb.Q8Matrix(raw, q, n, k, repack=True)
    assert m.packed is not None and qb.Q8Matrix(raw, q, n, k).packed is None
    assert m.nbytes == m.packed.numel() + 5 * m.row_bytes
    for rows in range(1, 34):
        assert torch.equal(bits(m(x[:rows])), ref[:rows]), f"{q}: {rows} rows"
    assert torch.equal(bits(m(x[:17], threads=2)), ref[:17])


@pytest.mark.parametrize("q", ["Q5_0", "Q8_0"])
@pytest.mark.parametrize("k", [768, 896])
def test_repacked_32_blocks_give_the_same_bits(q: str, k: int, isa: str) -> None:
    """Q5_0/Q8_0 repacked on request (a last chunk of 4 blocks at K = 896): every row count, 2 threads; never by
    default."""
    qb = kernel()
    n = 37
    raw = random_blocks(q, n, k, np.random.default_rng(11), SCALES)
    x = activations(17, k, seed=5)
    ref = bits(q8_ref.matmul(x, raw, q, n, k))
    m = qb.Q8Matrix(raw, q, n, k, repack=True)
    assert m.packed is not None and qb.Q8Matrix(raw, q, n, k).packed is None
    assert m.packed.numel() == 32 // 16 * -(-k // 256) * (2816 if q == "Q5_0" else 4352)
    for rows in range(1, 18):
        assert torch.equal(bits(m(x[:rows])), ref[:rows]), f"{q}: {rows} rows"
    assert torch.equal(bits(m(x[:9], threads=2)), ref[:9])


def test_a_file_s_blocks_are_repacked_once_into_the_cache(tmp_path: Path, cache: Path) -> None:
    """Blocks that are a view of a file's memmap (as gguf-py's tensors are, at an offset) go through a repacked
    copy written once into the cache and mapped read-only; a changed file gets its own copy."""
    qb = kernel()
    n, k = 32, 512
    raw = random_blocks("Q4_K", n, k, np.random.default_rng(4), SCALES)
    path = tmp_path / "model.bin"
    head = np.arange(96, dtype=np.uint8)
    np.concatenate([head, raw.reshape(-1)]).tofile(path)
    view = np.memmap(path, dtype=np.uint8, mode="r")[96:].reshape(n, -1)
    x = activations(5, k)
    ref = bits(q8_ref.matmul(x, raw, "Q4_K", n, k))
    m = qb.Q8Matrix(view, "Q4_K", n, k)
    copies = list((cache / "q8").iterdir())
    assert len(copies) == 1 and m.packed is not None and mapping(m.packed.data_ptr()) == ("r--s", str(copies[0]))
    assert torch.equal(bits(m(x)), ref)
    stamp = copies[0].stat().st_mtime_ns
    assert torch.equal(bits(qb.Q8Matrix(view, "Q4_K", n, k)(x)), ref)
    assert copies[0].stat().st_mtime_ns == stamp  # read again, not rewritten
    raw2 = random_blocks("Q4_K", n, k, np.random.default_rng(5), SCALES)
    np.concatenate([head, raw2.reshape(-1)]).tofile(path)
    view2 = np.memmap(path, dtype=np.uint8, mode="r")[96:].reshape(n, -1)
    assert torch.equal(bits(qb.Q8Matrix(view2, "Q4_K", n, k)(x)), bits(q8_ref.matmul(x, raw2, "Q4_K", n, k)))
    assert len(list((cache / "q8").iterdir())) == 2
    assert qb.Q8Matrix(view, "Q4_K", n, k, repack=False).packed is None


def test_q6_k_every_scale_and_extreme_codes(isa: str) -> None:
    """Q6_K with each of the 256 int8 sub-block scales, codes all 0 (value -32), all 63 (value 31) or random,
    against activations at the quantiser's full range: the AMX path splits each scale into parts whose products
    with the values must fit a byte, so the extremes are where it would break. 16 and 20 rows, every weight row."""
    qb = kernel()
    n, k = 32, 4096
    rng = np.random.default_rng(11)
    raw = random_blocks("Q6_K", n, k, rng, SCALES).reshape(n, k // 256, 210)
    raw[:, :, 192:208] = (np.arange(n * (k // 256) * 16) % 256).astype(np.uint8).reshape(n, k // 256, 16)
    raw[0::3, :, :192] = 0
    raw[1::3, :, :192] = 255
    raw = np.ascontiguousarray(raw.reshape(n, -1))
    x = torch.where(torch.rand(20, k, generator=torch.Generator().manual_seed(5)) < 0.5, -1.0, 1.0)
    x[1::2] *= torch.rand(10, k, generator=torch.Generator().manual_seed(6)) + 0.5
    ref = bits(q8_ref.matmul(x, raw, "Q6_K", n, k))
    m = qb.Q8Matrix(raw, "Q6_K", n, k)
    for rows in (16, 20):
        assert torch.equal(bits(m(x[:rows])), ref[:rows]), f"{rows} rows"


def test_read_only_memmap_is_used_in_place(tmp_path) -> None:
    qb = kernel()
    raw = random_blocks("Q6_K", 9, 512, np.random.default_rng(7), SCALES)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)  # a write would fault
    m = qb.Q8Matrix(mm, "Q6_K", 9, 512)
    assert m.raw.data_ptr() == mm.ctypes.data and m.nbytes == raw.size == 9 * 2 * 210
    x = activations(3, 512)
    assert torch.equal(bits(m(x)), bits(q8_ref.matmul(x, raw, "Q6_K", 9, 512)))


def test_unsupported_types_are_refused_by_name() -> None:
    qb = kernel()
    for q, nbytes in (("F16", 2 * 32), ("F32", 4 * 32), (1, 2 * 32)):
        with pytest.raises(UnsupportedBlockType, match="F16|F32") as e:
            qb.Q8Matrix(np.zeros((1, nbytes), np.uint8), q, 1, 32)
        assert "q8" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UnsupportedBlockType):
        qb.Q8Matrix(np.zeros((1, 18), np.uint8), 2, 1, 32)  # Q4_0: no block table entry at all
    with pytest.raises(ValueError, match="features"):
        qb.Q8Matrix(random_blocks("Q8_0", 2, 64, np.random.default_rng(0)), "Q8_0", 2, 64)(torch.randn(1, 32))


def test_the_c_traits_table_covers_the_oracle_s_types() -> None:
    qb = kernel()
    for t in range(20):
        got = qb.block_traits(t)
        if t in q8_ref.Q8_TYPES:
            assert got == FORMATS[t], t
        else:
            assert got is None, t


def write_gguf(path: Path, tensors: dict[str, tuple[str, int, int]]) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    for i, (name, (q, n, k)) in enumerate(tensors.items()):
        w.add_tensor(name, random_blocks(q, n, k, np.random.default_rng(i), SCALES),
                     raw_dtype=gguf.GGMLQuantizationType[q])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bench_cli_q8_numerics(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--bench MODEL.gguf --numerics q8` times every linear, the tied head (the embedding) included, against a
    read of the same bytes; a file with a weight q8 does not multiply is an error naming it."""
    kernel()
    from specpilot.kernels.bench.gguf_cpu import main

    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"token_embd.weight": ("Q8_0", 40, 64), "blk.0.attn_q.weight": ("Q4_K", 32, 256),
                      "blk.0.ffn_down.weight": ("Q6_K", 24, 512)})
    args = ["--bench", str(path), "--numerics", "q8", "--rows", "1,5", "--repeats", "1", "--threads", "1"]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["numerics"] == "q8" and report["isa"] in ISAS and report["threads"] == 1
    assert report["linears"] == 3 and set(report["rows"]) == {"1", "5"} and all(v > 0 for v in report["rows"].values())
    assert report["floor_ms"] > 0
    assert report["read_gb_s"] == pytest.approx(report["blocks_gb"] / report["floor_ms"] * 1e3)
    assert len(list((cache / "q8").iterdir())) == 3  # Q4_K, Q6_K and Q8_0, each repacked once
    assert main(args) == 0
    assert "reading those bytes once takes" in capsys.readouterr().out
    f16 = tmp_path / "f16.gguf"
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(f16), "llama")
    w.add_tensor("output.weight", np.zeros((4, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["--bench", str(f16), "--numerics", "q8", "--rows", "1", "--repeats", "1"]) == 2
    assert "output.weight is F16" in capsys.readouterr().err
