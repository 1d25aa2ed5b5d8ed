"""Where a recipe named by a user comes from: a recipe spec plus a deployment plus a store gives a recipe, or a
one-line error. Specs are built-in names, .toml files, `best` (the newest incumbent the loop stored for this
deployment), a run id (its final incumbent), and for serving `ar` and `ar+RECIPE`. The command line, the
server and export all resolve through here."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specpilot.core.deployment import Deployment
from specpilot.core.mechanisms import UnknownMechanism, check_recipe
from specpilot.core.recipe import Recipe, RecipeError, resolve

if TYPE_CHECKING:
    from specpilot.core.store import Store


def recipes_from_spec(spec: str | None, deployment: Deployment | None = None, db: str | None = None) -> list[Recipe]:
    """Recipes named on the command line: built-ins, .toml files, and `best` (the newest incumbent the loop
    stored for this deployment in the store)."""
    has_drafter = deployment is None or deployment.drafter is not None
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    recipes = [best_recipe(deployment, db) if n == "best" else resolve(n, has_drafter) for n in names]
    seen: dict[str, str] = {}
    for given, recipe in zip(names, recipes):  # a bench keys its systems by name: a second one would vanish
        if recipe.name in seen:
            raise RecipeError(f"--recipes: {seen[recipe.name]} and {given} are both named {recipe.name!r}; "
                              f"set a different `name` in one of them")
        seen[recipe.name] = given
    return recipes


def best_recipe(deployment: Deployment, db: str | None) -> Recipe:
    """The final incumbent of the newest run on this deployment (same fingerprint) that finished a round."""
    store, run_id = best_run(deployment, db)
    return incumbent(store, run_id).replace(name="best")


def best_run(deployment: Deployment, db: str | None) -> tuple[Store, int]:
    """The store and the id of the newest run on this deployment that finished a round."""
    store, path = open_store(db, "best")
    mine = deployment.fingerprint()
    for run in store.list_runs():
        if same_deployment(run, mine) and finished_rounds(store, run["id"]):
            return store, run["id"]
    raise FileNotFoundError(f"best: {path} holds no finished round for this deployment "
                            f"({deployment.describe()}); run `specpilot run` on it first")


def run_incumbent(run_id: int, deployment: Deployment | None, db: str | None) -> Recipe:
    """Run `run_id`'s final incumbent, refused in one line if the run was on another deployment."""
    store, path = open_store(db, f"run {run_id}")
    run = store.run(run_id)
    if run is None:
        raise FileNotFoundError(f"run {run_id} is not in {path}; see `specpilot runs`")
    if deployment is not None and not same_deployment(run, deployment.fingerprint()):
        raise RecipeError(f"run {run_id} tuned another deployment than {deployment.describe()} (its fingerprint "
                          "differs); pass that run's --target and --drafter, or pick a run of this deployment")
    if not finished_rounds(store, run_id):
        raise FileNotFoundError(f"run {run_id} has no finished round in {path}")
    return incumbent(store, run_id)


def store_path(db: str | None) -> str:
    """The store a command means: `db`, else $SPECPILOT_DB, else ./store.db."""
    return db or os.environ.get("SPECPILOT_DB") or "store.db"


def open_store(db: str | None, what: str) -> tuple[Store, str]:
    """The store at store_path(db), read-only (it works on a read-only filesystem); a missing file is a
    one-line error."""
    from specpilot.core.store import Store  # lazily: SQLModel takes a third of a second to import

    path = store_path(db)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what}: no store at {path}; run `specpilot run` first or pass --db PATH")
    return Store(path, read_only=True), path


def same_deployment(run: dict, fingerprint: str) -> bool:
    try:
        return Deployment(**run["deployment"]).fingerprint() == fingerprint
    except (TypeError, ValueError, OSError):
        return False


def finished_rounds(store: Store, run_id: int) -> list[dict]:
    return [r for r in store.list_rounds(run_id) if r.get("incumbent")]


def incumbent(store: Store, run_id: int) -> Recipe:
    """The last finished round's incumbent recipe, with the run's plugins registered."""
    last = finished_rounds(store, run_id)[-1]
    recipe = Recipe.from_toml(last["incumbent"]["recipe"], source=f"run {run_id}")
    load_plugins(recipe, last["incumbent"].get("workspace"), run_id)
    return recipe


def load_plugins(recipe: Recipe, workspace: str | None, run_id: int) -> None:
    """An incumbent that runs agent-written mechanisms (`plugin:NAME`) needs them registered in this process:
    the user asked to run the loop's result, so they are imported from the run's workspace, the code the
    judge's workers ran. A workspace that is gone is a one-line error."""
    try:
        check_recipe(recipe)
        return
    except UnknownMechanism:
        pass
    from specpilot.core.engine.plugins import load_workspace  # lazily: the engine package loads torch

    if not workspace or not (Path(workspace) / "plugins").is_dir():
        raise FileNotFoundError(f"--recipes best: run {run_id}'s incumbent runs plugins from {workspace}, which "
                                "no longer exists; resume the run or export its recipe without the plugin")
    names = load_workspace(workspace)
    try:
        check_recipe(recipe)
    except UnknownMechanism as exc:
        raise FileNotFoundError(f"--recipes best: run {run_id}'s workspace {workspace} no longer holds its "
                                f"plugins ({exc})") from None
    print(f"--recipes best: loaded run {run_id}'s plugins ({', '.join(names)}) from {workspace}", file=sys.stderr)


def serving_recipe(spec: str, deployment: Deployment, db: str | None) -> tuple[Recipe | None, bool]:
    """The recipe to serve and whether to speculate with it: `best` (the newest stored incumbent of this
    deployment), a run id (its final incumbent; refused if that run was on another deployment), a built-in
    name, a .toml file, `ar` (plain decoding on the float32 weights) or `ar+RECIPE` (plain decoding on that
    recipe's weights and linear backend, what the recipe's speculation is measured against)."""
    if spec == "ar":
        return None, False
    if spec.startswith("ar+"):
        return serving_recipe(spec[3:], deployment, db)[0], False
    if spec.isdigit():
        return run_incumbent(int(spec), deployment, db), True
    return recipes_from_spec(spec, deployment, db)[0], True


def exported_run(spec: str, deployment: Deployment | None, db: str | None) -> tuple[Store, int, Recipe, Deployment]:
    """What `export` writes from: `best` (the newest run on `deployment` that finished a round) or a run id, as
    its store, run id, final incumbent and the deployment the run was on (a run id brings its own)."""
    if spec == "best":
        if deployment is None:
            raise ValueError("export best: name the deployment (--target, --drafter) whose newest run to export")
        store, run_id = best_run(deployment, db)
        return store, run_id, incumbent(store, run_id), deployment
    if not spec.isdigit():
        raise ValueError(f"export: {spec!r} is neither a run id nor `best`; see `specpilot runs`")
    store, path = open_store(db, "export")
    run_id = int(spec)
    run = store.run(run_id)
    if run is None:
        raise FileNotFoundError(f"run {run_id} is not in {path}; see `specpilot runs`")
    own = Deployment(**run["deployment"])
    return store, run_id, run_incumbent(run_id, own, db), own
