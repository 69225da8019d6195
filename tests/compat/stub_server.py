"""A recording stand-in for the upstream-native routes, to check the harness's client side.

Not a model of the server: it computes nothing. It answers every route upstream's twinkle-kit
0.5.1 client calls in the twinkle cookbook scripts with the smallest body the client parses, and
appends each request (method, path, JSON body) to a jsonl file, so a twinkle script can run to
its end before the real routes exist, and its requests can be read.

    python -m tests.compat.stub_server --port 8124 --record /tmp/requests.jsonl &
    python -m tests.compat.run_upstream twinkle/dpo --server http://127.0.0.1:8124 --key x
"""

from __future__ import annotations

import argparse
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "twinkle/tiny-chat"
_lock = threading.Lock()


def _sample(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("sampling_params") or {}
    n = int(params.get("num_samples") or body.get("num_samples") or 1)
    max_tokens = int(params.get("max_tokens") or 4)
    samples = []
    for row in body.get("inputs") or []:
        seqs = []
        for j in range(n):
            tokens = [(40 + 7 * j + k) % 2000 + 4 for k in range(max_tokens)]
            text = f"stub completion {j}" + " x" * j
            feature = dict(row) if isinstance(row, dict) else {}
            messages = list(feature.get("messages") or [])
            messages.append({"role": "assistant", "content": text})
            feature["messages"] = messages
            ids = list(feature.get("input_ids") or []) + tokens
            feature.update(
                input_ids=ids,
                labels=[-100] * (len(ids) - len(tokens)) + tokens[1:] + [-100],
                attention_mask=[1] * len(ids),
                position_ids=list(range(len(ids))),
                length=len(ids),
            )
            seqs.append(
                {
                    "stop_reason": "length",
                    "tokens": tokens,
                    "logprobs": [[[t, -1.0 - 0.01 * k]] for k, t in enumerate(tokens)],
                    "decoded": text,
                    "new_input_feature": feature,
                }
            )
        samples.append({"sequences": seqs})
    return {"samples": samples}


def answer(method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    if path.startswith("/api/v1/twinkle/"):
        tail = path[len("/api/v1/twinkle/") :]
        if tail == "create_session":
            return 200, {"session_id": "stub-session"}
        if tail == "get_server_capabilities":
            return 200, {"supported_models": [{"model_name": MODEL}]}
        if tail == "training_runs":
            return 200, {"training_runs": [], "cursor": None}
        if re.fullmatch(r"training_runs/[^/]+/checkpoints", tail):
            return 200, {"checkpoints": []}
        return 200, {"status": "ok"}
    m = re.fullmatch(r"/api/v1/(model|sampler)/(.+)/twinkle/(\w+)", path)
    if not m:
        return 404, {"detail": "Not Found"}
    kind, _base, op = m.groups()
    if kind == "sampler":
        return 200, (_sample(body) if op == "sample" else {"status": "ok"})
    if op in ("forward_backward", "forward", "forward_only"):
        n = len(body.get("inputs") or [])
        return 200, {"result": {"loss": 1.0, "logps": [[-1.0]] * n}}
    if op == "calculate_metric":
        return 200, {"result": {"loss": 1.0}}
    if op == "get_train_configs":
        return 200, {"result": "stub"}
    if op == "save":
        name = body.get("name") or "ckpt"
        kind_dir = "sampler_weights" if body.get("is_sampler") else "weights"
        return 200, {
            "twinkle_path": f"twinkle://stub-run/{kind_dir}/{name}",
            "checkpoint_dir": None,
        }
    if op == "resume_from_checkpoint":
        return 200, {"result": {"consumed_train_samples": 0, "cur_step": 0}}
    return 200, {"status": "ok"}


def make_handler(record: str | None):
    class Handler(BaseHTTPRequestHandler):
        def _handle(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {"_raw": raw.decode("utf-8", "replace")}
            path = self.path.split("?", 1)[0]
            status, payload = answer(method, path, body if isinstance(body, dict) else {})
            if record:
                with _lock, open(record, "a") as f:
                    f.write(json.dumps({"method": method, "path": self.path, "body": body}) + "\n")
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._handle("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._handle("POST")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--record", default=None, help="append each request to this jsonl file")
    args = ap.parse_args()
    ThreadingHTTPServer((args.host, args.port), make_handler(args.record)).serve_forever()


if __name__ == "__main__":
    main()
