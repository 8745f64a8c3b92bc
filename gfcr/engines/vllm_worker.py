"""The worker side of the vLLM engine's weight sync: methods vLLM mixes into its GPU workers.

``VLLMEngine`` passes ``worker_extension_cls="gfcr.engines.vllm_worker.WeightSync"``; vLLM
then adds these methods to every worker (one per tensor-parallel rank), and
``LLM.collective_rpc(name, args=...)`` calls them on all workers at once. vLLM imports this
module inside its worker processes, so it imports nothing of gfcr's and nothing of vLLM's
at import time.

Each rank hands the full (unsharded) Hugging Face tensors to its model's own
``load_weights``, which maps the checkpoint names onto vLLM's fused layers (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``) and copies this rank's shard in place, so
captured CUDA graphs stay valid. Three ways the tensors arrive:

- ``gfcr_load_weights``: the tensors themselves, when the worker runs in the trainer's own
  process (tensor_parallel_size 1 with vLLM's engine core in-process);
- ``gfcr_reload_weights``: the same, on vLLM's CPU worker, whose linear layers keep their
  weights repacked for oneDNN (the loaded parameters are emptied after loading), so a plain
  ``load_weights`` has nothing to copy into; vLLM's own ``reload_weights`` restores the
  layers, loads, and repacks them. It repacks a tied parameter in its first owner only
  (``embed_tokens``), so the LM head would keep the packed copy of the old embedding: every
  layer that keeps its weight beside a packed copy is packed again;
- ``gfcr_reload_serialized``: the same as one safetensors blob, when vLLM's CPU engine core runs
  in a process of its own (the stale lifecycles: ``VLLMEngine(own_process=True)``);
- ``gfcr_load_ipc``: CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``)
  of the trainer's parameters, when workers are processes of their own. Each worker opens
  the trainer's memory directly (no copy through the host); the handle names the trainer's
  GPU by its UUID, since a device index means different GPUs under different
  ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

# reduce_tensor's args for a CUDA tensor: (tensor_cls, size, stride, offset, storage_cls, dtype,
# storage_device, storage_handle, ...); the device index sits at this position.
IPC_DEVICE_ARG = 6


class WeightSync:
    """Mixed into vLLM's worker class (which provides ``self.model_runner``)."""

    model_runner: Any

    def gfcr_pid(self) -> int:
        """This worker's process id: the engine compares it with its own to pick the transport."""
        return os.getpid()

    def gfcr_load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load full Hugging Face tensors given in-process; returns how many were given."""
        self.model_runner.model.load_weights(weights=list(weights))
        return len(weights)

    def gfcr_reload_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load full Hugging Face tensors given in-process, through vLLM's in-place reload, which
        re-runs each layer's post-loading processing (the CPU worker's weight repacking)."""
        self.model_runner.reload_weights(weights_iterator=list(weights))
        repack_kept_weights(self.model_runner.model)
        return len(weights)

    def gfcr_reload_serialized(self, blob: bytes) -> int:
        """``gfcr_reload_weights`` for a worker in another process on the CPU (vLLM's engine core in
        a process of its own): the tensors arrive as one safetensors blob (vLLM's message encoding
        hands tensors nested in an argument list back as lists)."""
        from safetensors.torch import load

        return self.gfcr_reload_weights(list(load(blob).items()))

    def gfcr_load_ipc(self, device_uuid: str, handles: Sequence[tuple[str, tuple]]) -> int:
        """Open the trainer's tensors from their CUDA IPC handles and load them."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = local_device_index(device_uuid)
        weights = [(name, rebuild_cuda_tensor(*with_device(args, index))) for name, args in handles]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()  # the copies are done before the trainer's next optimizer step
        del weights
        return len(handles)


def repack_kept_weights(model: Any) -> list[str]:
    """Pack again the CPU GEMM copy (``cpu_linear``) of every layer that keeps its weight too (the
    embedding and the LM head tied to it); returns their names."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    names = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            names.append(name)
    return names


def with_device(args: tuple, index: int) -> tuple:
    """``reduce_tensor`` args with the storage device replaced by this process's index of it."""
    patched = list(args)
    patched[IPC_DEVICE_ARG] = index
    return tuple(patched)


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (as this process numbers its visible devices)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; an error if the GPU is not visible here."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise RuntimeError(f"the trainer's GPU {uuid} is not visible to vLLM worker pid {os.getpid()} "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run the trainer "
                       "and the engine with the same CUDA_VISIBLE_DEVICES")
