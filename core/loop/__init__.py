"""The search loop, in parts: config (what a run is asked to do), control (pause, stop, decisions from
other threads), record (event persistence), rounds (the algorithm), summary (the value each round produces,
and the run's JSON summary built from them), workspace (candidate files) and headless (stderr output).
Memory is core/memory.py. This package keeps the names its callers import."""

from __future__ import annotations

import argparse

from specpilot.core.events import STATES
from specpilot.core.loop.config import LoopConfig, config_from_args, default_workdir, parse_local_agents
from specpilot.core.loop.control import PROGRESS_EVERY_S, Pending
from specpilot.core.loop.headless import stderr_progress
from specpilot.core.loop.rounds import Loop
from specpilot.core.loop.workspace import checked_files
from specpilot.core.memory import is_rejection

__all__ = ["PROGRESS_EVERY_S", "STATES", "Loop", "LoopConfig", "Pending", "build_loop", "checked_files",
           "config_from_args", "default_workdir", "is_rejection", "parse_local_agents", "stderr_progress"]


def build_loop(args: argparse.Namespace) -> Loop:
    """What the dashboard and `specpilot run` call."""
    return Loop(config_from_args(args))
