"""The shipped demo pair (target, drafter, tokenizer), package data beside the code: an installed package finds it
through importlib.resources as a checkout does (core/deployment.py)."""
