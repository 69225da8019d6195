"""`ClientMultiTurnRollout`: multi-turn, tool-using rollouts driven over HTTP (upstream's class and
call contract; our implementation).

Each round samples ONE completion for every still-running trajectory in a single
``sampler.sample`` call. A trajectory continues from the sampler's ``new_input_feature`` (prompt +
everything sampled so far); it ends when the completion hit the token limit, when the running
feature reaches ``max_trajectory_tokens`` (truncated), when the assistant calls no tool, or when it
still calls one at ``max_turns`` (truncated, ``stop_reason='max_turns'``). Tool calls (the last
message's ``tool_calls``, else ``template.parse_tool_call(decoded)``) are run by the trajectory's
tool manager; their answers and the next generation prompt are appended by ``bridge(feature,
tool_messages, template)`` (default: upstream's ``twinkle_agentic`` ``extend_with_bridge``, which
needs upstream's local Template; None from it means "too long": truncated).

Returned: the input trajectories (same order) with the final feature's fields merged in, plus
``messages``, ``logprobs`` (every sampled token's ``[[id, logprob]]``, aligned with the trainable
labels: checked), ``turns``, ``stop_reason`` and ``truncated``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

Bridge = Callable[[dict[str, Any], list[dict[str, Any]], Any], "dict[str, Any] | None"]


def _default_bridge() -> Bridge | None:
    try:  # upstream's agentic package, present where upstream's twinkle is installed
        from twinkle_agentic.rollout.bridge import (  # pyright: ignore[reportMissingImports]
            extend_with_bridge,
        )
    except ImportError:
        return None
    return extend_with_bridge


def _params_dict(params: Any) -> dict[str, Any] | None:
    if params is None or isinstance(params, dict):
        return params
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    return dict(cast(Any, params))  # a mapping-like object


class _State:
    """One trajectory's progress."""

    def __init__(self, feature: dict[str, Any]) -> None:
        self.feature = feature
        self.logprobs: list[Any] = []
        self.turns = 0
        self.stop_reason: str | None = None
        self.truncated = False
        self.done = False


