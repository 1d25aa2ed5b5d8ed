"""A `specpilot serve` process on loopback for tests, and the transformers reference they compare with."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m specpilot.core.cli serve ARGS` on a free port, started and waited for; stopped on exit."""

    def __init__(self, *args: str, ready_s: float = 240.0, command: list[str] | None = None,
                 cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
        """`command` replaces `python -m specpilot.core.cli` (an installed `specpilot`, say), run in `cwd` with
        `env` (default this process's environment)."""
        self.port = free_port()
        cli = command or [sys.executable, "-m", "specpilot.core.cli"]
        self.args = [*cli, "serve", "--port", str(self.port), *args]
        self.ready_s = ready_s
        self.cwd, self.env = cwd, env
        self.proc: subprocess.Popen | None = None
        self.log = b""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        env = {**(os.environ if self.env is None else self.env), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(self.args, cwd=self.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stdout.read().decode()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {self.ready_s} s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log = self.proc.stdout.read()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
        """A raw POST (for bodies the openai client would never send): status and JSON answer."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics parsed with prometheus_client's own parser: (sample name, sorted labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.get("/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """transformers' float32 greedy tokens for each prompt, cut after the first EOS."""
    import torch

    from specpilot.core.hf import hf_model

    model = hf_model(str(model_dir))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    for p, n in zip(prompts, max_new):
        with torch.inference_mode():
            toks = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                  pad_token_id=next(iter(eos)))[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
        out.append(toks[:cut])
    return out
