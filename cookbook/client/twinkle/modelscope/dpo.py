"""DPO with the native client on a hosted, multi-tenant Twinkle service; the checkpoint is
published for every user of the service.

    export TWINKLE_SERVER_URL=https://<the service>   # required
    export MODELSCOPE_TOKEN=<your API key>            # or TWINKLE_SERVER_TOKEN; required
    python cookbook/client/twinkle/modelscope/dpo.py [--max-steps 6]

The training is ../self_host/dpo.py's (the emoji-preference pairs, the reference being the model
with LoRA disabled, ``DPOLoss`` + ``DPOMetric``); see that script. What differs for a hosted
service (cookbook/client/_hosted.py): the URL and key must come from the environment (exit 2 naming
the missing variable; no local quick-start server), rate limits (429) are waited out with a line
on stderr per wait, a hard quota cap (403) ends the run with ``quota <name> exhausted: ...`` and
exit code 3, and the saved checkpoint is made public. Base model: ``TWINKLE_MODEL_ID`` (default
twinkle/tiny-chat). A line per step on stderr, then one JSON line: losses, margins, the checkpoint
and its published ``twinkle://`` path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client",), install=False)  # a plain `python` in the repo: .venv

import _hosted  # noqa: E402


def main(max_steps: int, pairs_per_step: int, lr: float, beta: float) -> dict:
    client = _hosted.native_client()  # exits 2 without the URL or key
    dpo = _hosted.load_sibling(__file__)
    out = dpo.main(max_steps, pairs_per_step, lr, beta, client=client)
    out["published"] = _hosted.publish_native(client, out["checkpoint"])
    client.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--beta", type=float, default=0.1)
    a = p.parse_args()
    _hosted.run(lambda: main(a.max_steps, a.pairs_per_step, a.lr, a.beta))
