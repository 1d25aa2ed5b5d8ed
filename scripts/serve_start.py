"""`python scripts/serve_start.py RECIPE [--starts 2] [--costs-dir DIR]` (after `specpilot fetch qwen-coder`):
seconds from launching `specpilot serve --numerics q8` on the real pair (1 thread, 16 rows) to a 200 on /health,
for each of `--starts` starts in a row, and where its batching policy's step costs came from (the log line)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

from specpilot.core.fetch import fetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="a built-in name or a .toml file")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--costs-dir", default=None, help="SPECPILOT_COSTS_DIR for these starts (default: as set)")
    p.add_argument("--port", type=int, default=8431)
    args = p.parse_args()
    paths = fetch("qwen-coder")
    env = {**os.environ, **({"SPECPILOT_COSTS_DIR": args.costs_dir} if args.costs_dir else {})}
    argv = [sys.executable, "-m", "specpilot.core.cli", "serve", "--target", paths["target"], "--drafter",
            paths["drafter"], "--numerics", "q8", "--threads", "1", "--recipe", args.recipe, "--max-batch", "16",
            "--port", str(args.port)]
    for start in range(1, args.starts + 1):
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while True:
            if proc.poll() is not None:
                sys.exit(f"the server exited with {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        ready = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate()[0].decode()
        costs = next((line.split("specpilot.serve: ")[-1] for line in log.splitlines() if "step costs" in line),
                     "no step costs (fixed policy)")
        print(f"start {start}: ready in {ready:.1f} s; {costs}", flush=True)


if __name__ == "__main__":
    main()
