"""State trees: a stage's ``state_dict()`` as JSON plus safetensors, with nothing pickled.

A state tree is nested dicts, lists and tuples of JSON scalars (str, int, float, bool, None),
numpy arrays and scalars, and torch tensors. ``write_tree`` splits it in two:

- ``state.json``: the tree, each tensor or array replaced by a typed placeholder
  ``{"__gfcr__": "tensor", "key": "optimizer.state.0.exp_avg", "dtype": "float32", "shape": [4, 8]}``;
- ``tensors.safetensors``: the tensors and arrays, under those flattened key paths.

Whatever JSON cannot say exactly gets a placeholder too, so ``read_tree(write_tree(t)) == t``
down to the types: a dict with non-string keys (the int parameter ids of a torch optimizer's
state), a tuple (Adam's ``betas``), a float that is not finite, a numpy scalar. Anything else
(a dataclass, an enum, an arbitrary object) is refused with its key path: a stage converts it
to plain data in ``state_dict`` (GRESO's ``stats_to_state`` is the model).

Loading reads JSON and safetensors only: no code runs, whoever wrote the files. A file that is
a pickle (``torch.save``'s zip or a bare pickle) where safetensors belongs is refused, unread,
as not a gfcr checkpoint (``refuse_pickle``), and a tensors file is read by ``load_tensors``,
which turns safetensors' own errors into a ``CheckpointError``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gfcr.errors import CheckpointError
from gfcr.runtime.store.manifest import NOT_GFCR_FIX, refuse_pickle

TAG = "__gfcr__"
STATE_JSON, TENSORS = "state.json", "tensors.safetensors"
_SCALARS = (str, int, bool, type(None))
def check_safetensors(file: Path, checkpoint: Path) -> None:
    """Refuse ``file`` unless it starts like safetensors: an 8-byte header length, then a JSON header."""
    refuse_pickle(file, checkpoint)
    with open(file, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{" or struct.unpack("<Q", head[:8])[0] > file.stat().st_size:
        raise CheckpointError(f"{checkpoint} is not a gfcr checkpoint: {file} is not a safetensors file",
                              NOT_GFCR_FIX.format(checkpoint=checkpoint))


def load_tensors(file: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The tensors of safetensors ``file``: a pickle is refused unread, a damaged file named."""
    check_safetensors(file, checkpoint)
    try:
        return load_file(str(file))
    except Exception as exc:  # safetensors raises its own SafetensorError on a damaged header
        raise CheckpointError(f"{file}: cannot read the tensors: {exc}", _CORRUPT_FIX) from None


