"""A loopback HTTP server that speaks the Anthropic Messages streaming protocol, scripted per test.

The SDK uses httpx2, which respx cannot intercept, so tests talk to a real socket. Each POST to
/v1/messages consumes the next scripted reply; the server records every request (headers and JSON body).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted response. kind: stream | truncated | max_tokens | error_event | overloaded."""

    kind: str
    chunks: list[str] = field(default_factory=list)


def stream(*chunks: str) -> Reply:
    """A complete stream of text deltas ending with stop_reason end_turn and message_stop."""
    return Reply("stream", list(chunks))


def truncated(*chunks: str) -> Reply:
    """A stream that closes after the deltas, without message_delta or message_stop."""
    return Reply("truncated", list(chunks))


def max_tokens(*chunks: str) -> Reply:
    """A complete stream whose stop_reason is max_tokens."""
    return Reply("max_tokens", list(chunks))


def error_event(*chunks: str) -> Reply:
    """A stream that sends some deltas, then an `event: error` frame (overloaded_error)."""
    return Reply("error_event", list(chunks))


def overloaded() -> Reply:
    """HTTP 529 with an overloaded_error JSON body (retryable)."""
    return Reply("overloaded")


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class SSEServer:
    """Use as a context manager: `with SSEServer([stream("hi")]) as server: ... server.url ...`."""

    def __init__(self, replies: list[Reply] | None = None) -> None:
        self.replies = list(replies or [])
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def next_reply(self, recorded: Recorded) -> Reply | None:
        with self._lock:
            self.requests.append(recorded)
            return self.replies.pop(0) if self.replies else None

    def __enter__(self) -> "SSEServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _frame(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _message_start() -> bytes:
    return _frame("message_start", {"type": "message_start", "message": {
        "id": "msg_test", "type": "message", "role": "assistant", "model": "claude-test", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}})


def _handler_for(server: SSEServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            reply = server.next_reply(Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            if reply is None:
                self._json(500, {"type": "error", "error": {"type": "api_error",
                                                           "message": "no scripted reply left"}}, retry=False)
            elif reply.kind == "overloaded":
                self._json(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
            else:
                self._stream(reply)

        def _json(self, status: int, data: dict[str, Any], retry: bool = True) -> None:
            payload = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.send_header("retry-after-ms", "10")
            self.send_header("x-should-retry", "true" if retry else "false")
            self.end_headers()
            self.wfile.write(payload)

        def _send(self, data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        def _stream(self, reply: Reply) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.end_headers()
            self._send(_message_start())
            self._send(_frame("content_block_start", {"type": "content_block_start", "index": 0,
                                                      "content_block": {"type": "text", "text": ""}}))
            for chunk in reply.chunks:
                self._send(_frame("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                          "delta": {"type": "text_delta", "text": chunk}}))
            if reply.kind == "truncated":
                return
            if reply.kind == "error_event":
                self._send(_frame("error", {"type": "error", "error": {"type": "overloaded_error",
                                                                       "message": "Overloaded"}}))
                return
            self._send(_frame("content_block_stop", {"type": "content_block_stop", "index": 0}))
            stop = "max_tokens" if reply.kind == "max_tokens" else "end_turn"
            self._send(_frame("message_delta", {"type": "message_delta",
                                                "delta": {"stop_reason": stop, "stop_sequence": None},
                                                "usage": {"output_tokens": 42}}))
            self._send(_frame("message_stop", {"type": "message_stop"}))

    return Handler
