"""The SPES rules as pure tensor math (no network): expert claims, applying an average, the merge warm-up,
and the checks every received tensor must pass."""

from swarm.sync.apply_average import OuterStep
from swarm.sync.claims import choose_experts, orphan_claim_rank, orphan_swap, settle_joiners
from swarm.sync.merge import merge_alpha_at, merge_experts, should_merge
from swarm.sync.tensor_checks import (
    CopyComparison,
    RejectedTensor,
    check_tensor,
    check_tensors,
    clamp_weight,
    outlying_changes,
    relative_change,
)

__all__ = [
    "CopyComparison",
    "OuterStep",
    "RejectedTensor",
    "check_tensor",
    "check_tensors",
    "choose_experts",
    "clamp_weight",
    "merge_alpha_at",
    "merge_experts",
    "orphan_claim_rank",
    "outlying_changes",
    "orphan_swap",
    "relative_change",
    "settle_joiners",
    "should_merge",
]
