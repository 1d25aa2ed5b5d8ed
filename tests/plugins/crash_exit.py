"""Adversarial plugin: its tree policy kills the worker process outright (no reply, no traceback)."""

import os

from specpilot.core.engine.plugins import register_tree_policy


def die(tree):
    os._exit(7)


register_tree_policy("crash_exit", die)
