"""Adversarial plugin: its tree policy starts a child process (in the worker's process group) and then
never returns. The judge must kill the worker at its per-call limit, the child with it."""

import subprocess
import sys
import time
from pathlib import Path

from core.engine.plugins import register_tree_policy


def never(tree):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    (Path(__file__).resolve().parent.parent / "child.pid").write_text(str(child.pid))
    while True:
        time.sleep(3600)


register_tree_policy("hang", never)
