"""Writes the cookbook's OCR-style image set: short formulas drawn black on white, 112x28 pixels
(on the tiny VL model: 8x2 patches of 14, merged 2x2 = 4 image tokens each), with their text as
the target. The PNGs and ``ocr/labels.jsonl`` are shipped in the repo (generated once with
Pillow's built-in font; re-running rewrites them), so every machine trains on the same bytes.

    python cookbook/client/data/make_ocr_images.py
"""

from __future__ import annotations

import io
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "ocr"
LABELS = ["12+7", "3*5", "a^2", "x-9", "40/8", "b+c", "6*6", "k=3"]
SIZE = (112, 28)


def render(label: str) -> bytes:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("L", SIZE, 255)
    # Pillow's bundled font at 22 px: glyphs fill the 28-pixel rows of patches
    font = ImageFont.load_default(size=22)
    ImageDraw.Draw(img).text((4, 1), label, fill=0, font=font)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def main() -> None:
    OUT.mkdir(exist_ok=True)
    rows = []
    for i, label in enumerate(LABELS):
        name = f"{i:02d}.png"
        (OUT / name).write_bytes(render(label))
        rows.append({"image": name, "text": label})
    (OUT / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} images to {OUT}")


if __name__ == "__main__":
    main()
