"""`Dataset`, `LazyDataset` and `DatasetMeta`: rows loaded on the client, transformed by
preprocessors, encoded through the server's templates, with upstream's calls
(``Dataset(dataset_meta=DatasetMeta(path, data_slice=range(n)))``, ``set_template(name,
model_id=..., max_length=...)``, ``map(name_or_class, init_args=...)``, ``encode(batched=True)``).

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
    """Where a dataset comes from (upstream's fields): a local path, ``ms://org/name`` or
    ``hf://org/name`` in ``dataset_id``, or rows in ``data``. ``data_slice`` (e.g.
    ``range(500)``) keeps only those rows; ``subset_name`` / ``split`` pick a hub subset."""

    dataset_id: str = ""
    subset_name: str | None = None
    split: str = "train"
    data_slice: Any = None
    data: Any = None


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
    subset = None if meta.subset_name in (None, "default") else meta.subset_name
    try:
        if hub == "ms":
            # optional hub libraries, absent from the dev environment
            from modelscope.msdatasets import MsDataset  # pyright: ignore[reportMissingImports]

            ds = MsDataset.load(name, subset_name=subset, split=meta.split)
        else:
            from datasets import load_dataset  # pyright: ignore[reportMissingImports]

            ds = load_dataset(name, subset, split=meta.split)
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


def _rows_of(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, Mapping):  # column-oriented
        cols = {k: list(v) for k, v in data.items()}
        n = len(next(iter(cols.values()), []))
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    if callable(data):
        data = data()
    return [dict(r) for r in data]


def _load(meta: DatasetMeta) -> list[dict[str, Any]]:
    if meta.data is not None:
        rows = _rows_of(meta.data)
    elif meta.dataset_id.startswith(("ms://", "hf://")):
        rows = _read_hub(meta)
    else:
        rows = _read_local(Path(meta.dataset_id).expanduser())
    if meta.data_slice is not None:
        rows = [rows[i] for i in meta.data_slice if i < len(rows)]
    return rows


def _preprocessor(func: Any, init_args: Mapping[str, Any] | None) -> Callable[..., Any]:
    """A callable from a preprocessor name, class (built with ``init_args``) or callable."""
    if isinstance(func, str):
        cls = PREPROCESSORS.get(func)
        if cls is None:
            raise DatasetError(
                f"preprocessor: unknown {func!r}; known: {', '.join(sorted(PREPROCESSORS))}"
            )
        return cls(**dict(init_args or {}))
    if isinstance(func, type):
        return func(**dict(init_args or {}))
    if not callable(func):
        raise DatasetError(f"preprocessor: {type(func).__name__} is not callable")
    return func


_PAIRS = (("chosen", "rejected"), ("positive", "negative"))


class Dataset:
    """Rows in memory (upstream's ``twinkle.dataset.Dataset`` calls): ``set_template``,
    ``map``, ``filter``, ``encode`` work in place (and return self)."""

    def __init__(
        self, dataset_meta: DatasetMeta | str | list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> None:
        if dataset_meta is None:  # DatasetMeta's fields as keywords; upstream's load options
            fields = DatasetMeta.__dataclass_fields__  # (streaming, num_proc, ...) are ignored
            dataset_meta = DatasetMeta(**{k: v for k, v in kwargs.items() if k in fields})
        if isinstance(dataset_meta, list):
            self.rows = [dict(r) for r in dataset_meta]
        else:
            meta = DatasetMeta(dataset_meta) if isinstance(dataset_meta, str) else dataset_meta
            self.rows = _load(meta)
        self.template: Any = None
        self._pending: tuple[Any, bool] | None = None  # LazyDataset: encode on first read

    def _ready(self) -> list[dict[str, Any]]:
        if self._pending is not None:
            template, add_generation_prompt = self._pending
            self._pending = None
            self._encode(template, add_generation_prompt)
        return self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._ready()[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._ready())

    def set_template(self, template_func: Any, **kwargs: Any) -> Dataset:
        """The template `encode` uses: a `twinkle_client.template.Template` instance, or a name /
        class built with ``kwargs`` (``model_id`` required; ``max_length``, ...)."""
        from twinkle_client.template import Template, template_class

        if isinstance(template_func, Template):
            self.template = template_func
            return self
        if "model_id" not in kwargs:
            raise DatasetError("set_template: model_id is required (the served base model)")
        self.template = template_class(template_func)(**kwargs)
        return self

    def map(
        self,
        preprocess_func: Any,
        dataset_meta: DatasetMeta | None = None,
        init_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Dataset:
        """Apply a preprocessor (a name from `preprocessor.PREPROCESSORS` or a class, built with
        ``init_args``; or an instance / callable) to every row; None drops the row, a list gives
        several."""
        func = _preprocessor(preprocess_func, init_args)
        out: list[dict[str, Any]] = []
        for row in self._ready():
            res = func(row)
            if res is None:
                continue
            out.extend(res if isinstance(res, list) else [res])
        self.rows = out
        return self

    def filter(self, filter_func: Any, init_args: Mapping[str, Any] | None = None, **_: Any):
        keep = _preprocessor(filter_func, init_args)
        self.rows = [r for r in self._ready() if keep(r)]
        return self

    def shuffle(self, seed: int = 0) -> Dataset:
        random.Random(seed).shuffle(self._ready())
        return self

    def encode(
        self, add_generation_prompt: Any = False, template: Any = None, **kwargs: Any
    ) -> Dataset:
        """Encode trajectory rows through the server with the template of `set_template` (or
        ``template``): ``{"messages"}`` rows gain ``input_ids``, rolled ``labels``, ...;
        preference rows (``chosen`` / ``rejected`` or ``positive`` / ``negative``
        trajectories) get both sides encoded in place. ``batched`` and other upstream options
        are accepted (encoding is always batched)."""
        if not isinstance(add_generation_prompt, bool):  # encode(template): the older form
            template, add_generation_prompt = add_generation_prompt, False
        template = template or self.template
        if template is None:
            raise DatasetError("encode: no template; call set_template(name, model_id=...) first")
        self._encode(template, bool(add_generation_prompt))
        return self

    def _encode(self, template: Any, add_generation_prompt: bool) -> None:
        rows = self.rows
        plain = [i for i, r in enumerate(rows) if "messages" in r]
        if plain:
            feats = template.batch_encode([rows[i] for i in plain], add_generation_prompt)
            for i, f in zip(plain, feats, strict=True):
                rows[i] = f
        for pair in _PAIRS:
            idx = [i for i, r in enumerate(rows) if all(k in r for k in pair)]
            for side in pair if idx else ():
                feats = template.batch_encode([rows[i][side] for i in idx])
                for i, f in zip(idx, feats, strict=True):
                    rows[i] = {**rows[i], side: f}


class LazyDataset(Dataset):
    """A `Dataset` whose `encode` runs when rows are first read (upstream: per row on access)."""

    def encode(
        self, add_generation_prompt: Any = False, template: Any = None, **kwargs: Any
    ) -> Dataset:
        if not isinstance(add_generation_prompt, bool):
            template, add_generation_prompt = add_generation_prompt, False
        template = template or self.template
        if template is None:
            raise DatasetError("encode: no template; call set_template(name, model_id=...) first")
        self._ready()
        self._pending = (template, bool(add_generation_prompt))
        return self


def dpo_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Encoded preference rows as the (chosen, rejected, chosen, rejected, ...) list DPOLoss
    takes (``positive`` / ``negative`` rows too; the row's other keys are merged into both)."""
    out = []
    for r in rows:
        a, b = next((p for p in _PAIRS if all(k in r for k in p)), _PAIRS[0])
        base = {k: v for k, v in r.items() if k not in (a, b)}
        for side in (r[a], r[b]):
            out.append({**base, **side} if isinstance(side, Mapping) else side)
    return out
