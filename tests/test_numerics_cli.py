"""`--numerics f32|q8` outside the engine: bad input refused in one line (exit 2, nothing stored), the
fingerprint, every command's Engine.load, and the numerics shown by runs, show, verify, serve, export, the
dashboard's header and a resumed run. GGUF deployments use the real SmolLM2 file (`smollm2_gguf`)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from specpilot.core.cli import build_parser, main
from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET, Deployment
from specpilot.core.engine import Engine
from specpilot.core.engine.config import ModelLoadError
from specpilot.core.recipe import stock
from specpilot.core.store import Store

BAD = "specpilot: error: unknown numerics 'q9'; use one of: f32, q8"


@pytest.fixture(scope="module")
def q8_stored(smollm2_gguf) -> dict:
    """A q8 deployment on the SmolLM2 GGUF as the store keeps it (asdict): resolving the file costs ~2 s, once."""
    return Deployment(target=smollm2_gguf, drafter="none", numerics="q8").to_dict()


@pytest.fixture()
def workload(tmp_path: Path) -> str:
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Say hi.", "chat": True, "max_new_tokens": 4}) + "\n")
    return str(path)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["bench", "run", "profile", "verify", "serve", "export", "tui"])
def test_every_deployment_command_takes_numerics(command):
    if command == "tui":
        from specpilot.app.app import build_parser as tui_parser

        args = tui_parser().parse_args(["--numerics", "q8"])
    else:
        extra = {"run": ["--auto"], "verify": ["--recipe", "stock"], "export": ["1"]}.get(command, [])
        args = build_parser().parse_args([command, *extra, "--numerics", "q8"])
    assert args.numerics == "q8"
    assert build_parser().parse_args(["bench"]).numerics is None  # left out: the deployment's default (f32)


def test_numerics_help_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--numerics NAME" in help_text and "f32: float32 products" in help_text and "q8: llama.cpp" in help_text


@pytest.mark.parametrize("argv", [
    ["bench", "--no-hf"],
    ["run", "--headless", "--auto", "--rounds", "1"],
    ["profile"],
    ["verify", "--recipe", "stock"],
    ["serve"],
])
def test_an_unknown_numerics_is_one_line_listing_the_known_ones(argv, tmp_path, capsys):
    db = tmp_path / "store.db"
    assert main([*argv, "--numerics", "q9", *(["--db", str(db)] if argv[0] in ("run", "serve") else [])]) == 2
    assert one_error_line(capsys) == BAD
    assert not db.exists()


def test_export_best_with_an_unknown_numerics_is_one_line(tmp_path, capsys):
    db = tmp_path / "store.db"
    Store(db).close()
    assert main(["export", "best", "--to", "vllm", "--numerics", "q9", "--db", str(db)]) == 2
    assert one_error_line(capsys) == BAD


def test_q8_on_the_float_demo_says_why_and_stores_nothing(tmp_path, capsys):
    db = tmp_path / "store.db"
    assert main(["run", "--numerics", "q8", "--headless", "--auto", "--rounds", "1", "--db", str(db)]) == 2
    err = one_error_line(capsys)
    assert err.startswith("specpilot: error: numerics q8 ") and "GGUF" in err and str(DEMO_TARGET) in err
    assert not db.exists()
    assert main(["bench", "--numerics", "q8", "--no-hf"]) == 2
    assert "GGUF" in one_error_line(capsys)


def test_fingerprint_q8_differs_and_f32_is_what_it_was(q8_stored):
    def before_numerics(d: Deployment) -> str:  # the formula before numerics existed
        parts = [d.device.split(":")[0], d.dtype]
        for path in (d.target, d.drafter):
            cfg = Path(path or "") / "config.json"
            parts.append(cfg.read_text() if path and cfg.is_file() else "none")
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    q8 = Deployment(**q8_stored)
    f32 = Deployment(**{**q8_stored, "numerics": "f32"})  # the same files
    assert f32.numerics == "f32" and q8.numerics == "q8"
    assert q8.fingerprint() != f32.fingerprint()
    assert f32.fingerprint() == before_numerics(f32)
    demo = Deployment()
    assert demo.fingerprint() == before_numerics(demo)
    # the file and its materialised directory are the same deployment
    assert Deployment(target=q8_stored["target"], drafter="none", numerics="q8").fingerprint() == q8.fingerprint()


@pytest.mark.parametrize("argv", [
    ["bench", "--no-hf", "--recipes", "stock"],
    ["bench", "--no-hf", "--recipes", "stock", "--batch-sizes", "1"],
    ["profile"],
    ["verify", "--recipe", "stock"],
    ["serve", "--recipe", "ar"],
])
def test_every_command_loads_the_engine_with_the_deployments_numerics(argv, smollm2_dir, workload, monkeypatch,
                                                                      capsys):
    seen = []

    def load(cls, target, drafter=None, dtype="float32", device="cpu", numerics="f32"):
        seen.append(numerics)
        raise ModelLoadError(f"stop here (numerics {numerics})")

    monkeypatch.setattr(Engine, "load", classmethod(load))
    deployment = ["--target", str(smollm2_dir), "--drafter", "none", "--workload", workload]
    assert main([*argv, *deployment, "--numerics", "q8"]) == 2
    assert seen == ["q8"] and one_error_line(capsys).endswith("stop here (numerics q8)")
    assert main([*argv, *deployment]) == 2
    assert seen == ["q8", "f32"]


def test_verify_under_q8_compares_with_our_own_decoding_at_threshold_zero(smollm2_dir, workload, capsys):
    code = main(["verify", "--target", str(smollm2_dir), "--drafter", "none", "--workload", workload,
                 "--numerics", "q8", "--recipe", "stock", "--max-requests", "1", "--max-new-tokens", "4",
                 "--reference-dtype", "bfloat16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "reference our q8 plain decoding (exact: 0 mismatches allowed)" in out
    assert "threshold 0.00%: PASS" in out
    assert "--reference-dtype is ignored under numerics q8" in err


def stored_runs(tmp_path: Path, q8_stored: dict) -> tuple[str, int, int]:
    """A store with a q8 run (finished, one round) and a run stored before numerics existed (no key)."""
    db = str(tmp_path / "store.db")
    store = Store(db)
    q8 = store.create_run(q8_stored, {})
    rid = store.start_round(q8, 1, {})
    store.finish_round(rid, {"recipe": stock(False).to_toml(), "round": 1, "heldout_speedup_vs_ar": 1.4,
                             "heldout_speedup_vs_stock": 1.0})
    store.finish_run(q8, "finished", {})
    old = {k: v for k, v in Deployment().to_dict().items() if k != "numerics"}
    before = store.create_run(old, {})
    store.finish_run(before, "finished", {})
    store.close()
    return db, q8, before


def test_runs_and_show_print_the_numerics(q8_stored, tmp_path, capsys):
    db, q8, before = stored_runs(tmp_path, q8_stored)
    assert main(["runs", "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["run", "status", "rounds", "best", "numerics", "started"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows[str(q8)][4] == "q8" and rows[str(before)][4] == "f32"
    assert main(["show", str(q8), "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("deployment smollm2-135m-instruct") and lines[-1].endswith("numerics q8)")
    assert main(["show", str(before), "--db", db]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("deployment demo-target + demo-drafter on cpu "
                                                        "(float32, numerics f32)")


def test_export_states_the_numerics_and_what_each_engine_gives_up(q8_stored, smollm2_gguf, tmp_path, capsys):
    db, q8, before = stored_runs(tmp_path, q8_stored)
    texts = {}
    for engine in ("vllm", "sglang", "llama.cpp", "transformers"):
        assert main(["export", str(q8), "--to", engine, "--db", db]) == 0
        texts[engine] = capsys.readouterr().out
        assert sum(line.startswith("# deployment numerics: q8 (") for line in texts[engine].splitlines()) == 1
        assert sum("# not expressible:" in line and "q8" in line for line in texts[engine].splitlines()) == 1
    assert "serves bf16/f16" in texts["vllm"] and "serves bf16/f16" in texts["sglang"]
    assert "q8-like (8-bit activations) but not batch-invariant" in texts["llama.cpp"]
    assert "not guaranteed identical to its plain decoding" in texts["llama.cpp"]
    assert main(["export", str(q8), "--to", "llama.cpp", "--json", "--db", db]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["numerics"] == "q8" and out["argv"][:3] == ["llama-server", "-m", smollm2_gguf]
    # an f32 run (stored before numerics existed) says f32 and gives nothing up for it
    store = Store(db)
    store.finish_round(store.start_round(before, 1, {}), {"recipe": stock(True).to_toml(), "round": 1,
                                                          "heldout_speedup_vs_ar": 1.2})
    store.close()
    assert main(["export", str(before), "--to", "vllm", "--db", db]) == 0
    text = capsys.readouterr().out
    assert "\n# deployment numerics: f32 (float32 products" in text and "q8" not in text
    assert str(DEMO_DRAFTER) in text


def test_a_resumed_run_keeps_its_numerics(q8_stored, smollm2_gguf, tmp_path):
    from specpilot.core.loop.config import config_from_args

    db, q8, _ = stored_runs(tmp_path, q8_stored)
    store = Store(db)
    again = store.create_run(q8_stored, {"rounds": 3, "auto": True})
    store.finish_run(again, "interrupted", {"reason": "test"})
    store.close()
    args = argparse.Namespace(resume=again, db=db, auto=False, numerics=None)
    config = config_from_args(args)
    assert config.deployment.numerics == "q8" and config.deployment.target_source == smollm2_gguf
    assert config.deployment.fingerprint() == Deployment(**q8_stored).fingerprint()
    assert config.deployment.fingerprint() != Deployment(**{**q8_stored, "numerics": "f32"}).fingerprint()


def test_serve_reports_the_numerics(smollm2_dir, workload):
    import asyncio

    from starlette.requests import Request

    from specpilot.core.server.main import build

    args = build_parser().parse_args(["serve", "--target", str(smollm2_dir), "--drafter", "none", "--workload",
                                      workload, "--numerics", "q8", "--recipe", "ar", "--max-batch", "1",
                                      "--max-model-len", "64"])
    app, state, label, deployment = build(args)
    assert deployment.numerics == "q8" and state.info["numerics"] == "q8"
    models = next(r.endpoint for r in app.routes if getattr(r, "path", None) == "/v1/models")
    response = asyncio.run(models(Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": []})))
    model = json.loads(response.body)["data"][0]
    assert model["numerics"] == "q8" and "numerics q8" in model["deployment"]


@pytest.mark.parametrize("width,numerics,shown", [(160, "q8", True), (160, None, True), (80, "q8", True),
                                                  (80, None, False)])
def test_dashboard_header_shows_the_numerics(width, numerics, shown):
    """Always on a wide header; on a narrow one only when not the default f32 (a run stored before numerics
    existed reads as f32)."""
    import asyncio

    from textual.app import App

    from specpilot.app.state import DashboardState
    from specpilot.app.widgets.header import StatusHeader

    state = DashboardState()
    state.deployment = {"target": str(DEMO_TARGET), "drafter": str(DEMO_DRAFTER),
                        **({"numerics": numerics} if numerics else {})}

    class One(App):
        def compose(self):
            yield StatusHeader(state)

    async def go() -> str:
        app = One()
        async with app.run_test(size=(width, 5)) as pilot:
            await pilot.pause()
            return app.query_one(StatusHeader).text

    text = asyncio.run(go())
    expected = f"demo-target → demo-drafter · {numerics or 'f32'}"
    assert (expected in text) == shown, text
    assert "demo-target → demo-drafter" in text
