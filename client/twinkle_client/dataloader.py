"""`DataLoader`: batches of dataset rows with a resumable position.

Batches are lists of rows (what ``forward_backward(inputs=...)`` takes). With ``shuffle`` the
order of each epoch is a fixed function of ``seed`` and the epoch number, so a resumed loader
yields exactly the batches the interrupted one would have. The position is ``consumed`` rows in
the current epoch: `state_dict` / `load_state_dict` save and restore it, and
`resume_from_checkpoint` takes the ``consumed_train_samples`` a model checkpoint recorded, and
`get_state` gives it (upstream's ``{'consumed_train_samples': n}``, counted over all epochs).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class DataLoader:
    def __init__(
        self,
        dataset: Sequence[dict[str, Any]] | Callable[[], Sequence[dict[str, Any]]],
        batch_size: int = 1,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None,
        num_workers: int = 0,
        **_: Any,
    ) -> None:
        """``dataset``: rows (a `Dataset`, a list) or a function returning them (upstream).
        ``num_workers`` and upstream's other options are accepted and ignored (rows are in
        memory)."""
        if callable(dataset) and not hasattr(dataset, "__getitem__"):
            dataset = dataset()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size {batch_size!r} must be an integer >= 1")
        self.dataset: Sequence[dict[str, Any]] = dataset  # pyright: ignore[reportAttributeAccessIssue]
        self.batch_size = batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.collate_fn = collate_fn
        self.epoch = 0
        self.consumed = 0  # rows of the current epoch already yielded

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self) -> list[int]:
        idx = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(idx)
        return idx

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch; the next iteration starts the following epoch."""
        order = self._order()
        while self.consumed < len(order):
            take = order[self.consumed : self.consumed + self.batch_size]
            if self.drop_last and len(take) < self.batch_size:
                break
            self.consumed += len(take)
            batch = [self.dataset[i] for i in take]
            yield self.collate_fn(batch) if self.collate_fn else batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "epoch" not in state:  # get_state()'s form
            self.resume_from_checkpoint(state["consumed_train_samples"])
            return
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.seed = int(state.get("seed", self.seed))

    def get_state(self) -> dict[str, int]:
        """``{'consumed_train_samples': n}``: rows yielded so far over all epochs (what
        ``model.save(consumed_train_samples=...)`` records)."""
        return {"consumed_train_samples": self.epoch * len(self.dataset) + self.consumed}

    def resume_from_checkpoint(self, consumed_train_samples: int, **_: Any) -> None:
        """Skip what a run had consumed in total (epochs are len(dataset) rows each)."""
        n = max(1, len(self.dataset))
        self.epoch, self.consumed = divmod(int(consumed_train_samples), n)
