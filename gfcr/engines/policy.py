"""The policy: a transformers causal LM, its tokenizer and its version.

One object is shared by the engine (sampling) and the update stage (training), so the
transformers engine always samples from the current weights, on the CPU or, with
``policy.device: cuda``, on the GPU; ``version`` counts optimizer steps. With the vLLM
engine the policy trains on the GPU and the engine loads its weights after every update.

With ``policy.lora`` the model is a peft ``PeftModel``: a LoRA adapter on the frozen base
weights (docs/lora.md). Only the adapter's parameters require a gradient, so the update's
optimizer holds those alone; ``adapter_state`` is what a checkpoint and the vLLM engine's sync
carry. The adapter's initial ``A`` matrices draw from a generator of their own (seed
``LORA_INIT_SEED``), not torch's global one: every load of the policy starts from the same
adapter and leaves the run's random state as it was (``B`` starts at 0, so the adapted model
starts as the base model).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from gfcr.engines.models import resolve_model
from gfcr.errors import ModelError
from gfcr.records import Prompt
from gfcr.spec import LoraSpec, PolicySpec

hf_logging.set_verbosity_error()  # gfcr reports loading itself; no per-tensor progress bars
hf_logging.disable_progress_bar()

# transformers builds a model on the meta device by patching torch globally while it loads:
# two loads in parallel threads (`gfcr ablate --parallel`) must not overlap
_LOADING = threading.Lock()
BAD_FOLDER_FIX = ("point policy.model at a model alias or a folder written by save_pretrained "
                  "(config.json, tokenizer files and model.safetensors)")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_INIT_SEED = 0


class HFPolicy:
    """A causal LM loaded from a local folder; ``encode`` applies the chat template if any."""

    def __init__(self, name: str, path: Path, dtype: str = "float32", device: str = "cpu",
                 lora: LoraSpec | None = None):
        self.name, self.path, self.dtype, self.device = name, path, DTYPES[dtype], torch.device(device)
        self.lora = lora
        self.tokenizer = self._load_tokenizer()
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = self._load()
        if lora is not None:
            self.model = with_adapter(self.model, lora, name)
        self.model.train()
        self.version = 0

    def _load_tokenizer(self) -> Any:
        try:
            return AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError, TypeError, KeyError) as exc:  # a bad folder: transformers raises any of these
            raise ModelError(f"cannot load the tokenizer of policy `{self.name}` from {self.path}: "
                             f"{type(exc).__name__}: {exc}", BAD_FOLDER_FIX) from None

    def _load(self) -> Any:
        try:
            with _LOADING:
                model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelError(f"cannot load policy `{self.name}` from {self.path}: {type(exc).__name__}: {exc}",
                             BAD_FOLDER_FIX) from None
        model.generation_config.pad_token_id = self.tokenizer.pad_token_id
        return model.to(self.device)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def encode(self, prompt: Prompt) -> list[int]:
        tok = self.tokenizer
        if tok.chat_template is not None:
            messages = prompt.messages or [{"role": "user", "content": prompt.text}]
            return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=True)["input_ids"])
        text = prompt.text if prompt.text is not None else "\n".join(m["content"] for m in prompt.messages or [])
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors by peft's saved names (``...q_proj.lora_A.weight``), detached, on
        the policy's device; empty without ``policy.lora``."""
        if self.lora is None:
            return {}
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put ``adapter_state``'s tensors back (a checkpoint's); every adapter tensor must be there."""
        from peft import set_peft_model_state_dict

        mine = set(self.adapter_state())
        if set(state) != mine:
            missing, extra = sorted(mine - set(state)), sorted(set(state) - mine)
            raise ValueError(f"adapter tensors missing: {missing[:3]}, unexpected: {extra[:3]}")
        set_peft_model_state_dict(self.model, state)

    def reference(self) -> Any:
        """A frozen copy of the initial weights, for a KL term (with LoRA: the base model, which
        the adapter starts equal to)."""
        ref = self._load()
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref


def load_policy(spec: PolicySpec) -> HFPolicy:
    """The policy of ``spec`` on its device (``PolicySpec.where``): the CPU for the transformers
    engine unless ``device: cuda``, the GPU beside vLLM."""
    device = spec.where()
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"policy `{spec.model}` is to run on `cuda`, but torch {torch.__version__} sees no CUDA GPU",
                         "run on a machine with a CUDA GPU and a CUDA build of torch, or set `policy.device: cpu` "
                         "(with `engine: hf`)")
    return HFPolicy(spec.model, resolve_model(spec.model), spec.dtype, device, spec.lora)


def with_adapter(model: Any, lora: LoraSpec, name: str) -> Any:
    """``model`` wrapped in a fresh LoRA adapter (peft), its base weights frozen; the adapter's init
    draws from its own seeded generator (the module docstring)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                        lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")
    device = next(model.parameters()).device
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(LORA_INIT_SEED)
            return get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ModelError(f"policy `{name}`: cannot put a LoRA adapter on `policy.lora.target_modules` "
                         f"{list(lora.target_modules)}: {exc}", "name modules the model has "
                         f"(its linear layers: {', '.join(linear_names(model)) or 'none'})") from None


def linear_names(model: Any) -> list[str]:
    """The distinct last names of ``model``'s linear layers (what ``target_modules`` may name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