class ClientMultiTurnRollout:
    def __init__(
        self,
        sampler: Any,
        template: Any,
        tool_manager: Any = None,
        sampling_params: Any = None,
        max_turns: int = 6,
        max_trajectory_tokens: int | None = None,
        *,
        bridge: Bridge | None = None,
    ) -> None:
        if template is None:
            raise ValueError("ClientMultiTurnRollout needs a template (it encodes the prompts)")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_trajectory_tokens is not None and max_trajectory_tokens < 1:
            raise ValueError(
                f"max_trajectory_tokens must be >= 1 or None, got {max_trajectory_tokens}"
            )
        params = _params_dict(sampling_params) or {}
        if int(params.get("num_samples", 1) or 1) != 1:
            raise ValueError(
                f"num_samples must be 1 for multi-turn rollouts, got {params['num_samples']}"
            )
        self.sampler, self.template, self.tool_manager = sampler, template, tool_manager
        self.sampling_params = sampling_params
        self.max_turns, self.max_trajectory_tokens = max_turns, max_trajectory_tokens
        self.bridge = bridge

    def __call__(self, trajectories: Sequence[dict[str, Any]], **kwargs: Any) -> list[dict]:
        """Roll out every trajectory; ``kwargs``: ``sampling_params``, ``tool_manager`` (one, or
        one per trajectory) for this call."""
        if isinstance(trajectories, dict):
            raise TypeError("expected a list of trajectories; wrap one as [trajectory]")
        trajs = list(trajectories)
        if not trajs:
            return []
        params = _params_dict(kwargs.get("sampling_params", self.sampling_params))
        managers = kwargs.get("tool_manager", self.tool_manager)
        if isinstance(managers, list):
            if len(managers) != len(trajs):
                raise ValueError(f"{len(managers)} tool managers for {len(trajs)} trajectories")
        else:
            managers = [managers] * len(trajs)
        states = []
        for traj in trajs:
            feature = dict(self.template.encode(traj, add_generation_prompt=True))
            feature.setdefault("messages", list(traj.get("messages", [])))
            states.append(_State(feature))

        for _ in range(self.max_turns):
            live = [i for i, s in enumerate(states) if not s.done]
            if not live:
                break
            responses = self.sampler.sample(
                [states[i].feature for i in live], sampling_params=params
            )
            bridges = []
            for k, i in enumerate(live):
                tools = self._advance(states[i], responses[k].sequences[0], k, i)
                if tools:
                    bridges.append((i, self._run_tools(tools, managers[i], i)))
            for i, tool_messages in bridges:
                self._extend(states[i], tool_messages)

        return [
            self._result(traj, s, i) for i, (traj, s) in enumerate(zip(trajs, states, strict=True))
        ]

    # -- one step of one trajectory ------------------------------------------------------------
    def _advance(self, st: _State, seq: Any, k: int, i: int) -> list[Any] | None:
        """Take a sampled sequence; returns the tool calls to run, or None when it ended."""
        st.turns += 1
        feature = seq.new_input_feature
        if not feature or "input_ids" not in feature:
            raise RuntimeError(
                f"the sampler returned no new_input_feature.input_ids (batch index {k}, "
                f"trajectory {i}): cannot continue the conversation"
            )
        st.feature = dict(feature)
        if seq.logprobs is not None:
            if len(seq.logprobs) != len(seq.tokens):
                raise RuntimeError(
                    f"trajectory {i}, turn {st.turns}: {len(seq.logprobs)} logprobs for "
                    f"{len(seq.tokens)} sampled tokens"
                )
            st.logprobs.extend(seq.logprobs)
        st.stop_reason = seq.stop_reason
        if seq.stop_reason == "length":
            st.done = True
            return None
        cap = self.max_trajectory_tokens
        if cap is not None and len(st.feature.get("input_ids") or []) >= cap:
            st.truncated = st.done = True
            return None
        messages = st.feature.get("messages") or []
        last = messages[-1] if messages else None
        calls = last.get("tool_calls") if isinstance(last, dict) else None
        parse = getattr(self.template, "parse_tool_call", None)
        if not calls and parse is not None:
            calls = parse(seq.decoded or "")
        if not calls:
            st.done = True
            return None
        if st.turns >= self.max_turns:
            st.truncated, st.stop_reason, st.done = True, "max_turns", True
            return None
        return list(calls)

    @staticmethod
    def _run_tools(calls: list[Any], manager: Any, i: int) -> list[dict[str, Any]]:
        if manager is None:
            raise ValueError(f"trajectory {i} called a tool but no tool_manager was given")
        return [{"role": "tool", "content": manager(call)} for call in calls]

    def _extend(self, st: _State, tool_messages: list[dict[str, Any]]) -> None:
        bridge = self.bridge or _default_bridge()
        if bridge is None:
            raise RuntimeError(
                "a tool answer must be appended to the conversation: pass bridge=... or install "
                "upstream's twinkle-kit (twinkle_agentic's extend_with_bridge)"
            )
        extended = bridge(st.feature, tool_messages, self.template)
        if extended is None:  # over the template's max_length
            st.truncated = st.done = True
        else:
            st.feature = dict(extended)

    @staticmethod
    def _result(traj: dict[str, Any], st: _State, i: int) -> dict[str, Any]:
        if st.logprobs:
            trainable = sum(1 for lab in st.feature.get("labels") or [] if lab != -100)
            if trainable != len(st.logprobs):
                raise RuntimeError(
                    f"trajectory {i}: {len(st.logprobs)} logprobs but {trainable} trainable "
                    "labels; old_logps would be misaligned in GRPO"
                )
        out = {**traj, **st.feature}
        out["messages"] = list(st.feature.get("messages") or traj.get("messages", []))
        out["logprobs"] = st.logprobs or None
        out.update(turns=st.turns, stop_reason=st.stop_reason, truncated=st.truncated)
        return out
