"""Offline agents, one per kind of gap: each asks the cost model (`ctx.tools`, a CostTools) what a change
would buy, streams what it evaluated as it goes, and proposes the best change or says why none pays.

They never touch the held-out requests or run the target: every number comes from the replayed acceptance
and the measured profile, so a round stays cheap and an agent's claim can be checked against the judge's
measurement. They are deterministic given the context; `ctx.seed` only breaks exact ties.

One module per agent (tree_shape, draft_length, drafter_choice, drafter_format, weight_format, runtime,
batching, adaptive_length, hybrid_drafter, and remembered for the memory agent); common holds the base
class and the helpers they share, keys the cost model's names as values, replays the simulations the
code-writing agents fit on, catalogue which agent acts on which gap, and templates the plugin programs
the code-writing agents fill in. Each agent says where its mechanism cannot apply with `applies(report)`.
"""

from specpilot.core.agents.local.adaptive_length import AdaptiveLengthAgent, adaptive_depth
from specpilot.core.agents.local.batching import BatchingAgent
from specpilot.core.agents.local.catalogue import DEFAULT_ORDER, GAP_AGENTS, KNOB_AGENTS
from specpilot.core.agents.local.common import LocalAgent, Option, Stream, draft_nodes
from specpilot.core.agents.local.draft_length import DraftLengthAgent
from specpilot.core.agents.local.drafter_choice import DrafterChoiceAgent
from specpilot.core.agents.local.drafter_format import DrafterFormatAgent
from specpilot.core.agents.local.hybrid_drafter import HybridDrafterAgent
from specpilot.core.agents.local.keys import CurveKey, DrafterKey
from specpilot.core.agents.local.remembered import MemoryAgent
from specpilot.core.agents.local.replays import ngram_runs
from specpilot.core.agents.local.runtime import RuntimeAgent
from specpilot.core.agents.local.tree_shape import TreeShapeAgent
from specpilot.core.agents.local.weight_format import WeightFormatAgent

__all__ = ["AdaptiveLengthAgent", "BatchingAgent", "CurveKey", "DEFAULT_ORDER", "DraftLengthAgent",
           "DrafterChoiceAgent", "DrafterFormatAgent", "DrafterKey", "GAP_AGENTS", "HybridDrafterAgent",
           "KNOB_AGENTS", "LocalAgent", "MemoryAgent", "Option", "RuntimeAgent", "Stream", "TreeShapeAgent",
           "WeightFormatAgent", "adaptive_depth", "draft_nodes", "ngram_runs"]
