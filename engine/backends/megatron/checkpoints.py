"""A Megatron rank's checkpoints: PEFT files and optimizer state gathered from the shards.

Owns `WorkerCheckpoints`, the part of `MegatronWorker` (worker.py) that writes and reads the
Transformers backend's format (PEFT ``adapter_model.safetensors`` + config, optimizer state by
PEFT name, engine/backends/checkpoint_io.py), so a state saved by either backend loads in the
other. Saving is collective: every rank's shards are gathered (TP inside a stage, then across
pipeline stages) and rank 0 writes; loading reads the full tensors on every rank and keeps this
rank's slice. Errors found on rank 0 are broadcast, so every rank raises the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.backends import checkpoint_io as ckpt
from engine.backends.adapter_table import AdapterTable
from engine.backends.age_seal import export_sealer
from engine.backends.lora import target_module_names
from engine.backends.peft_files import (
    read_adapter_config,
    read_adapter_tensors,
    write_adapter_files,
)
from engine.backends.train_common import TrainableAdapter, finish_load, new_optimizer
from engine.errors import CheckpointError, EngineError
from engine.protocol import LoraSpec

if TYPE_CHECKING:
    from engine.backends.megatron.multi_lora import MegatronMultiLora


class WorkerCheckpoints(AdapterTable):
    """Mixed into `MegatronWorker`, whose attributes and adapter methods it uses."""

    lora: MegatronMultiLora
    pp: int
    tp_rank: int
    rank: int
    world_size: int
    device: torch.device
    max_lora_rank: int
    base_model_name: str
    _ps: Any

    def _full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full PEFT tensors from every rank's shards (collective); complete on rank 0."""
        stage = self.lora.gather(local)
        if self.pp == 1:
            return stage
        objs: list = [None] * self.pp
        mine = {k: v.cpu() for k, v in stage.items()} if self.tp_rank == 0 else {}
        torch.distributed.all_gather_object(
            objs, mine, group=self._ps.get_pipeline_model_parallel_group()
        )
        merged: dict[str, torch.Tensor] = {}
        for part in objs:
            merged.update(part)
        return merged

    def _on_rank0(self, fn: Callable[[], object]) -> object:
        """``fn()`` on rank 0; its result (or its EngineError, re-raised) on every rank."""
        result: list = [None]
        if self.rank == 0:
            try:
                result[0] = ("ok", fn())
            except EngineError as e:
                result[0] = ("err", e)
        if self.world_size > 1:
            torch.distributed.broadcast_object_list(result, src=0)
        kind, value = result[0]
        if kind == "err":
            assert isinstance(value, BaseException)
            raise value
        return value

    def save_state(
        self,
        adapter_id: str,
        directory: str,
        *,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        st = self._get(adapter_id)
        seal = export_sealer(age_recipients)  # checked on every rank: the same error
        target = Path(directory)
        if target.exists():  # checked on every rank before any collective (one host's disk)
            raise CheckpointError(f"checkpoint directory {target} already exists")
        names = self.lora.full_names(st.spec)
        weights = self._full(dict(st.params))
        opt_state = self._full_optimizer_state(st, names) if include_optimizer else None
        targets = target_module_names(st.spec)

        def write() -> int:
            def fill(tmp: Path) -> None:
                write_adapter_files(
                    tmp,
                    {n: weights[n] for n in names},
                    st.spec,
                    targets,
                    self.base_model_name,
                    seal,
                )
                ckpt.write_state(
                    tmp, st.spec, st.step, include_optimizer, self.base_model_name, seal
                )
                if opt_state is not None:
                    torch.save(opt_state, tmp / ckpt.OPTIMIZER_FILE)

            return ckpt.write_checkpoint_dir(target, fill)

        return int(self._on_rank0(write))  # type: ignore[arg-type]

    def _full_optimizer_state(self, st: TrainableAdapter, names: list[str]) -> dict:
        """The adapter's AdamW state by full PEFT name (collective: moments gathered like their
        parameters); a parameter without a step of its own gets the adapter's step count."""
        local = ckpt.optimizer_state_by_name(list(st.params), st.optimizer)
        moments = {
            f"{key}\0{name}": value
            for name, state in local["state"].items()
            for key, value in state.items()
            if key in ("exp_avg", "exp_avg_sq")
        }
        full = self._full_moments(moments)
        steps = {n: s["step"] for n, s in local["state"].items()}
        return {
            "format": local["format"],
            "state": {
                n: {"step": steps.get(n, torch.tensor(float(st.step)))}
                | {k: full[f"{k}\0{n}"] for k in ("exp_avg", "exp_avg_sq") if f"{k}\0{n}" in full}
                for n in names
                if f"exp_avg\0{n}" in full
            },
            "param_groups": [{**g, "params": list(names)} for g in local["param_groups"]],
        }

    def _full_moments(self, moments: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`_full` for optimizer moments keyed ``"<moment>\\0<peft name>"`` (same slicing as the
        parameter they belong to)."""
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in moments.items():
            moment, name = key.split("\0", 1)
            by_param.setdefault(moment, {})[name] = t
        out: dict[str, torch.Tensor] = {}
        for moment in ("exp_avg", "exp_avg_sq"):
            full = self._full(by_param.get(moment, {}))
            out |= {f"{moment}\0{n}": t for n, t in full.items()}
        return out

    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        path = Path(directory)
        files = ckpt.verify_manifest(path)
        spec, step = ckpt.read_state(path)
        read_adapter_config(path)  # the same options check as the Transformers backend
        saved_opt = (
            ckpt.read_optimizer(path, files, torch.device("cpu")) if include_optimizer else None
        )
        tensors = read_adapter_tensors(path, self.lora.full_shapes(spec))
        st, created = self._for_load(adapter_id, spec, path)
        try:
            optimizer = new_optimizer(st.params)
            if saved_opt is not None:
                local = list(st.params)
                try:
                    mine = {
                        "state": {
                            n: {
                                k: (self.lora.shard(n, v).to(self.device) if k != "step" else v)
                                for k, v in s.items()
                            }
                            for n, s in saved_opt["state"].items()
                            if n in st.params
                        },
                        "param_groups": [
                            {**g, "params": [n for n in g["params"] if n in st.params]}
                            for g in saved_opt["param_groups"]
                        ],
                    }
                    optimizer.load_state_dict(ckpt.optimizer_state_by_index(local, mine, path))
                except (ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
                    raise CheckpointError(f"checkpoint {path}: bad optimizer state: {e}") from None
            with torch.no_grad():
                for name, p in st.params.items():
                    p.copy_(self.lora.shard(name, tensors[name]).to(p.dtype))
                    p.grad = None
            finish_load(st, optimizer, step, saved_opt is not None)
        except BaseException:
            if created:
                self.delete_adapter(adapter_id)
            raise
        return st.spec

    def export_adapter(self, adapter_id: str, *, grad: bool = False) -> dict[str, np.ndarray]:
        """The adapter's full PEFT tensors (or their gradients) as numpy, on every rank that
        holds them (rank 0 always): what tests compare across parallel layouts."""
        st = self._get(adapter_id)
        local = {n: (p.grad if grad else p) for n, p in st.params.items()}
        local = {
            n: (t if t is not None else torch.zeros_like(st.params[n])) for n, t in local.items()
        }
        return {n: t.detach().cpu().numpy() for n, t in self._full(local).items()}
