"""MoonEP: perfectly balanced expert parallelism (K3 report, Sec. 4 and App. E).

Every EP rank processes exactly S*K token-expert pairs on static shapes: hot experts are replicated
from the current router output, at most E/R redundant experts per rank, each rank's remote pairs from
one home rank.

Public: ``moonep_experts`` (the entry: one EP MoE step, ``mode="moonep"`` or the ``"alltoall"``
baseline), ``plan`` / ``Plan`` (the planner), ``layout`` / ``Layout`` (each pair's destination row),
``plan_and_layout`` (both, the layout's plan-free steps overlapping the plan on a GPU), ``plan_reference`` and
``dense_moe`` (the references).
"""
from k3lab.moonep.ep import MODES, moonep_experts
from k3lab.moonep.naive import dense_moe, plan_reference
from k3lab.moonep.planner import Layout, Plan, layout, plan, plan_and_layout

__all__ = ["MODES", "moonep_experts", "plan", "Plan", "layout", "Layout", "plan_and_layout", "plan_reference",
           "dense_moe"]
