"""A process that saves checkpoints of a real tiny-model adapter in a loop, through the real
backend (`TransformersTrainingBackend.save_state` → `write_checkpoint_dir`), for the fault test
that SIGKILLs it mid-write: ``python -m tests.e2e.checkpoint_writer DATA_DIR OUT_DIR``. It
prints "saving" once the first save starts; saves go to OUT_DIR/ckpt-0, ckpt-1, ... It keeps
the last 3 (older ones are renamed to a hidden .deleted-* name, then deleted, so the loop never
fills a disk) and stops by itself after 2000 saves or when its parent is gone."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from engine.backends.registry import build_training_backend
from engine.base_models.registry import resolve_model_dir
from engine.config import ModelConfig
from engine.protocol import LoraSpec


def main(data_dir: str, out: str) -> None:
    model = ModelConfig(name="twinkle/tiny-chat")
    resolve_model_dir(model.name, data_dir, model.path)
    backend = build_training_backend(model, data_dir)
    backend.create_adapter("a", LoraSpec(rank=32))
    sys.stdout.write("saving\n")
    sys.stdout.flush()
    parent = os.getppid()
    for i in range(2000):  # until killed
        backend.save_state("a", str(Path(out) / f"ckpt-{i}"), include_optimizer=True)
        old = Path(out) / f"ckpt-{i - 3}"
        if old.exists():  # rename first: a kill mid-rmtree must not leave a torn listed dir
            trash = Path(out) / f".deleted-{old.name}"
            os.rename(old, trash)
            shutil.rmtree(trash)
        if os.getppid() != parent:
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
