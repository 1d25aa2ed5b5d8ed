#!/usr/bin/env python
"""Render a stored run's replay screen (its last round) to SVG at 160x50 and 80x24, through the real app.

The README's screenshots come from here, from a real run: `python scripts/screenshots.py --db store.db
--run 1 --out docs`. Writes replay_160x50.svg and replay_80x24.svg, and PNG copies when `rsvg-convert`
(Debian's librsvg2-bin) is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
from pathlib import Path

from specpilot.app.app import SpecPilotApp, build_parser
from specpilot.app.screens.replay import ReplayScreen

SIZES = {"160x50": (160, 50), "80x24": (80, 24)}


async def render(db: str, run: int, size: tuple[int, int]) -> str:
    app = SpecPilotApp(build_parser().parse_args(["--replay", str(run), "--db", db]))
    async with app.run_test(size=size) as pilot:
        for _ in range(500):
            if isinstance(app.screen, ReplayScreen):
                break
            await pilot.pause(0.02)
        if not isinstance(app.screen, ReplayScreen):
            raise SystemExit(f"run {run} in {db} did not open in replay")
        await pilot.pause(0.5)
        return app.export_screenshot()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--run", type=int, required=True)
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, size in SIZES.items():
        svg = out / f"replay_{name}.svg"
        svg.write_text(asyncio.run(render(args.db, args.run, size)))
        print(f"wrote {svg}")
        if shutil.which("rsvg-convert"):
            png = svg.with_suffix(".png")
            subprocess.run(["rsvg-convert", "-w", str(size[0] * 9), str(svg), "-o", str(png)], check=True)
            print(f"wrote {png}")


if __name__ == "__main__":
    main()
