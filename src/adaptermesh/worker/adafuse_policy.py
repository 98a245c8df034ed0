"""When the engine merges an AdaFuse expert selection into the backbone, and when it restores it.

A step that is a single token of a single expert-set request picks by cost. Merging a
selection into the backbone (one ``fused_switch``) reads and writes every targeted weight,
gigabytes on a 7B model, while the unmerged gated path reads only the selected experts' LoRA
matrices. So the step runs on merged weights only when they already hold the token's
selection, or when the same selection has now repeated for ``EngineConfig.adafuse_merge_after``
consecutive tokens (then it merges once); otherwise it runs the gated path on top of whatever
the backbone holds (cancelling a merged selection with negated gates). Any step that runs another request first
restores the pristine backbone (bit-exact), and so does going idle, so the weights are only
ever merged for the request that is running alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptermesh.worker.adafuse import (
    BackboneMasters,
    CpuExpertSet,
    ExpertSet,
    GatedBatch,
    Selection,
)
from adaptermesh.worker.engine_config import EngineConfig
from adaptermesh.worker.model import ModelConfig, TransformerModel
from adaptermesh.worker.step_plan import ScheduledStep

__all__ = ["MergePolicy", "SoloDecision", "SoloStep", "single_expert_token"]


@dataclass(slots=True)
class SoloStep:
    """One token of one expert-set request (a batch of one row)."""

    seq_id: int
    expert_set: ExpertSet
    token: int
    rows: int
    row: int


@dataclass(slots=True)
class SoloDecision:
    """How a step runs its expert sets: ``solo`` is the single expert-set token (None: the
    step is not one); ``selection`` the host selection rows for ``SoloGated`` (None: on
    merged weights, or not a solo step)."""

    solo: SoloStep | None
    selection: torch.Tensor | None

    @property
    def gated_set(self) -> ExpertSet | None:
        """The expert set the step runs on the solo gated path, if any."""
        return (
            self.solo.expert_set if self.solo is not None and self.selection is not None else None
        )


def single_expert_token(plan: ScheduledStep) -> SoloStep | None:
    """The step when it is exactly one token of one expert-set request (whose input the host
    knows: expert-set steps run without overlap)."""
    rows = plan.rows
    if len(rows) != 1 or rows[0].count != 1:
        return None
    row = rows[0]
    if row.expert_set is None:
        return None
    assert row.token_ids, "an expert-set step's input token is on the host"
    return SoloStep(row.seq_id, row.expert_set, row.token_ids[0], 1, 0)


class MergePolicy:
    """The backbone's merge state and the merge/restore decisions, with their counters."""

    def __init__(self, model: TransformerModel, config: EngineConfig) -> None:
        self.model = model
        self.config = config  # read at each decision: ``adafuse_merge_after`` may change
        self.masters = BackboneMasters(model)
        # The expert set whose selection the backbone weights hold right now (merged path), that
        # selection, and the request (sequence id) it was merged for.
        self.merged: ExpertSet | None = None
        self.merged_selection: Selection | None = None
        self.merged_owner: int | None = None
        # The current run of identical selections of one request: (seq id, set, selection),
        # length.
        self.streak: tuple[int, ExpertSet, Selection] | None = None
        self.streak_length = 0
        self.merges = 0  # fused_switch launches that merged a new selection
        self.restores = 0  # launches that restored the pristine backbone
        self.gated_steps = 0  # steps with several tokens or requests (eager, routed live)
        self.merged_steps = 0  # single-request tokens run on merged weights
        self.solo_gated_steps = 0  # single-request tokens on the gated path
        self.compensated_steps = 0  # of those, run over a merged older selection
        self.solo_graph_steps = 0  # of those, replayed in a decode graph

    def build_expert_set(self, cpu: CpuExpertSet, version: int) -> ExpertSet:
        return ExpertSet.build(cpu, self.model, self.masters, version)

    def restore_backbone(self) -> None:
        if self.merged is not None:
            self.merged.unmerge()
            self.merged = None
            self.merged_selection = None
            self.merged_owner = None
            self.restores += 1

    def prepare_step(self, plan: ScheduledStep) -> SoloDecision:
        """Before a step: restore the backbone unless the step is the merged request's single
        token, and choose the solo path of a single expert-set token."""
        solo = single_expert_token(plan)
        if self.merged is not None and (
            solo is None or solo.expert_set is not self.merged or solo.seq_id != self.merged_owner
        ):
            self.restore_backbone()  # nothing else may ever run on merged weights
        selection: torch.Tensor | None = None
        if solo is not None:
            selection = self.choose_solo_path(solo)
        else:
            self.streak, self.streak_length = None, 0
        return SoloDecision(solo, selection)

    def choose_solo_path(self, solo: SoloStep) -> torch.Tensor | None:
        """Merge or not, for one token of one request. Returns None to run the step on merged
        weights (plain base step), else the host selection rows for ``SoloGated``.

        Cost rule: a switch moves every targeted weight (read W0, write W); the gated path
        moves only the token's experts. So merge only a selection that keeps repeating."""
        expert_set, seq = solo.expert_set, solo.seq_id
        selection = expert_set.selection(solo.token)
        key = (seq, expert_set, selection)
        streak = self.streak
        if (
            streak is not None
            and streak[0] == seq
            and streak[1] is expert_set
            and streak[2] == selection
        ):
            self.streak_length += 1
        else:
            self.streak, self.streak_length = key, 1
        if self.merged is expert_set and self.merged_selection == selection:
            self.merged_steps += 1
            return None
        merge_after = self.config.adafuse_merge_after
        if merge_after > 0 and self.streak_length >= merge_after:
            expert_set.merge(
                selection
            )  # exact mode: rebuilt from W0, so any previous selection is gone
            self.merged, self.merged_selection, self.merged_owner = expert_set, selection, seq
            self.merges += 1
            self.merged_steps += 1
            return None
        # The caller restored the backbone unless it holds this request's set.
        held = self.merged_selection if self.merged is expert_set else None
        self.solo_gated_steps += 1
        if held is not None:
            self.compensated_steps += 1
        return expert_set.solo_rows(solo.rows, solo.row, selection, held)

    def gated_batch(
        self,
        plan: ScheduledStep,
        ranges: list[tuple[int, int]],
        num_tokens: int,
        device: torch.device,
        model_config: ModelConfig,
    ) -> GatedBatch:
        """Which rows of the flat batch each expert set owns, for a step with several
        expert-set tokens or requests (``ranges``: each plan row's first token row and token
        rows); counted."""
        self.gated_steps += 1
        sets: list[ExpertSet] = []
        index: dict[int, int] = {}
        token_set = [-1] * num_tokens
        for row, (first_row, count) in zip(plan.rows, ranges, strict=True):
            if row.expert_set is None:
                continue
            if id(row.expert_set) not in index:
                index[id(row.expert_set)] = len(sets)
                sets.append(row.expert_set)
            token_set[first_row : first_row + count] = [index[id(row.expert_set)]] * count
        token_sets = torch.tensor(token_set, dtype=torch.int32, device=device)
        return GatedBatch(sets, token_sets, model_config)
