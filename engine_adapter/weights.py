"""Reading HF safetensors checkpoints into a module by tensor name.

A checkpoint directory holds ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). Tensors are read one
at a time and copied into the module's own (already allocated) parameters, converting dtype and
device on the way, so peak memory is the model plus one tensor.

Names are the HF names (``model.layers.3.mlp.experts.7.up_proj.weight``). Layers past
``num_hidden_layers`` (DeepSeek's multi-token-prediction layer ``model.layers.61``) are skipped.
This module knows nothing about the model's architecture.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped tensors."""


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sharded or not."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")


def iter_tensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time."""
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_checkpoint(module: nn.Module, directory: str | Path, num_layers: int) -> None:
    """Copy every checkpoint tensor into the module's tensor of the same name.

    Raises CheckpointError on a shape mismatch, on tensors the module lacks, and on module tensors
    the checkpoint lacks (naming them). Persistent buffers count as module tensors.
    """
    targets = module.state_dict(keep_vars=True)  # name -> parameter or buffer (aliases of tied ones)
    loaded, unexpected = set(), []
    for name, tensor in iter_tensors(directory):
        if _skipped(name, num_layers):
            continue
        target = targets.get(name)
        if target is None:
            unexpected.append(name)
            continue
        if target.shape != tensor.shape:
            raise CheckpointError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    _check_complete(module, loaded, unexpected)


def _skipped(name: str, num_layers: int) -> bool:
    layer = _LAYER.match(name)
    return (layer is not None and int(layer.group(1)) >= num_layers) or name.endswith("rotary_emb.inv_freq")


def _check_complete(module: nn.Module, loaded: set[str], unexpected: list[str]) -> None:
    if unexpected:
        raise CheckpointError(f"checkpoint tensors the model does not have: {_few(unexpected)}")
    required = {name for name, _ in module.named_parameters()} | {name for name, _ in module.named_buffers()}
    missing = sorted(required - loaded)
    if missing:
        raise CheckpointError(f"model tensors missing from the checkpoint: {_few(missing)}")


def _few(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(sorted(names)[:limit]) + more
