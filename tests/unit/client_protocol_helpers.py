"""A fake Twinkle server for twinkle_client unit tests: an `httpx.MockTransport` that records
every request and answers in upstream Twinkle's native protocol (twinkle-kit 0.5.1 shapes).

`FakeServer.calls(route_suffix)` returns the recorded requests whose path ends with it. Encoding
(``/api/v1/twinkle/encode``) tokenizes each character and returns ROLLED labels (the target of
position i at i, last -100; only the assistant's text trained), as the real server does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

BASE_URL = "http://twinkle.test"
API_KEY = "tml-test-key"
MODEL = "twinkle/tiny-chat"
M = f"/api/v1/model/{MODEL}/twinkle"
S = f"/api/v1/sampler/{MODEL}/twinkle"
RUN = {
    "training_run_id": "run-1",
    "base_model": MODEL,
    "model_owner": "alice",
    "is_lora": True,
    "corrupted": False,
    "lora_rank": 8,
    "last_request_time": "2026-12-03T10:00:00Z",
    "last_checkpoint": None,
    "last_sampler_checkpoint": None,
    "user_metadata": None,
    "extra_field_from_a_newer_server": 1,
}
CKPT = {
    "checkpoint_id": "weights/step-2",
    "checkpoint_type": "training",
    "time": "2026-12-03T10:00:00Z",
    "tinker_path": "tinker://run-1/weights/step-2",
    "twinkle_path": "twinkle://run-1/weights/step-2",
    "size_bytes": 1234,
    "public": False,
    "user_metadata": None,
    "expires_at": None,
}


@dataclass
class Call:
    method: str
    path: str
    headers: httpx.Headers
    body: Any
    params: dict[str, str]


def _encode(messages: list[dict], add_generation_prompt: bool) -> dict[str, Any]:
    ids, trained = [], []
    for m in messages:
        text = f"<{m['role']}>{m['content']}"
        ids += [ord(c) % 256 for c in text]
        trained += [m["role"] == "assistant"] * len(text)
    if add_generation_prompt:
        ids += [ord(c) for c in "<assistant>"]
        trained += [False] * len("<assistant>")
    # rolled: labels[i] = ids[i + 1] where that next token is trained; the last is -100
    labels = [ids[i + 1] if trained[i + 1] else -100 for i in range(len(ids) - 1)] + [-100]
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": [1] * len(ids),
        "position_ids": list(range(len(ids))),
        "length": len(ids),
    }


@dataclass
class FakeServer:
    requests: list[Call] = field(default_factory=list)
    fail: dict[str, tuple[int, str]] = field(default_factory=dict)  # path suffix → error

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def calls(self, suffix: str) -> list[Call]:
        return [c for c in self.requests if c.path.endswith(suffix)]

    def last(self, suffix: str) -> Call:
        found = self.calls(suffix)
        assert found, f"no request to *{suffix}; got {[c.path for c in self.requests]}"
        return found[-1]

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path
        self.requests.append(
            Call(request.method, path, request.headers, body, dict(request.url.params))
        )
        for suffix, (status, detail) in self.fail.items():
            if path.endswith(suffix):
                return httpx.Response(status, json={"detail": detail})
        if path.endswith("/sample_stream"):
            lines = [
                {"delta": "ans", "finish_reason": None},
                {"delta": "wer", "finish_reason": "stop"},
            ]
            return httpx.Response(200, text="".join(json.dumps(x) + "\n" for x in lines))
        out = self.answer(request.method, path, body or {})
        return httpx.Response(200, json=out)

    def answer(self, method: str, path: str, body: dict) -> Any:
        if path == "/api/v1/twinkle/create_session":
            return {"session_id": "sess-1"}
        if path == "/api/v1/twinkle/session_heartbeat":
            return {"session_id": body["session_id"]}
        if path == "/api/v1/twinkle/get_server_capabilities":
            return {"supported_models": [{"model_name": MODEL}]}
        if path == "/api/v1/twinkle/capacity_info":
            return {"models": [{"base_model": MODEL, "max_loras": 4, "used_loras": 1}]}
        if path == "/api/v1/twinkle/training_runs":
            return {"training_runs": [RUN], "cursor": {"limit": 20, "offset": 0, "total_count": 1}}
        if path == "/api/v1/twinkle/training_runs/run-1":
            return RUN
        if path == "/api/v1/twinkle/training_runs/run-1/checkpoints":
            return {"checkpoints": [CKPT], "cursor": None}
        if path == "/api/v1/twinkle/checkpoint":
            return {"run_id": "run-1", **CKPT} if method == "GET" else {"deleted": "x"}
        if path == "/api/v1/twinkle/encode":
            feats = [_encode(i["messages"], body["add_generation_prompt"]) for i in body["inputs"]]
            return {"features": feats}
        if path.startswith(M + "/"):
            return self.model_answer(path.removeprefix(M + "/"), body)
        if path.startswith(S + "/"):
            return self.sampler_answer(path.removeprefix(S + "/"), body)
        raise AssertionError(f"unexpected route {method} {path}")

    def model_answer(self, method: str, body: dict) -> Any:
        n = len(body.get("inputs") or [])
        if method in ("forward", "forward_only", "forward_backward"):
            logps = [[-0.5] * len(r.get("input_ids", [0])) for r in body["inputs"]]
            return {"result": {"loss": 1.25, "num_tokens": 3 * n, "logps": logps}}
        if method == "calculate_metric":
            return {"result": {"loss": 1.25, "lr": 1e-4, "step": 1}}
        if method == "get_train_configs":
            return {"result": "lora r=8, optimizer Adam lr=1e-4"}
        if method == "clip_grad_norm":
            return {"result": "0.75"}
        if method == "calculate_loss":
            return {"result": 1.25}
        if method == "save":
            path = f"twinkle://run-1/weights/{body['name']}"
            if body.get("is_sampler"):
                path = f"twinkle://run-1/sampler_weights/{body['name']}"
            return {"twinkle_path": path, "checkpoint_dir": None}
        if method == "resume_from_checkpoint":
            return {"result": {"cur_step": 2, "consumed_train_samples": 8}}
        if method == "add_adapter_to_model":
            return {"status": "ok", "adapter_name": body["adapter_name"]}
        return {"status": "ok"}

    def sampler_answer(self, method: str, body: dict) -> Any:
        if method != "sample":
            return {"status": "ok"}
        k = int((body.get("sampling_params") or {}).get("num_samples", 1))
        samples = []
        for inp in body["inputs"]:
            prompt = inp.get("input_ids") or _encode(inp["messages"], True)["input_ids"]
            seqs = []
            for j in range(k):
                tokens = [50 + j, 51, 2]
                feature = {
                    **{key: v for key, v in inp.items() if key != "input_ids"},
                    "input_ids": prompt + tokens,
                    # rolled: the prompt's trained positions are kept, then the completion
                    "labels": (inp.get("labels") or [-100] * len(prompt))[:-1] + tokens + [-100],
                    "messages": [
                        *inp.get("messages", []),
                        {"role": "assistant", "content": f"answer {j}"},
                    ],
                }
                seqs.append(
                    {
                        "stop_reason": "stop",
                        "tokens": tokens,
                        "logprobs": [[[tok, -0.1 * (i + 1)]] for i, tok in enumerate(tokens)],
                        "decoded": f"answer {j}",
                        "new_input_feature": feature,
                    }
                )
            samples.append(
                {"sequences": seqs, "prompt_logprobs": None, "topk_prompt_logprobs": None}
            )
        return {"samples": samples}
