"""Row preprocessors for `Dataset.map`: raw dataset rows → trajectories.

A preprocessor is called on one row (a dict) and returns a row, a list of rows, or None (drop).
`Dataset.map` also takes these by name (upstream style: ``map("SelfCognitionProcessor",
init_args={...})``) or any callable.

* `SelfCognitionProcessor(model_name, model_author)`: ``query`` / ``response`` rows whose text
  holds ``{{NAME}}`` / ``{{AUTHOR}}`` placeholders (the swift/self-cognition layout).
* `DPOProcessor`: ``prompt`` (or ``question``) with ``chosen`` / ``rejected`` (or
  ``response_chosen`` / ``response_rejected``) → ``{"chosen": trajectory, "rejected": trajectory}``.
* `MathProcessor` / `GSM8KProcessor`: ``question`` / ``answer`` → a prompt trajectory plus
  ``ground_truth`` (GSM8K's ``#### <number>``), for sampling-based RL.
"""

from __future__ import annotations

import re
from typing import Any


class Preprocessor:
    system: str | None = None

    def _messages(self, user: str, assistant: str | None = None) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        msgs.append({"role": "user", "content": user})
        if assistant is not None:
            msgs.append({"role": "assistant", "content": assistant})
        return msgs

    def __call__(self, row: dict[str, Any]) -> Any:
        raise NotImplementedError


class SelfCognitionProcessor(Preprocessor):
    def __init__(
        self,
        model_name: str = "Twinkle",
        model_author: str = "the Twinkle team",
        system: str | None = None,
    ) -> None:
        self.model_name, self.model_author, self.system = model_name, model_author, system

    def _fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.model_name).replace("{{AUTHOR}}", self.model_author)

    def __call__(self, row: dict[str, Any]) -> dict[str, Any] | None:
        query, response = row.get("query"), row.get("response")
        if not isinstance(query, str) or not isinstance(response, str):
            return None
        return {"messages": self._messages(self._fill(query), self._fill(response))}


class DPOProcessor(Preprocessor):
    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def __call__(self, row: dict[str, Any]) -> dict[str, Any] | None:
        prompt = row.get("prompt", row.get("question"))
        chosen = row.get("chosen", row.get("response_chosen"))
        rejected = row.get("rejected", row.get("response_rejected"))
        if not (isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)):
            return None
        return {
            "chosen": {"messages": self._messages(prompt, chosen)},
            "rejected": {"messages": self._messages(prompt, rejected)},
        }


_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")


class MathProcessor(Preprocessor):
    system = "Solve the problem step by step. Put the final number after '####'."

    def __init__(self, system: str | None = None) -> None:
        if system is not None:
            self.system = system

    @staticmethod
    def ground_truth(answer: str) -> str | None:
        m = _ANSWER.search(answer)
        if m:
            return m.group(1).replace(",", "")
        nums = re.findall(r"[-+]?\d*\.?\d+", answer)
        return nums[-1] if nums else None

    def __call__(self, row: dict[str, Any]) -> dict[str, Any] | None:
        q, a = row.get("question"), row.get("answer")
        if not isinstance(q, str) or not isinstance(a, str):
            return None
        return {"messages": self._messages(q), "ground_truth": self.ground_truth(a)}


class GSM8KProcessor(MathProcessor):
    pass


PREPROCESSORS = {
    cls.__name__: cls
    for cls in (SelfCognitionProcessor, DPOProcessor, MathProcessor, GSM8KProcessor)
}