class _Writer:
    """Walks a tree once, collecting tensors under unique flattened key paths."""

    def __init__(self, where: str):
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def encode(self, value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, bool) or isinstance(value, _SCALARS):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {TAG: "float", "value": repr(value)}
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, kind="tensor")
        if isinstance(value, np.ndarray):
            return self._array(value, path)
        if isinstance(value, np.generic):
            return {TAG: "numpy_scalar", "dtype": value.dtype.str, "value": self.encode(value.item(), path)}
        if isinstance(value, dict):
            return self._dict(value, path)
        if isinstance(value, list):
            return [self.encode(v, path + (str(i),)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {TAG: "tuple", "items": [self.encode(v, path + (str(i),)) for i, v in enumerate(value)]}
        raise CheckpointError(
            f"{self.where}: the state at `{'.'.join(path) or '<root>'}` is a {type(value).__qualname__}, "
            "which a state tree cannot hold",
            "return plain data from state_dict(): dicts, lists, str/int/float/bool/None, numpy arrays and "
            "torch tensors (convert a dataclass with a function like GRESO's stats_to_state)")

    def _dict(self, value: dict, path: tuple[str, ...]) -> Any:
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: self.encode(v, path + (k,)) for k, v in value.items()}
        for k in value:
            if not isinstance(k, _SCALARS):
                raise CheckpointError(
                    f"{self.where}: a dict at `{'.'.join(path) or '<root>'}` has the key {k!r} "
                    f"({type(k).__qualname__}); state tree keys are str, int, bool or None",
                    "use string or integer keys in state_dict()")
        return {TAG: "dict", "items": [[k, self.encode(v, path + (str(k),))] for k, v in value.items()]}

    def _array(self, value: np.ndarray, path: tuple[str, ...]) -> Any:
        if value.dtype.hasobject or value.dtype.kind in "USV":
            raise CheckpointError(f"{self.where}: the array at `{'.'.join(path)}` has dtype {value.dtype}, "
                                  "which safetensors cannot store",
                                  "store numbers in arrays; strings and objects as lists")
        placeholder = self._tensor(torch.from_numpy(np.ascontiguousarray(value)), path, kind="ndarray")
        placeholder["dtype"] = value.dtype.str  # numpy's own name: the array comes back as it was
        return placeholder

    def _tensor(self, value: torch.Tensor, path: tuple[str, ...], kind: str) -> dict[str, Any]:
        key = ".".join(path) or "<root>"
        n = 1
        while key in self.tensors:  # keys containing "." can collide once flattened
            n += 1
            key = f"{'.'.join(path)}#{n}"
        tensor = value.detach().to("cpu").contiguous()
        if tensor.numel() and tensor.untyped_storage().data_ptr() in self._storages:
            tensor = tensor.clone()  # safetensors refuses tensors that share memory
        if tensor.numel():
            self._storages.add(tensor.untyped_storage().data_ptr())
        self.tensors[key] = tensor
        placeholder = {TAG: kind, "key": key, "dtype": str(value.dtype).removeprefix("torch."),
                       "shape": list(value.shape)}
        if kind == "tensor" and value.requires_grad:
            placeholder["requires_grad"] = True
        return placeholder


def write_tree(tree: Any, directory: Path, where: str = "state") -> list[Path]:
    """Write ``tree`` as ``directory/state.json`` (+ ``tensors.safetensors`` when it holds tensors);
    return the files written. ``where`` names the tree in errors (e.g. ``stage `pick```)."""
    writer = _Writer(where)
    encoded = writer.encode(tree, ())
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / STATE_JSON]
    written[0].write_text(json.dumps(encoded, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    if writer.tensors:
        save_file(writer.tensors, str(directory / TENSORS))
        written.append(directory / TENSORS)
    return written


def read_tree(directory: Path, checkpoint: Path | None = None) -> Any:
    """The tree ``write_tree`` wrote into ``directory`` (inside ``checkpoint``, which errors name;
    ``directory`` itself when not given)."""
    checkpoint = directory if checkpoint is None else checkpoint
    state_file = directory / STATE_JSON
    if state_file.is_file():
        refuse_pickle(state_file, checkpoint)
    try:
        encoded = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{state_file}: cannot read the state: {exc}", _CORRUPT_FIX) from None
    tensors_file = directory / TENSORS
    tensors = load_tensors(tensors_file, checkpoint) if tensors_file.is_file() else {}
    return _Reader(state_file, tensors).decode(encoded)


_CORRUPT_FIX = "the checkpoint is damaged: delete this checkpoint directory to resume from an older one"


class _Reader:
    def __init__(self, source: Path, tensors: dict[str, torch.Tensor]):
        self.source, self.tensors = source, tensors

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        kind = value.get(TAG)
        if kind is None:
            return {k: self.decode(v) for k, v in value.items()}
        if kind == "dict":
            return {k: self.decode(v) for k, v in value["items"]}  # JSON kept int/bool/None keys
        if kind == "tuple":
            return tuple(self.decode(v) for v in value["items"])
        if kind == "float":
            return float(value["value"])
        if kind == "numpy_scalar":
            return np.dtype(value["dtype"]).type(self.decode(value["value"]))
        if kind in ("tensor", "ndarray"):
            return self._tensor(value, kind)
        raise CheckpointError(f"{self.source}: unknown placeholder kind {kind!r}", _CORRUPT_FIX)

    def _tensor(self, value: dict[str, Any], kind: str) -> Any:
        tensor = self.tensors.get(value["key"])
        if tensor is None:
            raise CheckpointError(f"{self.source}: tensor `{value['key']}` is not in {TENSORS}", _CORRUPT_FIX)
        if list(tensor.shape) != value["shape"]:
            raise CheckpointError(f"{self.source}: tensor `{value['key']}` has shape {list(tensor.shape)}, "
                                  f"the state says {value['shape']}", _CORRUPT_FIX)
        if kind == "ndarray":
            return tensor.numpy().astype(np.dtype(value["dtype"]), copy=False)
        return tensor.requires_grad_(True) if value.get("requires_grad") else tensor
