"""Adversarial plugin: at import it freezes every clock the worker could use and stubs torch's timing
helpers, so anything measured inside the worker reads ~0 s. Its tree is the stock chain, so the judge's own
timings must show it exactly as fast as the incumbent."""

import time

import torch

from specpilot.core.engine.plugins import register_tree_policy
from specpilot.core.engine.tree import chain_paths

for _name in ("perf_counter", "monotonic", "time", "process_time", "thread_time"):
    setattr(time, _name, lambda: 0.0)
for _name in ("perf_counter_ns", "monotonic_ns", "time_ns"):
    setattr(time, _name, lambda: 0)
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.Event.elapsed_time = lambda self, end: 0.0

register_tree_policy("fast_clock", lambda tree: chain_paths(tree.depth))
