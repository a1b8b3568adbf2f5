"""A mixture of experts in place of a layer's MLP (Qwen3-MoE): a router scores every expert for
each row of the fused token matrix, each row takes its top k, and each chosen expert runs once
over all the rows that chose it (experts no row chose are not touched).

A row's result depends only on its own routing: each expert's rows are computed as a matrix of
those rows, and each row's k contributions are added in the order of the experts' indices,
starting from zero, as transformers' Qwen3MoeExperts does (its eager implementation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.layers import new_param, rows
from flover.models.model_config import MoEConfig
from flover.models.safetensors_reader import WeightSpec


class ExpertsMLP(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int, act, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg, self.act = moe, act
        e, inter = moe.experts, moe.intermediate
        self.router = new_param(e, hidden, dtype=dtype, device=device)  # [experts, hidden]
        self.gate_up = new_param(e, 2 * inter, hidden, dtype=dtype, device=device)  # gate rows, then up rows
        self.down = new_param(e, hidden, inter, dtype=dtype, device=device)

    def weight_specs(self, mlp: str, hidden: int) -> list[WeightSpec]:
        """Hugging Face's per-expert tensors (mlp.experts.{e}.gate_proj ...) into the stacked ones."""
        inter = self.cfg.intermediate
        specs = [
            WeightSpec(self.router, (rows(f"{mlp}.gate.weight", (self.cfg.experts, hidden), 0, self.cfg.experts),))
        ]
        for e in range(self.cfg.experts):
            expert = f"{mlp}.experts.{e}"
            gate_up = tuple(rows(f"{expert}.{n}_proj.weight", (inter, hidden), 0, inter) for n in ("gate", "up"))
            specs.append(WeightSpec(self.gate_up[e], gate_up))
            specs.append(WeightSpec(self.down[e], (rows(f"{expert}.down_proj.weight", (hidden, inter), 0, hidden),)))
        return specs

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (experts [T, k], weights [T, k] in x's dtype)."""
        logits = F.linear(x, self.router)  # [T, experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending: each row's sum in the experts' order
            row, slot = torch.where(experts == e)
            gate, up = F.linear(x[row], self.gate_up[e]).chunk(2, dim=-1)  # [n, inter] each
            y = F.linear(self.act(gate) * up, self.down[e]) * weights[row, slot, None]  # [n, hidden]
            out.index_add_(0, row, y.to(out.dtype))
        return out
