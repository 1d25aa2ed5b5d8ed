"""SpecPilot's core: engine, cost model, forcing, agents, judge, loop and store (never imports the UI).

Models load from local directories only: the Hugging Face hub is switched offline so that a mistyped path
is a clear local error, never a download.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
