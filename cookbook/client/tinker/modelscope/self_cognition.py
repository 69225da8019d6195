"""Self-cognition SFT with the unmodified Tinker SDK on a hosted, multi-tenant Twinkle service,
then sampling the trained adapter; the state and the sampler weights are published for every user
of the service.

    export TWINKLE_SERVER_URL=https://<the service>   # required
    export MODELSCOPE_TOKEN=<your API key>            # or TWINKLE_SERVER_TOKEN; required
    python cookbook/client/tinker/modelscope/self_cognition.py [--max-steps 12]

The training is ../self_host/self_cognition.py's (self_cognition.jsonl in the chat template, loss
on the answer only, the tokenizer from the server); see that script. What differs for a hosted
service (cookbook/client/_hosted.py): the URL and key must come from the environment (exit 2 naming
the missing variable; no local quick-start server), a hard quota cap (403) ends the run with
``quota <name> exhausted: ...`` and exit code 3 (rate limits, 429, the SDK waits out by itself),
paths are printed as ``twinkle://``, and both checkpoints are made public: anyone on the service
can sample the sampler weights (``tinker/modelscope/sample.py --model-path <it>``). Base model:
``TWINKLE_MODEL_ID`` (default twinkle/tiny-chat). A line per step on stderr, then one JSON line:
losses, the paths, the published paths, samples.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

import _hosted  # noqa: E402


def main(max_steps: int, batch_size: int, lr: float) -> dict:
    _hosted.require_server()  # exits 2 without the URL or key
    sft = _hosted.load_sibling(__file__)  # runs init_tinker_client(): it reads the two variables
    out = sft.main(max_steps, batch_size, lr)
    out["state"] = _hosted.as_twinkle_path(out["state"])
    out["sampler_path"] = _hosted.as_twinkle_path(out["sampler_path"])
    out["published"] = [_hosted.publish_tinker(out[k]) for k in ("state", "sampler_path")]
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    a = p.parse_args()
    _hosted.run(lambda: main(a.max_steps, a.batch_size, a.lr))
