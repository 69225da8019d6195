"""GRPO on short arithmetic word problems with the unmodified Tinker SDK on a hosted,
multi-tenant Twinkle service; the final state is published for every user of the service.

    export TWINKLE_SERVER_URL=https://<the service>   # required
    export MODELSCOPE_TOKEN=<your API key>            # or TWINKLE_SERVER_TOKEN; required
    python cookbook/client/tinker/modelscope/short_math_grpo.py [--max-steps 4 --reward exact]

The loop is ../self_host/short_math_grpo.py's (per step: a sampler of the current policy,
``--generations`` completions per question, rewards, group-mean advantages,
``forward_backward(..., "importance_sampling")`` + ``optim_step``); see that script. What differs
for a hosted service (cookbook/client/_hosted.py): the URL and key must come from the environment
(exit 2 naming the missing variable; no local quick-start server), a hard quota cap (403) ends the
run with ``quota <name> exhausted: ...`` and exit code 3 (rate limits, 429, on training or sampling
tokens, the SDK waits out by itself), paths are printed as ``twinkle://``, and the final state is
made public. Base model: ``TWINKLE_MODEL_ID`` (default twinkle/tiny-chat). A line per step on
stderr, then one JSON line: per-step rewards and losses, the state and its published path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

import _hosted  # noqa: E402


def main(
    max_steps: int,
    batch_size: int,
    generations: int,
    max_tokens: int,
    lr: float,
    seed: int | None,
    kind: str,
) -> dict:
    _hosted.require_server()  # exits 2 without the URL or key
    grpo = _hosted.load_sibling(__file__)  # runs init_tinker_client(): it reads the two variables
    out = grpo.main(max_steps, batch_size, generations, max_tokens, lr, seed, kind)
    out["state"] = _hosted.as_twinkle_path(out["state"])
    out["published"] = _hosted.publish_tinker(out["state"])
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2, help="questions per step")
    p.add_argument("--generations", type=int, default=4, help="completions per question")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=None, help="data order and sampling seed")
    p.add_argument("--reward", choices=("exact", "shaped"), default="exact")
    a = p.parse_args()
    args = (a.max_steps, a.batch_size, a.generations, a.max_tokens, a.lr, a.seed, a.reward)
    _hosted.run(lambda: main(*args))
