"""Sample with the unmodified Tinker SDK from sampler weights on a hosted, multi-tenant Twinkle
service: your own, or any user's published ones.

    export TWINKLE_SERVER_URL=https://<the service>   # required
    export MODELSCOPE_TOKEN=<your API key>            # or TWINKLE_SERVER_TOKEN; required
    python cookbook/client/tinker/modelscope/sample.py [--model-path twinkle://...]

The sampling is ../self_host/sample.py's (a chat prompt in the model's template, the tokenizer
from the server, ``--samples`` completions with their mean log-prob); see that script. Without
``--model-path`` it takes your newest sampler checkpoint; with one, any checkpoint you may read,
e.g. the published sampler weights that tinker/modelscope/self_cognition.py prints. What differs
for a hosted service (cookbook/client/_hosted.py): the URL and key must come from the environment
(exit 2 naming the missing variable; no local quick-start server), a hard quota cap (403) ends the
run with ``quota <name> exhausted: ...`` and exit code 3 (rate limits, 429, the SDK waits out by
itself), and the path is a ``twinkle://`` one. Base model: ``TWINKLE_MODEL_ID`` (default
twinkle/tiny-chat). Prints the completions, then one JSON line: the path and the samples.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client", "tinker"), install=False)

import _hosted  # noqa: E402


def main(model_path: str | None, samples: int, max_tokens: int) -> dict:
    _hosted.require_server()  # exits 2 without the URL or key
    sample = _hosted.load_sibling(__file__)  # runs init_tinker_client(): it reads the variables
    path = model_path or sample.newest_sampler_path()
    if path is None:
        raise SystemExit("no sampler checkpoint of yours: pass --model-path twinkle://...")
    return sample.main(_hosted.as_twinkle_path(path), samples, max_tokens)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="twinkle:// sampler weights (default: your newest)")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    _hosted.run(lambda: main(a.model_path, a.samples, a.max_tokens))
