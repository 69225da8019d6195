"""The unmodified tinker 0.38.0 SDK trains a LoRA on twinkle/tiny-chat through `twinkle serve`
and samples from it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"

# Small fixed data: deterministic token sequences (ids well inside the 2048-token vocab).
_rng = np.random.default_rng(1234)
SEQS = [(_rng.integers(10, 500, size=12)).tolist() for _ in range(4)]


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    target = tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": target, "weights": weights or [1.0] * len(target)},
    )


DATA = [datum(s) for s in SEQS]
N_TOKENS = sum(len(s) - 1 for s in SEQS)
ADAM = types.AdamParams(learning_rate=1e-2)


def train_step(tc, data=DATA) -> float:
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(ADAM)
    out = fb.result()
    opt.result()
    return out.metrics["loss:sum"] / N_TOKENS


@pytest.fixture(scope="module")
def service(server, api_key):
    sc = tinker.ServiceClient(base_url=server.url, api_key=api_key)
    yield sc
    sc.close("success")


def test_sft_loop_save_resume_and_sample(service):
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=7)
    assert tc.get_info().model_data.model_name == BASE
    losses = []
    state_path = None
    for step in range(30):
        losses.append(train_step(tc))
        if step == 19:
            state_path = tc.save_state("mid").result().path
            assert state_path == f"tinker://{tc.model_id}/weights/mid"
            # The next step of the original run, measured by forward on the same data.
            original_next = tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    assert losses[-1] <= losses[0] / 2, losses

    resumed = service.create_training_client_from_state_with_optimizer(state_path)
    resumed_loss = resumed.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    assert resumed_loss == pytest.approx(original_next, abs=1e-5)

    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(SEQS[0][:5])
    res = sampler.sample(
        prompt,
        num_samples=4,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3),
    ).result()
    assert len(res.sequences) == 4
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)

    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    a = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    b = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    assert a == b

    lps = sampler.compute_logprobs(types.ModelInput.from_ints(SEQS[1])).result()
    assert len(lps) == len(SEQS[1])
    assert lps[0] is None and all(lp is not None and lp <= 0 for lp in lps[1:])


def test_resume_reproduces_next_step_loss(service):
    """Train, save_state with optimizer, take one more step; a client created from the state takes
    the same step and gets the same loss."""
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=11)
    for _ in range(3):
        train_step(tc)
    path = tc.save_state("s3").result().path
    train_step(tc)  # step 4 of the original
    after_original = tc.forward(DATA, "cross_entropy").result().metrics["loss:sum"]

    resumed = service.create_training_client_from_state_with_optimizer(path)
    train_step(resumed)  # step 4 of the resumed run: needs the AdamW moments to match
    after_resumed = resumed.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    assert after_resumed == pytest.approx(after_original, abs=1e-5)

    # Without optimizer state the moments restart, so the step differs (the test can fail).
    fresh = service.create_training_client_from_state(path)
    train_step(fresh)
    after_fresh = fresh.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    assert not math.isclose(after_fresh, after_original, abs_tol=1e-5)


def test_named_sampler_weights_and_checkpoint_listing(server, api_key, service):
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=1)
    train_step(tc)
    path = tc.save_weights_for_sampler("final").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/final"
    sc = service.create_sampling_client(model_path=path)
    out = sc.sample(
        types.ModelInput.from_ints(SEQS[2][:4]),
        2,
        types.SamplingParams(max_tokens=3, temperature=0.0),
    ).result()
    assert len(out.sequences) == 2 and out.sequences[0].tokens == out.sequences[1].tokens

    rest = service.create_rest_client()
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in ckpts] == ["sampler_weights/final"]
    runs = rest.list_training_runs().result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_rl_losses_through_the_sdk(service, loss_fn):
    """An RL step built from sampled completions: sample, then train on them with the sampler's
    logprobs and advantages (gspo: its sequence ratio over the sampled tokens, as the cookbook's
    rl_loop builds it)."""
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQS[3][:4]
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        4,
        types.SamplingParams(max_tokens=5, temperature=1.0, seed=1),
    ).result()
    data = []
    for i, seq in enumerate(res.sequences):
        toks = prompt + seq.tokens
        n_prompt = len(prompt) - 1
        adv = 1.0 if i % 2 == 0 else -1.0
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [adv] * len(seq.tokens),
                },
            )
        )
        if loss_fn == "gspo":
            mask = [0.0] * n_prompt + [1.0] * len(seq.tokens)
            data[-1].loss_fn_inputs["sequence_ratio_mask"] = types.TensorData.from_numpy(
                np.asarray(mask, np.float32)
            )
    out = tc.forward_backward(data, loss_fn).result()
    assert math.isfinite(out.metrics["loss:sum"])
    # the learner's logprobs of the sampled tokens equal the sampler's (same weights, B = 0)
    for d, seq in zip(out.loss_fn_outputs, res.sequences, strict=True):
        lp = d["logprobs"].tolist()[-len(seq.tokens) :]
        np.testing.assert_allclose(lp, seq.logprobs, atol=1e-4)
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert step.metrics["grad_norm"] > 0


def _rl_datum(prompt: list[int], seq, advantage: float, sequence_id: str) -> types.Datum:
    """tinker-cookbook 0.6.1 ``recipes/rl_loop.py``'s datum and its ``with_sampled_provenance``."""
    toks, ob = list(seq.tokens), len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + toks[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * ob + toks,
            "logprobs": [0.0] * ob + list(seq.logprobs),
            "advantages": [0.0] * ob + [advantage] * len(toks),
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(toks) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=ob),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(toks)),
        ],
    )


