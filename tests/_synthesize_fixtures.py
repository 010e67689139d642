"""A real, misbehaving OpenAI-compatible HTTP server on 127.0.0.1 for the stage-1 tests.

``FakeChatServer`` answers ``GET /v1/models`` and ``POST /v1/chat/completions`` from a thread. Each
chat request takes the next action from ``script`` (then ``default``):

* ``ok``: a chat completion whose answer is ``"echo[<turn>]: <last user message, 40 chars>"``
  (deterministic), ``finish_reason`` ``stop``, usage ``prompt_tokens`` = characters of all messages
  // 4 and ``completion_tokens`` = 7; reasoning as ``reasoning_style`` says (``None``,
  ``"reasoning_content"``, ``"reasoning"`` or ``"tags"``);
* ``500``: HTTP 500 with a JSON error; ``401``: HTTP 401; ``400ctx``: vLLM's context-length 400;
* ``hang``: reads the request and sleeps ``hang_s`` without answering (past the client timeout);
* ``close``: closes the connection without any response;
* ``notjson``: HTTP 200 with an HTML body.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode())
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        srv: FakeChatServer = self.server.owner  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        action = srv.next_action(body, dict(self.headers))
        try:
            if action == "ok":
                srv.enter()
                try:
                    time.sleep(srv.delay_s)
                    self._send(200, json.dumps(srv.completion(body)).encode())
                finally:
                    srv.leave()
            elif action == "500":
                self._send(500, b'{"error": {"message": "internal error", "code": 500}}')
            elif action == "401":
                self._send(401, b'{"error": {"message": "invalid api key", "code": 401}}')
            elif action == "400ctx":
                msg = ("This model's maximum context length is 64 tokens. However, your prompt contains 300 "
                       "input tokens, which exceeds this limit even without any output tokens.")
                self._send(400, json.dumps({"error": {"message": msg, "code": 400}}).encode())
            elif action == "hang":
                time.sleep(srv.hang_s)
                self.close_connection = True
            elif action == "close":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            elif action == "notjson":
                self._send(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
            else:  # pragma: no cover
                raise ValueError(action)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass


class FakeChatServer:
    """Start with ``with FakeChatServer() as srv:``; ``srv.base_url`` is ``http://127.0.0.1:PORT/v1``.

    Attributes:
        script: actions for the next chat requests, consumed in order.
        default: the action once ``script`` is empty.
        requests: ``(action, body, headers)`` of every chat request received.
        max_inflight: the most ``ok`` requests served at the same time.
    """

    def __init__(self, script: list[str] | None = None, default: str = "ok", delay_s: float = 0.0,
                 hang_s: float = 3.0, reasoning_style: str | None = None) -> None:
        self.script = list(script or [])
        self.default = default
        self.delay_s = delay_s
        self.hang_s = hang_s
        self.reasoning_style = reasoning_style
        self.requests: list[tuple[str, dict, dict]] = []
        self.lock = threading.Lock()
        self.inflight = 0
        self.max_inflight = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def next_action(self, body: dict, headers: dict) -> str:
        with self.lock:
            action = self.script.pop(0) if self.script else self.default
            self.requests.append((action, body, headers))
            return action

    def enter(self) -> None:
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)

    def leave(self) -> None:
        with self.lock:
            self.inflight -= 1

    def actions(self) -> list[str]:
        return [a for a, _, _ in self.requests]

    def completion(self, body: dict) -> dict:
        msgs = body["messages"]
        turn = sum(m["role"] == "assistant" for m in msgs)
        user = [m["content"] for m in msgs if m["role"] == "user"][-1]
        answer = f"echo[{turn}]: {user[:40]}"
        message: dict = {"role": "assistant", "content": answer}
        thought = f"thinking about {user[:20]}"
        if self.reasoning_style == "reasoning_content":
            message["reasoning_content"] = thought
        elif self.reasoning_style == "reasoning":
            message["reasoning"] = thought
        elif self.reasoning_style == "tags":
            message["content"] = f"<think>{thought}</think>\n\n{answer}"
        return {
            "id": "chatcmpl-test", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": sum(len(m["content"]) for m in msgs) // 4, "completion_tokens": 7,
                      "total_tokens": 0},
        }

    def __enter__(self) -> FakeChatServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
