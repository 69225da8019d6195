"""DPO with the unmodified Tinker SDK on a hosted, multi-tenant Twinkle service; the saved state
is published for every user of the service.

    export TWINKLE_SERVER_URL=https://<the service>   # required
    export MODELSCOPE_TOKEN=<your API key>            # or TWINKLE_SERVER_TOKEN; required
    python cookbook/client/tinker/modelscope/dpo.py [--max-steps 8]

The training is ../self_host/dpo.py's (the emoji-preference pairs, reference log-probs from the
model with LoRA disabled, ``importance_sampling`` with ``dpo_beta``); see that script. What differs
for a hosted service (cookbook/client/_hosted.py): the URL and key must come from the environment
(exit 2 naming the missing variable; no local quick-start server), a hard quota cap (403) ends the
run with ``quota <name> exhausted: ...`` and exit code 3 (rate limits, 429, the SDK waits out by
itself), paths are printed as ``twinkle://``, and the saved state is made public. Base model:
``TWINKLE_MODEL_ID`` (default twinkle/tiny-chat). A line per step on stderr, then one JSON line:
losses, margins, accuracies, the state and its published path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

import _hosted  # noqa: E402


def main(max_steps: int, pairs_per_step: int, lr: float, beta: float, sft_weight: float) -> dict:
    _hosted.require_server()  # exits 2 without the URL or key
    dpo = _hosted.load_sibling(__file__)  # runs init_tinker_client(): it reads the two variables
    out = dpo.main(max_steps, pairs_per_step, lr, beta, sft_weight)
    out["state"] = _hosted.as_twinkle_path(out["state"])
    out["published"] = _hosted.publish_tinker(out["state"])
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weight", type=float, default=1.0)
    a = p.parse_args()
    _hosted.run(lambda: main(a.max_steps, a.pairs_per_step, a.lr, a.beta, a.sft_weight))
