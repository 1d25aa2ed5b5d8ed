"""Adversarial drafter plugin: the model drafter, except that on its first draft it reads the clock and
then freezes every clock the worker could use, so anything timed inside the worker reads ~0 s from then on.
The judge times each request from outside, so it must measure this as fast as stock, not infinitely fast."""

import time

from specpilot.core.engine.drafters import ModelDrafter
from specpilot.core.mechanisms import register

FROZEN = time.perf_counter


class ClockDrafter(ModelDrafter):
    def draft(self, spec, mode, active):
        started = FROZEN()
        for name in ("perf_counter", "monotonic", "time", "process_time", "thread_time"):
            setattr(time, name, lambda: started)
        return super().draft(spec, mode, active)


register("drafter", "clock_drafter", lambda engine, recipe, target, drafter_model: ClockDrafter(drafter_model))
