"""The shipped request sets, package data beside the code: an installed package finds them through
importlib.resources as a checkout does (core/deployment.py, core/real_pair.py)."""
