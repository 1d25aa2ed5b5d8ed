"""What a run is asked to do: LoopConfig, built from the command line or from a stored run to resume."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.core.agents.local import DEFAULT_ORDER, KNOB_AGENTS, MemoryAgent
from specpilot.core.deployment import Deployment
from specpilot.core.store import Store
from specpilot.core.store.db import RESUMABLE


@dataclass
class LoopConfig:
    deployment: Deployment = field(default_factory=Deployment)
    rounds: int = 3
    agents: str = "local:4"
    model: str = "claude-opus-5-5"
    auto: bool = False
    db: str = "store.db"
    max_requests: int | None = None
    max_new_tokens: int | None = None
    seed: int = 0
    limit_s: float = 120.0
    workdir: str | None = None  # candidate workspaces; default: .specpilot/<store name> next to the store
    time_budget_s: float | None = None  # stop before a round that would start after this much wall time
    local_agents: tuple[str, ...] | None = None  # the local agents a run may use, by name (None = all)
    resume: int | None = None  # continue this stopped or interrupted run from its last finished round
    executor: str = "local"  # where the judge's workers run: local | ray (core/executors)
    devices: str | None = None  # the judge's timing slots (--devices), default: the deployment's device
    ray_address: str | None = None  # an existing Ray cluster (--ray-address), default: start a local one


def default_workdir(db: str) -> str:
    """Candidate workspaces live next to the store they belong to, one folder per store (./.specpilot/store
    for ./store.db): run ids restart in every store, so stores in one folder must not share run-N folders."""
    path = Path(db).resolve()
    return str(path.parent / ".specpilot" / path.stem)


def config_from_args(args: argparse.Namespace) -> LoopConfig:
    """The run the parsed `specpilot run` / `specpilot-tui` options ask for (a resumed run's own options)."""
    db = args.db or os.environ.get("SPECPILOT_DB") or "store.db"
    if getattr(args, "resume", None) is not None:
        return resumed_config(args.resume, db, bool(args.auto))
    return LoopConfig(deployment=Deployment.from_args(args), rounds=args.rounds, agents=args.agents,
                      model=getattr(args, "model", None) or "claude-opus-5-5", auto=args.auto, db=db,
                      max_requests=getattr(args, "max_requests", None),
                      max_new_tokens=getattr(args, "max_new_tokens", None), seed=getattr(args, "seed", 0) or 0,
                      time_budget_s=60 * args.time_budget if getattr(args, "time_budget", None) else None,
                      workdir=os.environ.get("SPECPILOT_WORKDIR") or default_workdir(db),
                      local_agents=parse_local_agents(getattr(args, "local_agents", None)),
                      executor=getattr(args, "executor", None) or "local", devices=getattr(args, "devices", None),
                      ray_address=getattr(args, "ray_address", None))


def parse_local_agents(spec: str | None) -> tuple[str, ...] | None:
    """--local-agents: None (all), 'knobs' (the agents that only set recipe fields), or a comma list of names;
    an unknown name is a ValueError listing the known ones."""
    if spec is None:
        return None
    if spec.strip() == "knobs":
        return KNOB_AGENTS
    known = [c.default_name for c in (*DEFAULT_ORDER, MemoryAgent)]
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"--local-agents: unknown agent {bad[0] if bad else spec!r}; known: {', '.join(known)}, "
                         "or 'knobs'")
    return names


def resumed_config(run_id: int, db: str, auto: bool) -> LoopConfig:
    """The stored run's own deployment and options, to continue it where its last finished round ended."""
    if not Path(db).is_file():
        raise FileNotFoundError(f"no store at {db}; pass the --db the run was stored in")
    store = Store(db, read_only=True)
    try:
        run = store.run(run_id)
    finally:
        store.close()
    if run is None:
        raise FileNotFoundError(f"run {run_id} is not in {db}; see `specpilot runs`")
    if run["status"] not in RESUMABLE:
        raise ValueError(f"run {run_id} is {run['status']}; only a stopped or interrupted run can be resumed")
    names = {f.name for f in dataclasses.fields(Deployment)}
    deployment = Deployment(**{k: v for k, v in run["deployment"].items() if k in names})
    known = {f.name for f in dataclasses.fields(LoopConfig)} - {"deployment", "db", "resume", "auto"}
    stored = {k: v for k, v in run["config"].items() if k in known}
    return LoopConfig(deployment=deployment, db=db, resume=run_id, auto=auto or bool(run["config"].get("auto")),
                      **stored)
