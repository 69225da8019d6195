"""The gateway decodes only the ``loss_fn_inputs`` a loss reads (engine.rules.LOSS_FN_INPUTS);
those names must cover everything the engine's losses read, or a request would lose an input."""

from __future__ import annotations

from engine.backends.losses import LOSSES
from engine.backends.tinker_dpo import tinker_dpo
from engine.protocol import DatumInput, ForwardBackwardInput
from engine.rules import CUSTOM_LOSS_FN, LOSS_FN_INPUTS, loss_fn_input_names


def test_every_loss_keeps_the_inputs_its_spec_reads():
    assert set(LOSS_FN_INPUTS) == set(LOSSES)
    for name, spec in LOSSES.items():
        reads = {*spec.inputs, *spec.optional} | (set() if spec.embedding else {"target_tokens"})
        assert reads <= loss_fn_input_names(name), name


def test_upstream_dpo_through_importance_sampling_keeps_what_dpo_reads():
    kept = loss_fn_input_names("importance_sampling")
    dpo = LOSSES["dpo"]
    assert ({"target_tokens", *dpo.inputs, *dpo.optional} - {"ref_logprobs"}) | {
        "ref_logps"
    } <= kept
    lfi = {"target_tokens": [1], "ref_logps": [0.0], "logprobs": [0.0], "advantages": [1.0]}
    datum = DatumInput([1], {k: v for k, v in lfi.items() if k in kept})
    inp = ForwardBackwardInput([datum, datum], "importance_sampling", {"dpo_beta": 0.1})
    assert tinker_dpo(inp).loss_fn == "dpo"  # ref_logps survived the gateway's filter


def test_a_custom_loss_keeps_the_inputs_its_graph_declares():
    graph_inputs = [["logprobs", 1], ["adv", 1], ["mask", 0]]
    assert loss_fn_input_names(CUSTOM_LOSS_FN, graph_inputs) == {"target_tokens", "adv", "mask"}
    assert loss_fn_input_names("no-such-loss") == frozenset()
