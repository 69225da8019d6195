"""Vision-language LoRA SFT with the native client on a hosted, multi-tenant Twinkle service, then
reading the images back; the adapter is published for every user of the service.

    export TWINKLE_SERVER_URL=https://<the service>   # required
    export MODELSCOPE_TOKEN=<your API key>            # or TWINKLE_SERVER_TOKEN; required
    python cookbook/client/twinkle/modelscope/multi_modal.py [--max-steps 60]

The training is ../self_host/multi_modal.py's (the shipped OCR-style images in ``<image>``
messages, encoded by the server's template, LoRA on ``twinkle/tiny-vl``; see that script). What
differs for a hosted service (cookbook/client/_hosted.py): the URL and key must come from the
environment (exit 2 naming the missing variable; no local quick-start server), rate limits (429)
are waited out with a line on stderr per wait, a hard quota cap (403) ends the run with
``quota <name> exhausted: ...`` and exit code 3, and the saved adapter is made public. Base
model: ``TWINKLE_VL_MODEL_ID`` (default twinkle/tiny-vl). One JSON line at the end: losses, the
checkpoint and its published ``twinkle://`` path, what each image was read as.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _bootstrap import ensure_venv  # noqa: E402  (cookbook/client, put on sys.path)

ensure_venv(__file__, ("twinkle_client",), install=False)  # a plain `python` in the repo: .venv

import _hosted  # noqa: E402


def main(max_steps: int, lr: float) -> dict:
    client = _hosted.native_client()  # exits 2 without the URL or key
    vl = _hosted.load_sibling(__file__)
    out = vl.main(max_steps, lr, client=client)
    out["published"] = _hosted.publish_native(client, out["checkpoint"])
    client.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-3)
    a = p.parse_args()
    _hosted.run(lambda: main(a.max_steps, a.lr))
