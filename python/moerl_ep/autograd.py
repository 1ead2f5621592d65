"""Autograd over moerl_ep.Buffer: dispatch's backward is a combine, combine's is a cached dispatch.

    recv_x, recv_idx, recv_w, counts, handle = moerl_ep.autograd.dispatch(buffer, x, topk_idx, topk_w, E)
    y = ...local experts on recv_x...
    out = moerl_ep.autograd.combine(buffer, y, handle, anchor=recv_x)

Every rank must run the same backward collectives: `anchor` (the dispatched rows) keeps the combine in
the graph on a rank whose experts got no row, and topk_weights either requires grad on every rank or on
none. MoE is a complete layer on top of these.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .buffer import Buffer, DispatchHandle


class _HandleBox:
    handle: Optional[DispatchHandle] = None
    counts: Optional[List[int]] = None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, box):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights.detach().float(), num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        box.handle, box.counts = handle, counts
        ctx.buffer, ctx.handle, ctx.weights_dtype = buffer, handle, topk_weights.dtype
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_w):
        want_w = ctx.needs_input_grad[1]
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.contiguous(), ctx.handle,
                                               topk_weights=grad_recv_w if want_w else None)
        return grad_x, (grad_w.to(ctx.weights_dtype) if want_w else None), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, anchor, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return buffer.combine(y.contiguous(), handle)[0]

    @staticmethod
    def backward(ctx, grad_out):
        grad_y = ctx.buffer.dispatch(grad_out.contiguous(), handle=ctx.handle)[0]
        # Without a path through y (no local rows) the anchor carries the call into dispatch's backward.
        grad_anchor = None
        if ctx.needs_input_grad[1] and not ctx.needs_input_grad[0]:
            grad_anchor = grad_y.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)
        return grad_y, grad_anchor, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int], DispatchHandle]:
    """Differentiable in x and topk_weights. Returns recv_x [R, H], recv_topk_idx [R, K] (local ids or
    -1), recv_topk_weights [R, K], tokens per local expert and the handle for combine."""
    box = _HandleBox()
    recv_x, recv_idx, recv_w = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts, box)
    return recv_x, recv_idx, recv_w, box.counts, box.handle


def combine(buffer: Buffer, y: torch.Tensor, handle: DispatchHandle, anchor: torch.Tensor) -> torch.Tensor:
    """Differentiable in y: [R, H] rows (already weighted and reduced over local experts) -> [T, H]."""
    return _Combine.apply(y, anchor, buffer, handle)


def experts_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t,k] * SwiGLU expert topk_idx[t,k] (x); ids index w_* [E, ...], -1 is no expert."""
    y = torch.zeros_like(x)
    for e in range(w_gate.size(0)):
        hit = topk_idx == e
        rows = hit.any(dim=1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        xe = x.index_select(0, rows)
        h = F.silu(xe @ w_gate[e].t()) * (xe @ w_up[e].t())
        w = (topk_weights * hit).sum(dim=1).index_select(0, rows).to(x.dtype)
        y = y.index_add(0, rows, (h @ w_down[e].t()) * w.unsqueeze(1))
    return y


class MoE(torch.nn.Module):
    """A top-k MoE layer (softmax router, SwiGLU experts) with its experts sharded over buffer's group:
    rank r holds experts [r * L, (r + 1) * L), L = ceil(num_experts / world). With buffer=None it is the
    single-process layer holding every expert."""

    def __init__(self, buffer: Optional[Buffer], hidden: int, ffn: int, num_experts: int, top_k: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.buffer, self.num_experts, self.top_k = buffer, num_experts, top_k
        world, rank = (buffer.group_size, buffer.rank) if buffer is not None else (1, 0)
        local = -(-num_experts // world)
        self.first_expert = rank * local
        n = max(min(local, num_experts - self.first_expert), 0)
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.w_gate = torch.nn.Parameter(torch.empty(n, ffn, hidden, dtype=dtype))
        self.w_up = torch.nn.Parameter(torch.empty(n, ffn, hidden, dtype=dtype))
        self.w_down = torch.nn.Parameter(torch.empty(n, hidden, ffn, dtype=dtype))

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        return idx, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weights = self.route(x)
        if self.buffer is None:
            return experts_forward(x, topk_idx, topk_weights, self.w_gate, self.w_up, self.w_down)
        recv_x, recv_idx, recv_w, _, handle = dispatch(self.buffer, x, topk_idx, topk_weights, self.num_experts)
        y = experts_forward(recv_x, recv_idx, recv_w, self.w_gate, self.w_up, self.w_down)
        return combine(self.buffer, y, handle, anchor=recv_x)
