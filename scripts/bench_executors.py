"""Wall time of one loop round on 1 vs 2 devices, with the local and the Ray executor, on the demo pair.

Runs `specpilot run --rounds 1 --agents local:4 --auto --headless` once per configuration (one after the
other, never two at once) and reads the round's wall time, and the judging part of it, from the stored
events (round_started -> round_finished; state judging -> the next state). The load average around each
run is printed too: on a shared machine it moves the numbers more than anything else.

    python scripts/bench_executors.py [--max-requests 4] [--max-new-tokens 32] [--out runs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "local, 1 device": [],
    "local, 2 devices (cpu:0,cpu:1)": ["--devices", "cpu:0,cpu:1"],
    "ray, 1 device": ["--executor", "ray", "--devices", "1"],
    "ray, 2 devices": ["--executor", "ray", "--devices", "2"],
}


def phases(db: Path) -> dict:
    """Seconds of the round and of its judging state, and how many candidates were judged."""
    from specpilot.core.store import Store

    store = Store(db, read_only=True)
    events = store.events(1)
    start = next(e.time for e in events if e.kind == "round_started")
    end = next(e.time for e in events if e.kind == "round_finished")
    states = [(e.time, e.payload["state"]) for e in events if e.kind == "state"]
    judging = next(t for t, s in states if s == "judging")
    after = next(t for t, s in states if t > judging and s != "judging")
    judged = len({e.payload["cid"] for e in events if e.kind == "gate"})
    return {"round_s": round(end - start, 1), "judging_s": round(after - judging, 1), "judged": judged}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-requests", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    results = {}
    for name, extra in CONFIGS.items():
        with tempfile.TemporaryDirectory() as work:
            db = Path(work) / "store.db"
            argv = [sys.executable, "-m", "specpilot.core.cli", "run", "--rounds", "1", "--agents", "local:4", "--auto",
                    "--headless", "--json", "--db", str(db), "--max-requests", str(args.max_requests),
                    "--max-new-tokens", str(args.max_new_tokens), "--seed", "0", *extra]
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            proc = subprocess.run(argv, cwd=work, capture_output=True, text=True,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            wall = time.monotonic() - t0
            if proc.returncode != 0:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[name] = {**phases(db), "command_s": round(wall, 1), "load_before": round(load, 2),
                             "load_after": round(os.getloadavg()[0], 2)}
        print(f"{name:32s} {json.dumps(results[name])}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
