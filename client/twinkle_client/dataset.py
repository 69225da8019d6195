"""`Dataset` and `DatasetMeta`: rows loaded on the client, transformed by preprocessors, encoded
through the server's templates.

Sources: local ``.jsonl``, ``.json`` (a list of rows, or ``{"data": [...]}``), ``.csv`` and
``.parquet`` (needs the ``parquet`` extra: pyarrow). ``ms://`` (ModelScope) and ``hf://``
(Hugging Face) ids load through the ``modelscope`` / ``datasets`` library when it is installed and
the hub answers; otherwise a `DatasetError` says so and what to do (download the file, pass its
path). Rows are plain dicts; everything is in memory (the client trains small-to-medium sets).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client._client import TwinkleError
from twinkle_client.preprocessor import PREPROCESSORS


class DatasetError(TwinkleError):
    """A dataset cannot be loaded or transformed (the message says why and what to do)."""


@dataclass
class DatasetMeta:
    """Where a dataset comes from: a local path, ``ms://org/name`` or ``hf://org/name``.
    ``data_slice`` (e.g. ``range(500)``) keeps only those rows."""

    dataset_id: str
    subset_name: str | None = None
    split: str = "train"
    data_slice: Any = None


def _read_local(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"dataset_id: no such file {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        data = data.get("data", data) if isinstance(data, Mapping) else data
        if not isinstance(data, list):
            raise DatasetError(f"{path.name}: expected a JSON list of rows (or {{'data': [...]}})")
        return list(data)
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return [dict(r) for r in csv.DictReader(f)]
    if suffix == ".parquet":
        try:
            # optional extra (twinkle-client[parquet]), absent from the dev environment
            import pyarrow.parquet as pq  # pyright: ignore[reportMissingImports]
        except ImportError:
            raise DatasetError(
                f"{path.name}: parquet needs pyarrow (pip install 'twinkle-client[parquet]')"
            ) from None
        return pq.read_table(path).to_pylist()
    raise DatasetError(
        f"{path.name}: unsupported format {suffix or '(none)'}; use .jsonl, .json, .csv or .parquet"
    )


def _read_hub(meta: DatasetMeta) -> list[dict[str, Any]]:
    hub, name = meta.dataset_id.split("://", 1)
    lib = "modelscope" if hub == "ms" else "datasets"
    try:
        if hub == "ms":
            # optional hub libraries, absent from the dev environment
            from modelscope.msdatasets import MsDataset  # pyright: ignore[reportMissingImports]

            ds = MsDataset.load(name, subset_name=meta.subset_name, split=meta.split)
        else:
            from datasets import load_dataset  # pyright: ignore[reportMissingImports]

            ds = load_dataset(name, meta.subset_name, split=meta.split)
    except ImportError:
        raise DatasetError(
            f"dataset_id {meta.dataset_id!r}: loading from the {hub}:// hub needs the {lib!r} "
            "library, which is not installed; download the data and pass a local file path"
        ) from None
    except Exception as exc:  # network errors differ per library: report them all the same way
        raise DatasetError(
            f"dataset_id {meta.dataset_id!r}: the {hub}:// hub is not reachable or refused "
            f"({type(exc).__name__}: {exc}); download the data and pass a local file path"
        ) from None
    return [dict(r) for r in ds]


class Dataset:
    def __init__(self, dataset_meta: DatasetMeta | str | list[dict[str, Any]], **_: Any) -> None:
        if isinstance(dataset_meta, list):
            self.rows = [dict(r) for r in dataset_meta]
            return
        meta = DatasetMeta(dataset_meta) if isinstance(dataset_meta, str) else dataset_meta
        if meta.dataset_id.startswith(("ms://", "hf://")):
            rows = _read_hub(meta)
        else:
            rows = _read_local(Path(meta.dataset_id).expanduser())
        if meta.data_slice is not None:
            rows = [rows[i] for i in meta.data_slice if i < len(rows)]
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def map(
        self,
        preprocessor: str | Callable[[dict[str, Any]], Any],
        init_args: Mapping[str, Any] | None = None,
    ) -> Dataset:
        """Apply a preprocessor (a callable, or a name from `preprocessor.PREPROCESSORS` built
        with ``init_args``) to every row; None drops the row, a list gives several. In place;
        returns self."""
        if isinstance(preprocessor, str):
            cls = PREPROCESSORS.get(preprocessor)
            if cls is None:
                raise DatasetError(
                    f"preprocessor: unknown {preprocessor!r}; known: "
                    f"{', '.join(sorted(PREPROCESSORS))}"
                )
            preprocessor = cls(**dict(init_args or {}))
        out: list[dict[str, Any]] = []
        for row in self.rows:
            res = preprocessor(row)
            if res is None:
                continue
            out.extend(res if isinstance(res, list) else [res])
        self.rows = out
        return self

    def filter(self, keep: Callable[[dict[str, Any]], bool]) -> Dataset:
        self.rows = [r for r in self.rows if keep(r)]
        return self

    def shuffle(self, seed: int = 0) -> Dataset:
        random.Random(seed).shuffle(self.rows)
        return self

    def encode(self, template: Any, add_generation_prompt: bool = False) -> Dataset:
        """Encode trajectory rows with a `twinkle_client.template.Template` (through the server):
        ``{"messages"}`` rows become ``{"input_ids", "labels", ...}``; DPO rows (``chosen`` /
        ``rejected`` trajectories) get both encoded in place."""
        plain = [i for i, r in enumerate(self.rows) if "messages" in r]
        pairs = [i for i, r in enumerate(self.rows) if "chosen" in r and "rejected" in r]
        if plain:
            feats = template.batch_encode([self.rows[i] for i in plain], add_generation_prompt)
            for i, f in zip(plain, feats, strict=True):
                self.rows[i] = f
        for side in ("chosen", "rejected"):
            if pairs:
                feats = template.batch_encode([self.rows[i][side] for i in pairs])
                for i, f in zip(pairs, feats, strict=True):
                    self.rows[i] = {**self.rows[i], side: f}
        return self


def dpo_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Encoded DPO rows as the (chosen, rejected, chosen, rejected, ...) list DPOLoss takes."""
    return [f for r in rows for f in (r["chosen"], r["rejected"])]
