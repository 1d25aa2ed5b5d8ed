"""Adversarial plugin: its tree policy starts a child process (in the worker's process group) and then
never returns. The judge must kill the worker at its per-call limit, the child with it. It leaves the
child's pid in the system's temporary folder (the worker's guard refuses writes to its workspace)."""

import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specpilot.core.engine.plugins import register_tree_policy


def never(tree):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    ws = str(Path(__file__).resolve().parent.parent)
    (Path(tempfile.gettempdir()) / f"hang-{hashlib.sha1(ws.encode()).hexdigest()[:12]}.pid").write_text(str(child.pid))
    while True:
        time.sleep(3600)


register_tree_policy("hang", never)
