"""Discriminative reward models (``filter.reward_model``): a local sequence-classification checkpoint
that reads a prompt and a response and gives one logit.

``RewardModels`` is what the runtime lends as ``Lent.reward_models``: each folder is loaded once, on
first use (``AutoModelForSequenceClassification``, float32 on the CPU, eval mode, no gradients,
``local_files_only`` under ``HF_HUB_OFFLINE=1``: nothing is downloaded), and scores batches with
``score``. ``check_reward_model`` is ``gfcr validate``'s look at the folder: it reads config.json
only (no torch), and refuses a missing folder and a model without a classification head, each
with the fix.

How a prompt and a response become the classifier's input (``encode``; the training script
``benchmarks/train_reward_model.py`` uses the same function, so training and scoring agree):

- ``pair``: the tokenizer's text pair, ``[CLS] prompt [SEP] response [SEP]`` for a BERT-style
  cross-encoder (the format a classifier fine-tuned from an encoder expects);
- ``chat``: the tokenizer's chat template over a user turn (the prompt) and an assistant turn
  (the response), the format of the chat reward models (Skywork-Reward, ArmoRM); a tokenizer
  without a chat template is refused at setup.

An input longer than ``max_length`` tokens is cut from the left, the longer of prompt and response
first (``pair``: the tokenizer's ``longest_first``; ``chat``: the first token and the last ones are
kept), so the response's end, its final answer, stays: ``cut`` says so, and the stage either scores
the cut input or falls back (its ``oversized``).

The score is one logit a row: a head with one label gives its logit; a head with two gives the
log-odds of ``label`` against the other label (``logit[label] - logit[1 - label]``, whose sigmoid is
the softmax probability of ``label``). Heads with more labels are refused at validate.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from gfcr.errors import ModelError

Format = Literal["pair", "chat"]
MAKE_ONE = ("`python benchmarks/train_reward_model.py` fine-tunes one offline on the shipped GSM8K data and "
            "writes it to runs/reward-model-gsm8k (docs/rewards.md)")


@dataclass(frozen=True, slots=True)
class Encoded:
    """One row's input ids, its segment ids where the tokenizer makes them (a BERT pair), and whether it was cut."""

    ids: list[int]
    types: list[int] | None
    cut: bool


@dataclass(frozen=True, slots=True)
class RowScore:
    """One scored row: the logit (or log-odds), the tokens the classifier read, and whether the input was cut."""

    logit: float
    tokens: int
    cut: bool


