"""Checkpoint methods of `engine.local.model.MultiLoraTransformersModel` (a mixin): save, load,
resume_from_checkpoint. The files: the backend's PEFT checkpoint plus the training-config file
(`engine.local.adapter_state.TRAIN_CONFIG_FILE`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.local.adapter_state import AdapterTraining, check_count, checkpoint_dir

if TYPE_CHECKING:
    from engine.backends.base import TrainingBackend

DEFAULT_ADAPTER = "default"


class CheckpointMethods:
    """Needs ``backend``, ``data_dir``, ``_adapters`` and ``_st`` of the model class."""

    backend: TrainingBackend
    data_dir: Path
    _adapters: dict[str, AdapterTraining]

    def _st(self, adapter_name: str) -> AdapterTraining:  # pragma: no cover - the model's
        raise NotImplementedError

    def save(
        self,
        name: str,
        output_dir: str | os.PathLike | None = None,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        save_optimizer: bool = False,
        consumed_train_samples: int | None = None,
        is_sampler: bool = False,
    ) -> str:
        """Write a PEFT-format checkpoint to ``output_dir/name`` (default
        ``<data_dir>/local_checkpoints/<adapter>/<name>``; it must not exist) plus the training
        config (loss, optimizer, schedule position, ``consumed_train_samples`` for
        `resume_from_checkpoint`). ``is_sampler``: weights for sampling only (no optimizer).
        Pending accumulated gradients are not saved. Returns the directory."""
        st = self._st(adapter_name)
        if consumed_train_samples is not None:
            st.consumed_train_samples = check_count(consumed_train_samples)
        target = checkpoint_dir(self.data_dir, name, output_dir, adapter_name)
        with_optimizer = bool(save_optimizer) and not is_sampler
        self.backend.save_state(adapter_name, str(target), include_optimizer=with_optimizer)
        st.write_train_config(target)
        return str(target)

    def resume_from_checkpoint(
        self,
        name: str,
        output_dir: str | os.PathLike | None = None,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        resume_only_model: bool = False,
    ) -> dict[str, Any]:
        """`load` with the optimizer (weights only if ``resume_only_model``); returns where
        training stands: ``cur_step`` (applied optimizer steps), ``consumed_train_samples`` (as
        given to `save`, for the data loader to skip), ``lr_scheduler_position``."""
        target = self.load(
            name, output_dir, adapter_name=adapter_name, load_optimizer=not resume_only_model
        )
        st = self._st(adapter_name)
        return {
            "checkpoint": target,
            "cur_step": st.opt_steps,
            "consumed_train_samples": st.consumed_train_samples,
            "lr_scheduler_position": st.sched_t,
        }

    def load(
        self,
        name: str,
        output_dir: str | os.PathLike | None = None,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        load_optimizer: bool = False,
    ) -> str:
        """Load a checkpoint written by `save` (or by the server) into ``adapter_name``, creating
        it if absent. With ``load_optimizer`` the AdamW state, optimizer settings, loss, gradient
        accumulation and schedule position are restored (a callable schedule is not saved: the
        current one is kept); without it only the weights are, and the schedule restarts."""
        target = checkpoint_dir(self.data_dir, name, output_dir, adapter_name, loading=True)
        spec = self.backend.load_state(
            adapter_name, str(target), include_optimizer=bool(load_optimizer)
        )
        st = self._adapters.get(adapter_name)
        if st is None:
            st = self._adapters[adapter_name] = AdapterTraining(spec=spec)
        st.spec = spec
        st.reset_window()
        st.sched_t = st.opt_steps = 0
        if load_optimizer:
            st.read_train_config(target)
        return str(target)
