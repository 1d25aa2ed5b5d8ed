#!/usr/bin/env python
"""Peak memory of a process tree: the sum of PSS over a process and all its descendants, sampled every
`--every` seconds until it exits. PSS splits shared pages (the memory-mapped GGUF files every worker reads)
between their users, so the sum is what the run really holds; RSS would count each shared page per process.

`python scripts/peak_memory.py --pid PID` watches a running process (a `specpilot-tui` in tmux);
`python scripts/peak_memory.py -- CMD ...` runs CMD and watches it. Prints the peak and writes every sample
as JSON lines to `--log` when given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


def tree_pss(root: psutil.Process) -> tuple[int, int]:
    """(sum of PSS in bytes, number of processes) over `root` and its descendants still alive."""
    total, count = 0, 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total, count


def watch(pid: int, every: float, log: str | None) -> dict:
    root = psutil.Process(pid)
    peak, peak_at, start = 0, 0.0, time.time()
    out = open(log, "a") if log else None
    try:
        while root.is_running() and root.status() != psutil.STATUS_ZOMBIE:
            pss, n = tree_pss(root)
            now = time.time() - start
            if pss > peak:
                peak, peak_at = pss, now
            if out:
                out.write(json.dumps({"t": round(now, 1), "pss_gb": round(pss / 1e9, 3), "processes": n}) + "\n")
                out.flush()
            time.sleep(every)
    except psutil.NoSuchProcess:
        pass
    finally:
        if out:
            out.close()
    return {"peak_pss_gb": round(peak / 1e9, 2), "peak_at_s": round(peak_at, 1), "wall_s": round(time.time() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int, help="watch this running process and its descendants")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--log", help="append every sample here as JSON lines")
    ap.add_argument("command", nargs="*", help="a command to run and watch (after --)")
    args = ap.parse_args(argv)
    if (args.pid is None) == (not args.command):
        ap.error("give either --pid PID or -- COMMAND")
    child = subprocess.Popen(args.command) if args.command else None
    result = watch(child.pid if child else args.pid, args.every, args.log)
    if child:
        result["returncode"] = child.wait()
    print(json.dumps(result))
    return int(result.get("returncode", 0))


if __name__ == "__main__":
    sys.exit(main())
