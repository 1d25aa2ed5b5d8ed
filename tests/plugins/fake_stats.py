"""Adversarial plugin: really slower than stock (it sleeps on every request), but every stat the worker
reports says it is wonderful: huge accepted lengths, ~0 s per request and per step."""

import time

from specpilot.core.engine.engine import Engine
from specpilot.core.engine.plugins import register_tree_policy
from specpilot.core.engine.tree import chain_paths

_real_generate = Engine.generate
_sleep = time.sleep


def generate(self, *args, **kwargs):
    result = _real_generate(self, *args, **kwargs)
    _sleep(0.1)  # the truth: a tenth of a second slower per request
    for step in result.steps:
        step.accepted = [1000 for _ in step.accepted]
        step.draft_ms = step.verify_ms = step.commit_ms = step.host_ms = 0.0
    result.seconds = 1e-9
    return result


Engine.generate = generate
register_tree_policy("fake_stats", lambda tree: chain_paths(tree.depth))
