"""API parity of twinkle_client with upstream Twinkle's client (twinkle-kit 0.5.1) and with the
engine's in-process class.

1. Upstream: every public method of upstream's ``MultiLoraTransformersModel``, ``vLLMSampler`` and
   ``TwinkleClient`` is on ours with the same parameters (names, kinds, defaults; ours may add a
   default, and keyword-only extras such as ``client=``), so upstream's scripts run unchanged.
   `UPSTREAM` records upstream's signatures; when upstream's package is at hand
   (``<repo>/.cache/twinkle-kit-0.5.1``, or ``$TWINKLE_UPSTREAM_SITE``), the record is checked
   against its source.
2. Engine: every public method of ``engine.local.model.MultiLoraTransformersModel`` exists on the
   client and accepts the engine's positional arguments ("change the import").
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel
from twinkle_client.rollout import ClientMultiTurnRollout
from twinkle_client.sampler import vLLMSampler

# upstream twinkle_client 0.5.1, read from its source: "name[=default]" in order, "*" before
# keyword-only parameters, "**" for **kwargs
UPSTREAM: dict[str, dict[str, str]] = {
    "MultiLoraTransformersModel": {
        "__init__": "model_id, **",
        "add_adapter_to_model": "adapter_name, config=None, **",
        "forward": "inputs, **",
        "forward_only": "inputs, **",
        "calculate_loss": "**",
        "get_train_configs": "**",
        "backward": "**",
        "forward_backward": "inputs, **",
        "step": "**",
        "zero_grad": "**",
        "lr_step": "**",
        "clip_grad_norm": "max_grad_norm=1.0, norm_type=2, **",
        "clip_grad_and_step": "max_grad_norm=1.0, norm_type=2, **",
        "set_loss": "loss_cls, **",
        "set_optimizer": "optimizer_cls, **",
        "set_lr_scheduler": "scheduler_cls, **",
        "save": "name, **",
        "load": "name, **",
        "resume_from_checkpoint": "name, *, resume_only_model=False, **",
        "apply_patch": "patch_cls, **",
        "add_metric": "metric_cls, is_training=None, **",
        "set_template": "template_cls, **",
        "set_processor": "processor_cls, **",
        "calculate_metric": "is_training=True, **",
        "get_state_dict": "**",
        "upload_to_hub": "checkpoint_dir, hub_model_id, hub_token=None, async_upload=True, poll_interval=5.0",  # noqa: E501
    },
    "vLLMSampler": {
        "__init__": "model_id, **",
        "add_adapter_to_sampler": "adapter_name, config, **",
        "sample": "inputs, sampling_params=None, adapter_name='', adapter_uri=None, num_samples=1",
        "set_template": "template_cls, adapter_name='', **",
        "apply_patch": "patch_cls, **",
    },
    "ClientMultiTurnRollout": {
        "__init__": "sampler, template, tool_manager=None, sampling_params=None, max_turns=6, max_trajectory_tokens=None",  # noqa: E501
    },
    "TwinkleClient": {
        "__init__": "base_url=None, api_key=None, route_prefix='/twinkle', session_heartbeat_interval=10, session_metadata=None",  # noqa: E501
        "get_capacity_info": "",
        "create_session": "metadata=None",
        "close": "",
        "health_check": "",
        "get_server_capabilities": "",
        "list_training_runs": "limit=20, offset=0, all_users=False",
        "list_training_runs_with_cursor": "limit=20, offset=0, all_users=False",
        "get_training_run": "run_id",
        "list_checkpoints": "run_id",
        "get_checkpoint_path": "run_id, checkpoint_id",
        "get_checkpoint_twinkle_path": "run_id, checkpoint_id",
        "delete_checkpoint": "run_id, checkpoint_id",
        "get_weights_info": "twinkle_path",
        "get_latest_checkpoint_path": "run_id",
        "find_training_run_by_model": "base_model",
    },
}
OURS = {
    "MultiLoraTransformersModel": RemoteModel,
    "vLLMSampler": vLLMSampler,
    "TwinkleClient": TwinkleClient,
    "ClientMultiTurnRollout": ClientMultiTurnRollout,
}
UPSTREAM_FILES = {
    "MultiLoraTransformersModel": "model/multi_lora_transformers.py",
    "vLLMSampler": "sampler/vllm_sampler.py",
    "TwinkleClient": "manager.py",
    "ClientMultiTurnRollout": "rollout/multi_turn.py",
}
# engine members the client lacks, each with its reason
NOT_ON_CLIENT = {
    # engine-side bookkeeping (the gateway lists a model's adapters to release them when a
    # session ends); upstream's client has no such property
    "adapter_names",
}


def _spec(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _ours(fn) -> list[str]:
    out, star = [], False
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            out.append("**")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


def _compatible(upstream: list[str], ours: list[str]) -> bool:
    """Same names, kinds and defaults in order; ours may add a default or keyword-only extras."""
    extra_kw = [
        p
        for p in ours
        if "*" not in p and p.split("=")[0] not in {u.split("=")[0] for u in upstream}
    ]
    ours = [p for p in ours if p not in extra_kw]
    if ours and ours[-1] == "*" and "*" not in upstream:
        ours = ours[:-1]
    if "**" in ours and "**" not in upstream:  # ours accepting more is fine
        ours = [p for p in ours if p != "**"]
    if (
        ours.count("*")
        and ours.index("*") == len(ours) - 1 - ours[::-1].index("*")
        and (ours[-1] == "*" or (ours[-1] == "**" and ours[-2] == "*"))
    ):
        ours.remove("*")
    if len(ours) != len(upstream):
        return False
    for u, o in zip(upstream, ours, strict=True):
        if u != o and not ("=" not in u and o.split("=")[0] == u):
            return False
    return True


@pytest.mark.parametrize("cls", sorted(UPSTREAM))
def test_upstream_methods_are_ours_with_the_same_parameters(cls: str) -> None:
    ours = OURS[cls]
    bad = {}
    for name, spec in UPSTREAM[cls].items():
        fn = getattr(ours, name, None)
        assert fn is not None, f"{cls}.{name} is missing"
        if not _compatible(_spec(spec), _ours(fn)):
            bad[name] = (spec, ", ".join(_ours(fn)))
    assert not bad, bad


def test_the_comparison_sees_differences() -> None:
    assert _compatible(_spec("name, **"), ["name", "**"])
    assert _compatible(_spec("model_id, **"), ["model_id", "*", "client=None", "**"])
    assert _compatible(_spec("run_id, checkpoint_id"), ["run_id", "checkpoint_id=None"])
    assert not _compatible(_spec("name, **"), ["name"])  # no **kwargs: upstream's extras fail
    assert not _compatible(_spec("loss_cls, **"), ["loss", "**"])
    assert not _compatible(_spec("is_training=True, **"), ["is_training=False", "**"])
    assert not _compatible(_spec("a, b=1"), ["b=1", "a"])


def _upstream_site() -> Path | None:
    env = os.environ.get("TWINKLE_UPSTREAM_SITE")
    if env:
        return Path(env)
    venv = Path(__file__).resolve().parents[2] / ".cache" / "twinkle-kit-0.5.1"
    found = sorted(venv.glob("lib/python*/site-packages"))
    return found[0] if found else None


def test_the_record_matches_upstream_source() -> None:
    site = _upstream_site()
    if site is None or not (site / "twinkle_client" / "manager.py").is_file():
        pytest.skip("upstream twinkle-kit 0.5.1 not installed at .cache/twinkle-kit-0.5.1")
    for cls, rel in UPSTREAM_FILES.items():
        tree = ast.parse((site / "twinkle_client" / rel).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        found = {}
        for fn in node.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            if fn.name.startswith("_") and fn.name != "__init__":
                continue
            a = fn.args
            defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
            parts = [
                x.arg + (f"={ast.unparse(d)}" if d is not None else "")
                for x, d in zip(a.args[1:], defaults[1:], strict=True)
            ]
            if a.kwonlyargs:
                parts.append("*")
                parts += [
                    x.arg + (f"={ast.unparse(d)}" if d is not None else "")
                    for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
                ]
            if a.kwarg:
                parts.append("**")
            found[fn.name] = ", ".join(parts)
        assert found == UPSTREAM[cls], cls


def test_every_engine_method_is_on_the_client_and_takes_its_positional_arguments() -> None:
    from engine.local.model import MultiLoraTransformersModel as LocalModel

    local = {
        n: inspect.getattr_static(LocalModel, n)
        for n in dir(LocalModel)
        if not n.startswith("_") and n not in dir(object)
    }
    assert len(local) >= 20, sorted(local)  # not vacuous: the training API is there
    missing = sorted(set(local) - set(dir(RemoteModel)) - NOT_ON_CLIENT)
    assert not missing, f"on the engine class but not on twinkle_client: {missing}"
    assert not NOT_ON_CLIENT & set(dir(RemoteModel)), "listed as missing but present: drop it"
    for name, member in local.items():
        if name in NOT_ON_CLIENT or isinstance(member, property):
            continue
        required = [
            p
            for p in list(inspect.signature(member).parameters.values())[1:]
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
        ]
        remote = inspect.signature(getattr(RemoteModel, name))
        remote.bind(None, *[object()] * len(required))  # raises if it cannot take them
