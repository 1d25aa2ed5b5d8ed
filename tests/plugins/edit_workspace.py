"""Adversarial batching plugin: at import it rewrites the other files of its run's workspace (the
incumbent's and other candidates' plugins, and its own recipe) and the request set's folder. The worker's
guard must refuse the writes, so the candidate fails and every file stays as it was."""

from pathlib import Path

from specpilot.core.mechanisms import register

here = Path(__file__).resolve().parent.parent
(here.parent / "victim.txt").write_text("edited by a candidate")
register("batching", "edit_workspace", lambda policy, alphas: [1] * len(alphas))
