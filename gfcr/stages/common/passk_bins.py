"""GDRO's online difficulty classifier: prompts binned by a windowed pass@k, with hysteresis.

Shared by ``control.gdro_rollout`` and ``filter.gdro_weights`` (GDRO, Panaganti et al., 2026,
arXiv 2601.19280; reference ``kishanpb/verl-gdro``, ``PassKOnlineClassifier`` in
``verl/trainer/group_dro_grpo.py``). Each stage owns its own instance, checkpointed with it.

- Every sampling event of a prompt adds one any-correct indicator
  ``c_t(x) = 1[some judged rollout of the group is correct]`` to a window of the last ``H``;
  ``pass@k_hat(x)`` is the window's mean (0.0 for a prompt never seen, as the reference's
  running accuracy of an unseen uid). The indicator comes from ``prompt_stats.observe_group``
  (``n_correct > 0``); a group with no judged rollout adds nothing.
- Edges ``a_1 < ... < a_m`` in (0, 1) give ``m + 1`` bins: bin ``i`` holds
  ``a_i <= p < a_{i+1}`` (``a_0 = 0``, ``a_{m+1} = inf``), so ``num_bins = len(edges) + 1``.
- Hysteresis with margin ``delta``: a prompt first gets the bin of its ``p``; afterwards it
  moves up only to the bin of ``p - delta`` and down only to the bin of ``p + delta`` (a
  value on an edge counting below it): it crosses a boundary only once past it by ``delta``.

Deviations: for a move across one boundary this is the reference's rule. For a jump over
several boundaries in one step the reference compares ``p`` with the edge next to the
*lower* of the two bins only and then jumps straight to the raw bin (so a prompt falling
from the top bin to ``p = 0.38`` with edges ``0.4, 0.75`` stays on top); here every crossed
boundary must be passed by ``delta``. A window of ``H = 0`` (the reference's "cumulative")
is not offered: the window is at least one event.

Example (edges 0.4, 0.75; window 4; margin 0.03):

>>> bins = PassKBins(edges=(0.4, 0.75), window=4, margin=0.03)
>>> bins.assign("p")            # never seen: pass@k 0.0, bin 0
0
>>> for hit in (1, 1, 0, 0):    # pass@k 0.5: the raw bin is 1, and 0.5 - 0.03 >= 0.4
...     bins.record("p", hit)
>>> bins.passk("p"), bins.assign("p")
(0.5, 1)
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Annotated, Any

from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.common.prompt_stats import observe_group

# Config field types shared by the two GDRO stages (each declares its own default).
Edges = Annotated[tuple[float, ...], Field(min_length=1, description=(
    "bin edges in (0, 1), increasing: len(edges) + 1 difficulty bins by windowed pass@k "
    "(the scripts' passk_edges)"))]
Window = Annotated[int, Field(ge=1, description=(
    "H: any-correct indicators kept per prompt; pass@k is their mean (passk_history_len)"))]
Margin = Annotated[float, Field(ge=0.0, lt=0.5, description=(
    "delta: a prompt changes bin only once its pass@k is past the boundary by this much "
    "(passk_hysteresis)"))]


def check_edges(edges: tuple[float, ...]) -> tuple[float, ...]:
    """``edges`` when they are strictly increasing inside (0, 1); a ValueError that says how to fix them."""
    if any(not 0.0 < e < 1.0 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges {list(edges)} must be strictly increasing values inside (0, 1), "
                         "e.g. [0.4, 0.75] for three bins")
    return edges


def any_correct(group: RolloutGroup) -> bool | None:
    """GDRO's pass@k indicator of one group: some judged rollout correct (None: none judged)."""
    obs = observe_group(group, policy_version=0)
    return None if obs is None else obs.n_correct > 0


class PassKBins:
    """Windowed pass@k per prompt, mapped to bins with hysteresis; plain checkpointable state."""

    def __init__(self, edges: tuple[float, ...], window: int, margin: float):
        self.edges, self.window, self.margin = check_edges(tuple(edges)), window, margin
        self.windows: dict[str, deque[int]] = {}
        self.bins: dict[str, int] = {}  # the bin each prompt was last assigned (hysteresis memory)

    @property
    def num_bins(self) -> int:
        return len(self.edges) + 1

    def record(self, prompt_id: str, hit: bool | int) -> None:
        """Add one any-correct indicator to the prompt's window."""
        self.windows.setdefault(prompt_id, deque(maxlen=self.window)).append(int(bool(hit)))

    def observe(self, groups: tuple[RolloutGroup, ...] | list[RolloutGroup], step: int) -> None:
        """Record the indicator of every group of ``step`` that has a judged rollout."""
        for group in groups:
            hit = any_correct(group) if group.step == step else None
            if hit is not None:
                self.record(group.prompt_id, hit)

    def passk(self, prompt_id: str) -> float:
        """The mean of the prompt's window (0.0 when never seen)."""
        window = self.windows.get(prompt_id)
        return sum(window) / len(window) if window else 0.0

    def raw_bin(self, p: float) -> int:
        """The bin of a pass@k value without hysteresis (a value on an edge belongs above it)."""
        return bisect.bisect_right(self.edges, p)

    def assign(self, prompt_id: str) -> int:
        """The prompt's bin now, moving it only when pass@k is past a boundary by the margin."""
        p = self.passk(prompt_id)
        previous = self.bins.get(prompt_id)
        if previous is None:
            current = self.raw_bin(p)
        else:
            up = bisect.bisect_right(self.edges, p - self.margin)
            down = bisect.bisect_left(self.edges, p + self.margin)
            current = up if up > previous else down if down < previous else previous
        self.bins[prompt_id] = current
        return current

    def state_dict(self) -> dict[str, Any]:
        return {"windows": {pid: list(w) for pid, w in self.windows.items()}, "bins": dict(self.bins)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows = {pid: deque((int(v) for v in w), maxlen=self.window) for pid, w in state["windows"].items()}
        self.bins = {pid: int(b) for pid, b in state["bins"].items()}