def test_stable_reinforce_with_stability_info_and_provenance(service):
    """rl_loop's stable_reinforce step through the unmodified SDK: a sampling client with
    record_stability_info, datums naming its sequences, forward_backward + optim_step; the loss
    is finite and the stability metrics are there. A span naming no recorded sequence is refused
    naming the datum and span, and the model keeps training."""
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()
    prompt = SEQS[0][:5]
    for step in range(2):
        sc = tc.save_weights_and_get_sampling_client(record_stability_info=True)
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3 + step)
        res = sc.sample(types.ModelInput.from_ints(prompt), 4, params).result()
        ids = [s.sequence_id for s in res.sequences]
        assert len(set(ids)) == 4 and all(ids)
        adv = [1.0, -1.0, 0.5, -0.5]
        data = [
            _rl_datum(prompt, s, a, s.sequence_id) for s, a in zip(res.sequences, adv, strict=True)
        ]
        fb = tc.forward_backward(data, "stable_reinforce").result()
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        m = fb.metrics
        assert math.isfinite(m["loss:sum"]), m
        for key in ("sr_masked_frac:mean", "sr_ratio:mean", "sr_kl:mean"):
            assert math.isfinite(m[key]), m
        assert m["sr_sampled_tokens:sum"] == sum(len(s.tokens) for s in res.sequences)
        assert m["sr_ratio:mean"] == pytest.approx(1.0, abs=0.05)  # sampled from these weights
        assert len(fb.loss_fn_outputs) == 4 and "logprobs" in fb.loss_fn_outputs[0]
        assert opt is not None
    bad = _rl_datum(prompt, res.sequences[0], 1.0, "not-a-sequence:0")
    with pytest.raises(
        tinker.RequestFailedError,
        match=r"data\[0\]\.model_input_spans\[0\]\.prompt_tokens\.sequence_id: 'not-a-sequence:0'",
    ):
        tc.forward_backward([bad], "stable_reinforce").result()
    assert math.isfinite(tc.forward_backward(data, "stable_reinforce").result().metrics["loss:sum"])


def test_topk_and_last_n_prompt_logprobs_through_the_sdk(service):
    """topk_prompt_logprobs / topk_sample_logprobs / prompt_logprobs_last_n reach the SDK in its
    own types (the SDK itself checks that last_n was honoured)."""
    sc = service.create_sampling_client(base_model=BASE)
    prompt = types.ModelInput.from_ints(SEQS[2])
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    res = sc.sample(
        prompt,
        1,
        params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        prompt_logprobs_last_n=4,
    ).result()
    n = len(SEQS[2])
    assert res.prompt_logprobs[: n - 4] == [None] * (n - 4)
    assert all(lp is not None for lp in res.prompt_logprobs[n - 4 :])
    topk = res.topk_prompt_logprobs  # list per position: None or [(token, logprob)] * 3
    assert len(topk) == n and all(row is None for row in topk[: n - 4])
    for pos in range(n - 4, n):
        row = topk[pos]
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
        # the prompt token's own logprob is at most the best alternative's
        assert res.prompt_logprobs[pos] <= row[0][1] + 1e-6
    seq = res.sequences[0]
    top = seq.topk_logprobs  # greedy: the chosen token is the most likely one
    assert [r[0][0] for r in top] == seq.tokens
    assert [r[0][1] for r in top] == pytest.approx(seq.logprobs, abs=1e-5)


def test_target_prompt_logprobs_and_alt_tokens_through_the_sdk(service):
    """Dense and sparse target_prompt_logprobs come back in the request's layout and agree with
    prompt_logprobs where they name the prompt token; prompt_alt_tokens has Tinker's shape."""
    import torch

    sc = service.create_sampling_client(base_model=BASE)
    toks = SEQS[3]
    n = len(toks)
    prompt = types.ModelInput.from_ints(toks)
    params = types.SamplingParams(max_tokens=1, temperature=0.7, seed=1)
    ids = torch.full((n - 1, 2), -1, dtype=torch.int64)
    ids[:, 0] = torch.tensor(toks[1:])  # the prompt's own next tokens
    ids[3, 1] = 7
    for target in (
        types.TensorData.from_torch(ids),
        types.TensorData.from_torch_sparse(ids, pad_value=-1),
    ):
        res = sc.sample(
            prompt,
            1,
            params,
            include_prompt_logprobs=True,
            target_prompt_logprobs=target,
            prompt_alt_tokens_k=3,
        ).result()
        got = res.target_prompt_logprobs.to_torch()
        got = got.to_dense() if got.is_sparse or got.layout != torch.strided else got
        assert list(got.shape) == [n - 1, 2]
        assert got[:, 0].tolist() == pytest.approx(res.prompt_logprobs[1:], abs=1e-5)
        assert got[3, 1] < 0 and got[0, 1] == 0.0
        alt = res.prompt_alt_tokens
        assert alt.tokens.shape == [n - 1, 3] and alt.logprobs.shape == [n - 1, 3]
