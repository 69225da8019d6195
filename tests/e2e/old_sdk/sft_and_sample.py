"""Run by an older tinker SDK (its own venv): a small SFT loop, a forward, and greedy sampling.

Prints one JSON line with the SDK version, the losses, the forward loss and the sampled tokens, so
the test can compare them with the same run through SDK 0.38.0.
Usage: python sft_and_sample.py URL KEY
"""

import json
import sys

import numpy as np
import tinker
from tinker import types

url, key = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(4321)
seqs = [rng.integers(10, 500, size=11).tolist() for _ in range(3)]
data = [
    types.Datum(
        model_input=types.ModelInput.from_ints(s[:-1]),
        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
    )
    for s in seqs
]
sc = tinker.ServiceClient(base_url=url, api_key=key)
tc = sc.create_lora_training_client(base_model="twinkle/tiny-chat", rank=4, seed=13)
losses = []
for _ in range(4):
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    losses.append(fb.result().metrics["loss:sum"])
    opt.result()
fwd = tc.forward(data, "cross_entropy").result()
sampler = tc.save_weights_and_get_sampling_client(name="old-sdk")
res = sampler.sample(
    prompt=types.ModelInput.from_ints(seqs[0][:4]),
    num_samples=2,
    sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0),
).result()
print(
    json.dumps(
        {
            "version": tinker.__version__,
            "losses": losses,
            "forward": fwd.metrics["loss:sum"],
            "logprobs0": fwd.loss_fn_outputs[0]["logprobs"].tolist(),
            "tokens": [list(s.tokens) for s in res.sequences],
            "sample_logprobs": [list(s.logprobs or []) for s in res.sequences],
        }
    )
)
