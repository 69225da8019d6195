"""Against a real `twinkle serve`: train a LoRA with the Tinker SDK, save it for sampling, then chat
with it through the official `openai` package (streaming and not, greedy), and check the text
against the Tinker SDK's own sample of the same prompt."""

from __future__ import annotations

import openai
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
MESSAGES = [{"role": "user", "content": "Where did the cat sit?"}]
ANSWER = " The cat sat on the mat."


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer  # the test may; the gateway never does

    return AutoTokenizer.from_pretrained(str(server.data_dir / "models" / "tiny-chat"))


@pytest.fixture(scope="module")
def trained(server, api_key, tokenizer):
    """(sampler checkpoint path, tinker ServiceClient) after a short SFT on one chat turn."""
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer.encode(prompt, add_special_tokens=False)
    a_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = p_ids + a_ids
    weights = [0.0] * (len(p_ids) - 1) + [1.0] * len(a_ids)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )
    service = tinker.ServiceClient(base_url=server.url, api_key=api_key)
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=5)
    for _ in range(25):
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        fb.result()
        opt.result()
    path = tc.save_weights_for_sampler("oai").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/oai"
    yield path, service, p_ids
    service.close("success")


def test_openai_chat_with_a_trained_lora(server, api_key, trained, tokenizer):
    path, service, p_ids = trained
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
    assert path in [m.id for m in client.models.list().data]

    kw = {"model": path, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage == whole.usage
    assert whole.usage.prompt_tokens == len(p_ids)

    # the same greedy sample through the Tinker SDK, from the same checkpoint
    sc = service.create_sampling_client(model_path=path)
    res = sc.sample(
        types.ModelInput.from_ints(p_ids),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=16, temperature=0.0),
    ).result()
    tokens = res.sequences[0].tokens
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert whole.usage.completion_tokens == len(tokens)
    # the adapter is applied: the base model answers differently
    base = client.chat.completions.create(**{**kw, "model": BASE})
    assert base.choices[0].message.content != text

    # a stop string is cut from the text, also through the real server
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = client.chat.completions.create(**kw, stop=stop)
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_openai_rejects_other_users_checkpoint_and_unknown_models(server, trained):
    path, _, _ = trained
    other = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.create_key("mallory"), max_retries=0
    )
    with pytest.raises(openai.NotFoundError) as ei:
        other.chat.completions.create(model=path, messages=MESSAGES, max_tokens=2)
    assert "model" in str(ei.value)
    assert path not in [m.id for m in other.models.list().data]
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model="no/such-model", prompt="hi", max_tokens=2)
