"""Which local agent acts on which gap, the order the rest fill a round in, and which only set recipe
fields: what the registry picks a round's agents from."""

from __future__ import annotations

from specpilot.core.agents.local.adaptive_length import AdaptiveLengthAgent
from specpilot.core.agents.local.batching import BatchingAgent
from specpilot.core.agents.local.common import LocalAgent
from specpilot.core.agents.local.draft_length import DraftLengthAgent
from specpilot.core.agents.local.drafter_choice import DrafterChoiceAgent
from specpilot.core.agents.local.drafter_format import DrafterFormatAgent
from specpilot.core.agents.local.hybrid_drafter import HybridDrafterAgent
from specpilot.core.agents.local.runtime import RuntimeAgent
from specpilot.core.agents.local.tree_shape import TreeShapeAgent
from specpilot.core.agents.local.weight_format import WeightFormatAgent

GAP_AGENTS: dict[str, tuple[type[LocalAgent], ...]] = {
    "acceptance": (TreeShapeAgent, DraftLengthAgent, HybridDrafterAgent),
    "drafting": (DrafterFormatAgent, DrafterChoiceAgent, DraftLengthAgent, AdaptiveLengthAgent, HybridDrafterAgent),
    "weights": (WeightFormatAgent,),
    "verify": (RuntimeAgent, WeightFormatAgent, DraftLengthAgent, TreeShapeAgent),
    "host": (AdaptiveLengthAgent, DraftLengthAgent, RuntimeAgent),
    "prompt": (),  # the prefill: no recipe field changes it (see registry.HINTS)
    "dispatch": (RuntimeAgent, DraftLengthAgent, TreeShapeAgent),
    "batching": (BatchingAgent,),
}
DEFAULT_ORDER: tuple[type[LocalAgent], ...] = (TreeShapeAgent, DrafterChoiceAgent, DraftLengthAgent,
                                                 WeightFormatAgent, RuntimeAgent, BatchingAgent, AdaptiveLengthAgent,
                                                 HybridDrafterAgent, DrafterFormatAgent)
KNOB_AGENTS = ("tree-shape", "drafter-choice", "draft-length", "weight-format", "runtime", "batching", "memory",
               "drafter-format")
