"""A candidate's process: one resident engine fed prompts over a pipe (run as `python -m specpilot.core.worker_process FD`).

Candidate code (workspace plugins, recipes) only ever runs here, never in the judge. The worker answers on
a dedicated file descriptor, so whatever the candidate prints cannot forge a reply; its timing is not
trusted (the judge times every request from outside), and its stats are shown, never used to decide.
A `generate` message may name its own recipe (TOML, or null for autoregressive decoding): the judge sends
that only to its baseline worker, which is started without a workspace.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
WRITE_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.truncate": (0,),
                "os.chmod": (0,), "os.symlink": (1,), "os.link": (1,), "os.utime": (0,), "shutil.rmtree": (0,),
                "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (0, 1)}


class GuardError(PermissionError):
    """Candidate code touched what the judge owns (the held-out requests, the code, the workspaces)."""


def _real(path: object) -> str | None:
    if isinstance(path, int):
        return None
    try:
        return os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None


def _guard(deployment: dict, workspace: str | None) -> None:
    """Before any candidate code is imported: refuse (as a GuardError the judge reports) any read of the
    request set and any write, delete or rename inside SpecPilot's tree, the request set's folder and the
    run's workspaces, so a plugin of any kind can neither peek at held-out requests nor edit the judge,
    forcing, timers, request sets or another candidate. An audit hook cannot be removed once added. (It
    stops Python-level file access; it is not an OS sandbox: the judge's own timing and forcing remain what
    decides.)"""
    workload = _real(deployment.get("workload")) if deployment.get("workload") else None
    roots = [str(REPO)]
    if workload:
        roots.append(os.path.dirname(workload))
    if workspace:
        ws = Path(workspace).resolve()
        roots += [str(ws), str(ws.parent)]

    def inside(path: str | None) -> bool:
        return path is not None and any(path == r or path.startswith(r + os.sep) for r in roots)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            real = _real(path)
            if real is not None and real == workload:
                raise GuardError(f"candidate code may not read the request set {real}")
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing and inside(real) and "__pycache__" not in real:
                raise GuardError(f"candidate code may not write {real}")
        elif event in WRITE_EVENTS:
            for i in WRITE_EVENTS[event]:
                real = _real(args[i]) if i < len(args) else None
                if inside(real) or (real is not None and real == workload):
                    raise GuardError(f"candidate code may not change {real} ({event})")

    sys.addaudithook(hook)


def _serve(reply_fd: int) -> None:
    out = os.fdopen(reply_fd, "w", buffering=1)
    sys.stdout = sys.stderr
    engine = recipe = None
    recipes: dict[str, object] = {}

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "init":
                from specpilot.core.engine import Engine
                from specpilot.core.engine.plugins import load_workspace
                from specpilot.core.recipe import Recipe

                d = msg["deployment"]
                _guard(d, msg.get("workspace"))
                if msg.get("workspace"):
                    load_workspace(msg["workspace"])
                if d.get("threads"):
                    import torch

                    torch.set_num_threads(int(d["threads"]))
                engine = Engine.load(d["target"], d.get("drafter"), d["dtype"], d["device"], d.get("numerics", "f32"))
                recipe = Recipe.from_toml(msg["recipe"]) if msg.get("recipe") else None
                send({"ok": True})
            elif msg["op"] == "generate":
                use = recipe
                if "recipe" in msg:  # the judge's baseline worker runs several trusted recipes
                    text = msg["recipe"]
                    if text is not None and text not in recipes:
                        from specpilot.core.recipe import Recipe

                        recipes[text] = Recipe.from_toml(text)
                    use = recipes[text] if text is not None else None
                result = engine.generate([msg["prompt"]], msg["max_new_tokens"], use,
                                         request_ids=[msg.get("request_id", 0)], speculative=use is not None)
                send({"ok": True, "tokens": result.tokens[0],
                      "accepted": [a for s in result.steps for a in s.accepted]})
            elif msg["op"] == "exit":
                send({"ok": True})
                return
            else:
                send({"ok": False, "error": f"unknown op {msg['op']!r}"})
        except Exception as exc:  # any candidate failure is reported, the judge decides what it means
            last = traceback.format_exc().strip().splitlines()[-1]
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "trace": last[:500]})


def _pin() -> None:
    """Run on the CPUs the judge chose (before torch starts any thread), so both sides of an A/B share
    the same cores and whatever else runs on them."""
    cpus = os.environ.pop("SPECPILOT_WORKER_CPUS", "")
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    _pin()
    _serve(int(sys.argv[1]))
