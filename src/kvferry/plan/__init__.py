"""The plan layer: page lists in, bounds-checked descriptor rows out, for equal and different TP sizes.

Above ``layout``; below ``transport`` and ``integrity``. Inside, bottom to top: ``pages`` (the one page
validator, at the edge), ``contract`` (``Plan``, what transports post), ``ranks`` (TP rank and head
arithmetic), ``planner`` (``plan_transfer``), ``tp`` (``TPPlanner``), ``tokens`` (``TokenPlanner``: pools
whose tokens per page differ between the two sides).
"""

from kvferry.plan.contract import Plan
from kvferry.plan.pages import PagesArg, validate_pages, validate_pairs
from kvferry.plan.planner import PoolPlan, Row, TransferPlan, plan_pages, plan_transfer
from kvferry.plan.ranks import PageSlice, replica_source, shard_layout, source_ranks
from kvferry.plan.tokens import TokenPlan, TokenPlanner, TokenSpan, plan_token_transfer
from kvferry.plan.tp import TPPlan, TPPlanner, plan_decode_rank, plan_tp_transfer

__all__ = ["PageSlice", "PagesArg", "Plan", "PoolPlan", "Row", "TPPlan", "TPPlanner", "TokenPlan", "TokenPlanner",
           "TokenSpan", "TransferPlan", "plan_decode_rank", "plan_pages", "plan_token_transfer", "plan_tp_transfer",
           "plan_transfer", "replica_source",
           "shard_layout", "source_ranks", "validate_pages", "validate_pairs"]
