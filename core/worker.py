"""A candidate's process: one resident engine fed prompts over a pipe (run as `python -m core.worker FD`).

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
                from core.engine import Engine
                from core.engine.plugins import load_workspace
                from core.recipe import Recipe

                if msg.get("workspace"):
                    load_workspace(msg["workspace"])
                d = msg["deployment"]
                if d.get("threads"):
                    import torch

                    torch.set_num_threads(int(d["threads"]))
                engine = Engine.load(d["target"], d.get("drafter"), d["dtype"], d["device"])
                recipe = Recipe.from_toml(msg["recipe"]) if msg.get("recipe") else None
                send({"ok": True})
            elif msg["op"] == "generate":
                use = recipe
                if "recipe" in msg:  # the judge's baseline worker runs several trusted recipes
                    text = msg["recipe"]
                    if text is not None and text not in recipes:
                        from core.recipe import Recipe

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