def check_reward_model(path: str, label: int = 1) -> None:
    """The ModelError loading ``path`` as a reward model with ``label`` would raise, found from its
    config.json alone (``gfcr validate``; nothing is loaded)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelError(f"reward model `{path}`: no folder there", f"point `model:` at a folder saved with "
                         f"save_pretrained from a sequence classifier; {MAKE_ONE}")
    config = folder / "config.json"
    if not config.is_file():
        raise ModelError(f"reward model `{path}`: the folder has no config.json",
                         f"point `model:` at a folder saved with save_pretrained; {MAKE_ONE}")
    data = json.loads(config.read_text())
    heads = [a for a in data.get("architectures") or [] if a.endswith("ForSequenceClassification")]
    if not heads:
        shown = ", ".join(data.get("architectures") or ["none listed"])
        raise ModelError(f"reward model `{path}` has no sequence-classification head (architectures: {shown}), so "
                         "it gives no score", "fine-tune a classifier from it (AutoModelForSequenceClassification) "
                         f"and point `model:` at the saved folder; {MAKE_ONE}")
    labels = len(data["id2label"]) if data.get("id2label") else int(data.get("num_labels", 2))
    if labels > 2:
        raise ModelError(f"reward model `{path}` has {labels} labels; a reward needs one score a row",
                         "use a head with 1 label (a logit) or 2 (the log-odds of `label`)")
    if labels == 2 and label not in (0, 1):
        raise ModelError(f"reward model `{path}` has 2 labels and `label: {label}`", "write `label: 0` or `label: 1`")


class RewardModel:
    """A frozen sequence classifier and its tokenizer, scoring (prompt, response) rows in batches."""

    def __init__(self, path: str):
        check_reward_model(path)
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        folder = str(Path(path).expanduser())
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, local_files_only=True, dtype=torch.float32)
        self.model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.labels = int(self.model.config.num_labels)
        self._lock = threading.Lock()

    def score(self, prompts: Sequence[str], responses: Sequence[str], *, format: Format, max_length: int,
              batch_size: int, label: int = 1, deadline: float | None = None) -> list[RowScore | None]:
        """A ``RowScore`` a row, in order; None for the rows of batches not started before ``deadline``
        (``time.monotonic()``)."""
        import time

        out: list[RowScore | None] = []
        for start in range(0, len(prompts), batch_size):
            if deadline is not None and time.monotonic() > deadline:
                out += [None] * (len(prompts) - start)
                break
            rows = [encode(self.tokenizer, p, r, format=format, max_length=max_length)
                    for p, r in zip(prompts[start:start + batch_size], responses[start:start + batch_size])]
            out += self._forward(rows, label)
        return out

    def _forward(self, rows: list[Encoded], label: int) -> list[RowScore]:
        import torch

        ids, mask, types = batch_tensors(rows, self.tokenizer.pad_token_id)
        with self._lock, torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits.float()  # [B, labels]
        scores = logits[:, 0] if self.labels == 1 else logits[:, label] - logits[:, 1 - label]  # [B]
        return [RowScore(float(s), len(row.ids), row.cut) for s, row in zip(scores.tolist(), rows)]


def batch_tensors(rows: Sequence[Encoded], pad: int | None) -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, token_type_ids or None)``, each ``[B, T]``, right-padded."""
    import torch

    width = max(len(row.ids) for row in rows)
    ids = torch.full((len(rows), width), 0 if pad is None else pad, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    types = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    for i, row in enumerate(rows):
        ids[i, :len(row.ids)], mask[i, :len(row.ids)] = torch.tensor(row.ids), 1
        if row.types is not None:
            types[i, :len(row.types)] = torch.tensor(row.types)
    return ids, mask, (types if any(row.types is not None for row in rows) else None)


def encode(tokenizer: Any, prompt: str, response: str, *, format: Format, max_length: int) -> Encoded:
    """The classifier's input for one row, and whether it was cut to ``max_length`` (module docstring)."""
    if format == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError("`format: chat`, and the reward model's tokenizer has no chat template",
                             "use `format: pair` (a text pair), or a reward model whose tokenizer has a chat template")
        ids = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=True,
            return_dict=True)["input_ids"])
        if len(ids) <= max_length:
            return Encoded(ids, None, False)
        return Encoded(ids[:1] + ids[len(ids) - max_length + 1:], None, True)
    full = tokenizer(prompt, response)
    if len(full["input_ids"]) <= max_length:
        return Encoded(list(full["input_ids"]), _types(full), False)
    tokenizer.truncation_side = "left"  # keep the ends: the response's end holds its final answer
    cut = tokenizer(prompt, response, truncation="longest_first", max_length=max_length)
    return Encoded(list(cut["input_ids"]), _types(cut), True)


def _types(encoding: Any) -> list[int] | None:
    """The segment ids (0: the prompt, 1: the response) where the tokenizer makes them (BERT's)."""
    return list(encoding["token_type_ids"]) if "token_type_ids" in encoding else None


class RewardModels:
    """``reward_models(path) -> RewardModel``, loading each folder once (``Lent.reward_models``)."""

    def __init__(self) -> None:
        self._loaded: dict[str, RewardModel] = {}
        self._lock = threading.Lock()

    def __call__(self, path: str) -> RewardModel:
        with self._lock:
            if path not in self._loaded:
                self._loaded[path] = RewardModel(path)
            return self._loaded[path]
