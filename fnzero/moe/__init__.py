"""Mixture of Experts (`specs/moe.md`): DeepSpeed's `deepspeed.moe.layer.MoE` at expert-parallel size 1.

    MoE          the layer: top-1/top-2 gating with capacity, token dropping, random token selection,
                 noisy gating from an explicit generator, the residual MoE; forward returns
                 (output, l_aux, exp_counts)
    TopKGate, MOELayer, Experts   its parts, under DeepSpeed's names (a state_dict moves between them)
    Routes, top1_routes, top2_routes, capacity_for   the routing as functions of the router's logits
"""

from ._gating import Routes, capacity_for, top1_routes, top2_routes
from ._layer import MoE, Experts, MOELayer, TopKGate

__all__ = ["Experts", "MOELayer", "MoE", "Routes", "TopKGate", "capacity_for", "top1_routes", "top2_routes"]
