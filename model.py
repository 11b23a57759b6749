"""
A GPT whose residual connections are pluggable: one decoder, every depth-routing scheme behind
`GPTConfig.residual` (the `RESIDUALS` registry; docs/variants.md writes out the math of each).

- standard:    x <- x + f_k(x), the pre-norm baseline.
- scaled_residual: x <- lambda_k x + mu_k h_0 + f_k(x), learned scalars on the stream and an
               embedding skip (the modded-nanogpt / nanochat dense baseline).
- attnres:     Attention Residuals (Kimi Team, arXiv 2603.15031). Each sublayer reads a softmax
               mix of earlier block outputs; attnres_block_size=1 is Full AttnRes, >1 Block.
- delta_attnres: Delta Attention Residuals (arXiv 2605.18855): the standard stream, and each sublayer's
               input adds a softmax read over the embedding and every earlier sublayer output.
- mhar:        Multi-Head Attention Residuals (arXiv 2607.27230): AttnRes with 4 depth softmaxes per
               read, each routing a quarter of the channels.
- rd_attnres:  Role-Decoupled AttnRes (arXiv 2608.01075; design inferred from the abstract): the
               attention sublayer reads its queries/keys and its values through separate routes.
- dar:         Dual Attention Residuals (arXiv 2607.18730; inferred from the abstract): two
               streams, each read by the other's keys, fused into one sublayer input.
- hc, mhc:     Hyper-Connections (arXiv 2409.19606) and Manifold-Constrained HC (arXiv
               2512.24880): n residual streams mixed by learned (doubly stochastic) matrices.
- denseformer: DenseFormer (arXiv 2402.02622): after each layer, a learned static weighted
               average of the embedding and every layer output so far.
- postnorm:    Post-LN, x <- RMSNorm_k(x + f_k(x)); the one scheme that is NOT `standard` at init.
- laurel_rw, laurel_lr, laurel: LAuReL (arXiv 2411.07501): learned residual weights, a low-rank
               learned skip, and the two combined.
- frac:        Frac-Connections (arXiv 2503.14125): hyper-connections over fractions of the stream.
- muddformer:  MUDDFormer (arXiv 2502.12170): after each layer, four per-token dense aggregations of
               every layer output, for the next layer's query, key, value and residual inputs.

Reading order (banners mark each part below):
  1. the transformer branch: RMSNorm, rotary attention, MLP, MoE, Block (what every scheme feeds);
  2. the depth read: the softmax-over-depth primitive of the AttnRes family;
  3. the residual schemes: ResidualScheme (the interface), then one class per scheme;
  4. the registry and the optimizer: RESIDUALS, MuonAdamW;
  5. GPTConfig and GPT: the settings, the model, GPT.hidden (the one loop over the 2L sublayers);
  6. the analysis API: GPT.routing_diagnostics, intervene, interventions.

The transformer branch (attention, MLP) never learns which scheme feeds it: attention takes a
query, a key and a value input (plus RD's optional value gain; one input feeds all three by
default, through one fused projection), the MLP takes one input. A scheme is a small module with
the methods ResidualScheme declares, and GPT.hidden is one loop over the 2L sublayers. Under any
scheme the MLP may be a sparse mixture of experts (n_experts > 1: class MoE).

Adding a scheme:
  1. subclass ResidualScheme and write its REQUIRED surface: start, read, write, extra_params (its
     parameter count, as a formula), check (its config errors) and `options` (the GPTConfig fields
     only it reads; add them to GPTConfig with a default). Decode sublayer indices with layer_of,
     is_attention and is_output, never by hand;
  2. make it exactly `standard` at init (tests/test_model.py checks it; a scheme that by design cannot be,
     as postnorm, says `standard_at_init = False`); random init is allowed:
     GPT builds the scheme under its own RNG, after the shared weights, so just call nn.init.*;
  3. optionally: read_attention (separate query, key and value inputs), interventions() with
     `intervention_kinds` (analysis switches, read from self.intervention), diagnostics through
     self.note(name, compute) (free when off), dead_rows() (rows that get no gradient by construction);
  4. add one line to RESIDUALS and run `pytest tests -k NAME`: every generic test (zero init,
     shared init, gradients from init, causality, an fp32 stream under autocast, compile, counts,
     diagnostics, interventions, MoE, warm start, analysis) is parametrized over the registry and
     reads what the scheme declares; its failure message says what to fix. Add a reference test of
     your formulas beside the others. README.md's "Add a scheme" gives the contract of
     read_attention, where a scheme of several reads keeps them (its state) and the precision rule.
"""

import hashlib
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


# -----------------------------------------------------------------------------
# The transformer branch: the norm, rotary attention, the MLP and its mixture-of-experts form, and
# Block, which runs one sublayer on the inputs a scheme reads. Nothing here knows the scheme.


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rotary_tables(head_size, length, base=10000.0):
    # fp32 tables in the rotate-half layout: channel i pairs with channel i + head_size/2
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """x (B, T, H, D) rotated by the fp32 tables (T, 1, D); the result in x's dtype. Rotating in
    this layout, before the heads are transposed, keeps the kernel's reads and writes contiguous,
    and under torch.compile the fp32 products stay in registers (one bf16 read, one bf16 write)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout
        cos, sin = rotary_tables(config.n_embd // config.n_head, config.block_size)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def project(self, h_q, h_k, h_v):
        """Q, K, V (B, T, C) from their inputs; an input that is None is h_q, and shares its matmul."""
        C = h_q.size(-1)
        if h_k is None and h_v is None:  # the fast path: one fused projection
            return self.c_attn(h_q).split(C, dim=2)
        W = self.c_attn.weight
        if h_k is None:
            q, k = F.linear(h_q, W[: 2 * C]).split(C, dim=2)
            return q, k, F.linear(h_v, W[2 * C :])
        return tuple(F.linear(h, W[i * C : (i + 1) * C]) for i, h in enumerate((h_q, h_k, h_q if h_v is None else h_v)))

    def forward(self, h_q, h_k=None, h_v=None):
        """h_q feeds the queries, h_k the keys, h_v the values (all already normalised; None: h_q)."""
        B, T, C = h_q.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in self.project(h_q, h_k, h_v))
        cos, sin = self.rotary_cos[:T, None], self.rotary_sin[:T, None]
        q, k, v = (t.transpose(1, 2) for t in (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config, hidden=None):
        super().__init__()
        hidden = hidden or 4 * config.n_embd  # MoE experts: their own width
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # exact (erf) GELU


# grouped matmul (CUDA bf16 kernels): torch.nn.functional.grouped_mm, or torch._grouped_mm before it was public
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUP_ALIGN = 8  # rows per expert group padded to a multiple of 16 bytes in bf16 (the backward's jagged dimension)


def expert_hidden(config):
    """An expert's hidden width: moe_expert_hidden, or when 0 the width at which the k routed and the
    shared experts a token reaches cost what the dense MLP does, 4d / (k + shared), rounded to the
    nearest multiple of 64 (halves up), at least 64."""
    if config.moe_expert_hidden:
        return config.moe_expert_hidden
    return 64 * max(1, math.floor(config.n_embd / (16 * (config.moe_top_k + config.moe_shared_experts)) + 0.5))


class MoE(nn.Module):
    """
    A sparse mixture-of-experts MLP (n_experts > 1): out = sum_j g_j E_j(x) + S(x) over a token's
    moe_top_k experts j, plus moe_shared_experts experts every token reaches (S: one MLP of their
    summed width). Token choice, dropless: every token reaches its k experts, no capacity.
    Router (DeepSeek-V3): fp32 scores s = sigmoid(W_r x); the experts are the top k of s + b, b the
    balancing bias, which steers selection only; the gates g are the chosen s normalised to sum to 1.
    Balancing without an auxiliary loss: training forwards count each expert's routed tokens in
    expert_load; after each optimizer step GPT.update_expert_bias sums them over ranks and moves
    b_e by moe_bias_rate * sign(mean load - load_e). Both are buffers, so they are checkpointed.
    Two expert paths, one result: experts_loop (the reference: one matmul pair per expert; CPU, fp32)
    and experts_grouped (one grouped matmul for all experts: CUDA under bf16 autocast).
    """

    def __init__(self, config):
        super().__init__()
        self.router = nn.Linear(config.n_embd, config.n_experts, bias=False)
        self.experts = nn.ModuleList([MLP(config, expert_hidden(config)) for _ in range(config.n_experts)])
        self.shared = (
            MLP(config, config.moe_shared_experts * expert_hidden(config)) if config.moe_shared_experts else None
        )
        self.dropout = nn.Dropout(config.dropout)  # on the routed sum, so that both paths drop alike
        self.top_k, self.bias_rate = config.moe_top_k, config.moe_bias_rate
        self.register_buffer("expert_bias", torch.zeros(config.n_experts))
        # routed (token, expert) pairs since the last bias update; activation checkpointing recomputes
        # the forward and counts each pair twice, which the sign update (of proportions) does not see
        self.register_buffer("expert_load", torch.zeros(config.n_experts, dtype=torch.long))
        self.record = None  # routing_diagnostics: a dict while it runs (an attribute from the start: compile guards)

    def route(self, x):
        """x (N, d) -> each token's experts (N, k), their gates (N, k) and all scores (N, E), fp32 (fp64 for fp64 x)."""
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.to(acc), self.router.weight.to(acc)))
            experts = torch.topk(scores + self.expert_bias.to(acc), self.top_k, dim=-1).indices
            chosen = scores.gather(-1, experts)
        return experts, chosen / chosen.sum(-1, keepdim=True), scores

    def grouped(self, x):
        """Whether experts_grouped runs: its kernels are CUDA bf16 (sm80+), its strides multiples of 16 bytes."""
        widths = (x.size(-1), self.experts[0].c_fc.out_features)
        return (
            GROUPED_MM is not None
            and x.is_cuda
            and torch.is_autocast_enabled(x.device.type)
            and torch.get_autocast_dtype(x.device.type) == torch.bfloat16
            and all(w % 8 == 0 for w in widths)
        )

    def experts_loop(self, x, experts, load):
        """(N, k, d): each token's k expert outputs, one expert at a time over the tokens that chose it
        (sizes known only at run time: a graph break under torch.compile, unless dynamo is told to
        capture dynamic-shape operators, capture_dynamic_output_shape_ops)."""
        ys = x.new_zeros(*experts.shape, x.size(-1))
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(experts == e)
            ys[token, slot] = expert.c_proj(F.gelu(expert.c_fc(x[token]))).to(ys.dtype)
        return ys

    def experts_grouped(self, x, experts, load):
        """(N, k, d) as experts_loop, by two grouped matmuls over all experts: the (token, slot) pairs
        sorted by expert into a buffer of static size N k + E * GROUP_ALIGN rows, each expert's group
        padded to a multiple of GROUP_ALIGN (no host sync, no dynamic shape: compiles as one graph)."""
        N, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # pairs grouped by expert, in token order within a group
        padded = (load + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        ends = padded.cumsum(0)
        start, padded_start = load.cumsum(0) - load, ends - padded
        sorted_e = flat[order]
        rows = torch.empty_like(order).index_put_(  # the buffer row of each pair, in (token, slot) order
            (order,), padded_start[sorted_e] + torch.arange(N * k, device=x.device) - start[sorted_e]
        )
        xs = x.new_zeros(N * k + len(self.experts) * GROUP_ALIGN, x.size(-1), dtype=torch.bfloat16)
        xs = xs.index_put((rows,), x.to(torch.bfloat16).repeat_interleave(k, dim=0))
        w_fc = torch.stack([e.c_fc.weight for e in self.experts]).to(torch.bfloat16)  # (E, h, d)
        w_proj = torch.stack([e.c_proj.weight for e in self.experts]).to(torch.bfloat16)  # (E, d, h)
        offs = ends.to(torch.int32)
        h = F.gelu(GROUPED_MM(xs, w_fc.transpose(1, 2), offs=offs))
        return GROUPED_MM(h, w_proj.transpose(1, 2), offs=offs)[rows].view(N, k, -1)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, gates, scores = self.route(x)
        load = torch.zeros_like(self.expert_load).scatter_add_(0, experts.flatten(), torch.ones_like(experts.flatten()))
        if self.training and torch.is_grad_enabled():  # a training forward (not evaluation, not diagnostics)
            self.expert_load += load
        if self.record is not None:
            p = scores / scores.sum(-1, keepdim=True)
            self.record.update(load=load.float() / x.size(0), entropy=-torch.special.xlogy(p, p).sum(-1).mean())
        ys = (self.experts_grouped if self.grouped(x) else self.experts_loop)(x, experts, load)
        out = self.dropout((ys * gates.unsqueeze(-1)).sum(1))  # gates in fp32: the sum too
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(*shape[:-1], -1)


class Block(nn.Module):
    """One layer = two sublayers, each with its own pre-norm. The residual scheme does the adding."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config) if config.n_experts == 1 else MoE(config)

    def attention(self, x_q, x_k, x_v, value_gain=None):
        """Attention over the query, key and value inputs; an input that is an earlier one is normalised once."""
        # value_gain: RD's 'param' control, a per-channel gain after the norm (before it, the norm would undo
        # part of it)
        h_q = self.ln_1(x_q)
        h_k = h_q if x_k is x_q else self.ln_1(x_k)
        h_v = h_q if x_v is x_q else h_k if x_v is x_k else self.ln_1(x_v)
        if value_gain is not None:
            h_v = h_v * (1 + value_gain)
        # None, not h_q: FSDP2 hands its module new tensor objects in forward but not in checkpoint's
        # recomputation, so a test of identity inside attn would pick another path there
        return self.attn(h_q, None if h_k is h_q else h_k, None if h_v is h_q else h_v)

    def feedforward(self, x):
        return self.mlp(self.ln_2(x))


# -----------------------------------------------------------------------------
# The depth read: the one primitive behind every AttnRes-family route
#
# A read with direction u (its query times its key gain) over sources s_1 .. s_n (B, T, d) is
# softmax attention over depth at every token, each source its own key:
#     l_i = <u, s_i> / rms(s_i),   alpha = softmax(l),   out = sum_i alpha_i s_i.
# Within a block the sealed sources do not change, so (the AttnRes paper's two-phase form) all
# the reads of a block are done over them when the block opens (depth_read_sealed: compiled, each
# sealed source is read once for all of them), and each read later adds the block's running partial
# sum p by one online-softmax step (depth_read_extend), which is exactly the read over s_1 .. s_n, p:
#     out = (1 - beta) a + beta p,   beta = sigmoid(l_p - logsumexp_{i <= n} l_i).
# 12 layers in blocks of 4: the norms and logits, and the mix, each read 46 sources per forward
# instead of 109. DAR takes the weights only (depth_weights_sealed, depth_weights_extend) and
# mixes at read time (DualAttnRes).


class DepthSoftmax(NamedTuple):
    """R softmax reads over the same n sources: the R mixes (B, T, d) - None from the depth_weights_*
    functions, which compute the weights only - the weights (B, T, R, n) and their logits'
    logsumexp (B, T, R), which extending to one more source needs."""

    outputs: list | None
    weights: torch.Tensor
    lse: torch.Tensor


def depth_logits(keys, directions, eps):
    """
    l (B, T, R, n) = <u_r, k_i> / rms(k_i) for R directions over n keys (B, T, d); no 1/sqrt(d), no
    mixing across tokens. fp32 (fp64 for gradcheck) whatever the autocast, written elementwise so
    that the compiler fuses the R dot products and the norm into one pass over each key.
    """
    acc = torch.promote_types(keys[0].dtype, torch.float32)
    with torch.autocast(keys[0].device.type, enabled=False):
        u = directions.to(acc)
        return torch.stack(
            [
                (key.to(acc).unsqueeze(-2) * u).sum(-1) * torch.rsqrt(key.to(acc).pow(2).mean(-1, keepdim=True) + eps)
                for key in keys
            ],
            dim=-1,
        )


def depth_mix(values, weights):
    """sum_i weights[..., r, i] * v_i for each route r: R tensors (B, T, d) in the values' dtype,
    accumulated in the weights' dtype. The values are never stacked: autograd keeps references to
    them (alive anyway) and the per-token weights, not a copy. Each route is its own tensor, so
    what backward keeps of one (its norm's input) does not keep the others alive; compiled,
    inductor can fuse the routes' sums into one kernel that reads each value once (it does on CPU)."""
    with torch.autocast(values[0].device.type, enabled=False):
        outputs = []
        for r in range(weights.size(-2)):
            mixed = weights[..., r, 0, None] * values[0].to(weights.dtype)
            for i in range(1, len(values)):
                mixed = mixed + weights[..., r, i, None] * values[i].to(weights.dtype)
            outputs.append(mixed.to(values[0].dtype))
    return outputs


def depth_weights(keys, directions, eps):
    """The softmax over the n keys (B, T, R, n) and its logsumexp (B, T, R)."""
    logits = depth_logits(keys, directions, eps)
    lse = logits.logsumexp(-1)
    return (logits - lse.unsqueeze(-1)).exp(), lse


def depth_read(keys, values, directions, eps):
    """
    R reads (directions (R, d)) over n sources, each source read once for all. keys, values: lists
    of n tensors (B, T, d) in the residual stream's dtype, oldest first (the same list, unless a
    scheme addresses its sources by other keys). Returns a DepthSoftmax.
    """
    weights, lse = depth_weights(keys, directions, eps)
    if len(values) == 1:  # a read over one source is that source
        return DepthSoftmax([values[0]] * directions.size(0), torch.ones_like(weights), lse)
    return DepthSoftmax(depth_mix(values, weights), weights, lse)


class OnlineSoftmaxStep(torch.autograd.Function):
    """out = a + beta (v - a), beta = sigmoid(gap). The gradient through beta is written with out
    instead of a, beta (1 - beta)(v - a) = beta (v - out), so backward keeps out (which the next
    norm keeps anyway, in an fp32 stream) and not the phase-1 read a: one (B, T, d) tensor less
    per read. First derivatives only (once_differentiable: a double backward raises)."""

    @staticmethod
    def forward(ctx, a, v, gap):
        beta = torch.sigmoid(gap)
        out = a + beta * (v - a)
        ctx.save_for_backward(v, out, beta)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        v, out, beta = ctx.saved_tensors
        return grad * (1 - beta), grad * beta, beta * (grad * (v - out)).sum(-1, keepdim=True)


def depth_weights_extend(read, key, directions, eps):
    """Phase 2, weights only: the weights and logsumexp of a DepthSoftmax over n sources extended by
    one more source, addressed by key (B, T, d), with the same R directions (outputs None)."""
    logit = depth_logits([key], directions, eps)[..., 0]
    beta = torch.sigmoid(logit - read.lse).unsqueeze(-1)
    return DepthSoftmax(None, torch.cat([read.weights * (1 - beta), beta], dim=-1), torch.logaddexp(read.lse, logit))


def depth_read_extend(read, key, value, directions, eps):
    """Phase 2: a DepthSoftmax over n sources extended by one more, (key, value) (B, T, d), with the
    same R directions: the DepthSoftmax over n + 1 sources, mixes included."""
    logit = depth_logits([key], directions, eps)[..., 0]
    gap = logit - read.lse
    with torch.autocast(value.device.type, enabled=False):
        outputs = [
            OnlineSoftmaxStep.apply(a.to(gap.dtype), value.to(gap.dtype), gap[..., r, None]).to(a.dtype)
            for r, a in enumerate(read.outputs)
        ]
    beta = torch.sigmoid(gap).unsqueeze(-1)
    return DepthSoftmax(outputs, torch.cat([read.weights * (1 - beta), beta], dim=-1), torch.logaddexp(read.lse, logit))


def split_by_read(result, directions):
    """{read k: its rows of one DepthSoftmax} for the reads whose directions were concatenated."""
    reads, r = {}, 0
    for k, u in directions.items():
        routes = slice(r, r + u.size(0))
        outputs = None if result.outputs is None else result.outputs[routes]
        reads[k] = DepthSoftmax(outputs, result.weights[..., routes, :], result.lse[..., routes])
        r += u.size(0)
    return reads


def depth_read_sealed(keys, values, directions, eps):
    """Phase 1, when a block opens: directions {read k: (R_k, d)} of the block's reads -> {read k:
    DepthSoftmax} over the sealed sources, each source read once for all of them."""
    return split_by_read(depth_read(keys, values, torch.cat(list(directions.values())), eps), directions)


def depth_weights_sealed(keys, directions, eps):
    """Phase 1, weights only (outputs None), for a scheme that mixes at read time."""
    return split_by_read(
        DepthSoftmax(None, *depth_weights(keys, torch.cat(list(directions.values())), eps)), directions
    )


def cosine_matrix(sources):
    """Token-wise cosine similarity of every pair of sources (B, T, d): (B, T, S, S) in fp32."""
    with torch.autocast(sources[0].device.type, enabled=False):
        unit = F.normalize(torch.stack([s.float() for s in sources], dim=-2), dim=-1)
        return unit @ unit.transpose(-1, -2)


def js_divergence(p, q):
    """Jensen-Shannon divergence (nats) between distributions on the last axis."""
    m = 0.5 * (p + q)
    kl = lambda a: (torch.special.xlogy(a, a) - torch.special.xlogy(a, m)).sum(-1)
    return 0.5 * kl(p) + 0.5 * kl(q)


# -----------------------------------------------------------------------------
# Residual schemes. State flows functionally: write() returns the new state.
#
# Sublayers are numbered k = 0 .. 2L - 1: even k is layer k // 2's attention, odd k its MLP; the
# output read (into ln_f and the head) is k = 2L, a scheme's `output_read`.


def layer_of(k):
    """The layer that sublayer k belongs to."""
    return k // 2


def is_attention(k):
    """Whether sublayer k < output_read is its layer's attention (else its MLP); test is_output first."""
    return k % 2 == 0


class ResidualScheme(nn.Module):
    """
    What GPT.hidden drives: state = start(x); for each sublayer k, its input is read(state, k)
    (read_attention for attention), and state = write(state, k, its output); the output read is
    read(state, output_read). The state is whatever start() returns.

    REQUIRED: start, read, write, extra_params, and where they apply check and `options` (the
    GPTConfig fields only this scheme reads; another scheme must leave them at their defaults,
    GPTConfig checks this). OPTIONAL: read_attention (attention reads other than its MLP: separate
    query, key and value inputs), interventions (analysis switches, with `intervention_kinds`),
    diagnostics (self.note), dead_rows (parameter rows that get no gradient by construction).

    Rules: the model must be exactly `standard` at init (up to the norms' eps), so that an arm
    starts where the baseline does (postnorm, Post-LN, cannot be by design; it says so). __init__ may
    draw random numbers (nn.init.normal_ etc.): GPT builds the scheme after the shared weights, under an
    RNG of its own seeded from the model's seed and the scheme's name, so the shared weights and the
    global RNG are the same in every arm.

    Diagnostics: while GPT.routing_diagnostics runs, self.record is a dict of per-token tensors
    (B, T, ...) that self.note fills (free otherwise). A key without '/' holds a read's depth
    weights over its sources (embedding first, summing to 1), named name_of(k) plus the route when
    a read has several ('attn_v.{l}' for a separate value route, '.s0' / '.s1' for DAR's streams);
    any other quantity is 'group/read name'.
    Interventions: an analysis may set self.intervention (through GPT.intervene) to an intervention
    (kind, *where) whose kind is in `intervention_kinds`; interventions() lists every one this
    scheme's settings accept, and each must change the loss once the routing parameters are random
    (tested).
    """

    options = ()  # required where it applies: the GPTConfig fields only this scheme reads
    intervention_kinds = ()  # optional: the kinds of intervention this scheme accepts

    def __init__(self, config):
        super().__init__()
        self.n_sublayers = 2 * config.n_layer
        self.output_read = self.n_sublayers  # the index of the read into ln_f and the head
        # instance attributes from the start: setting one later (diagnostics, an analysis) would
        # change what torch.compile guards on and recompile the training graph once
        self.record, self.intervention = None, None

    # --- required ---

    @staticmethod
    def check(config):
        """Raise ValueError, one line, for settings this scheme cannot run (called by GPTConfig)."""

    @staticmethod
    def extra_params(config):
        """The scheme's parameter count as a formula of the config (tested against its tensors)."""
        raise NotImplementedError

    def start(self, x):
        """The state before sublayer 0, from the embedding x (B, T, d)."""
        raise NotImplementedError

    def read(self, state, k):
        """The input (B, T, d) of sublayer k (of attention too, unless read_attention says otherwise), or of
        the output when k is output_read."""
        raise NotImplementedError

    def write(self, state, k, out):
        """The state once sublayer k's output `out` (B, T, d) has joined it."""
        raise NotImplementedError

    # --- optional ---

    def read_attention(self, state, k):
        """(query input, key input, value input, per-channel value gain or None) of attention sublayer k;
        one read feeds all three by default (and then one fused projection computes Q, K and V)."""
        x = self.read(state, k)
        return x, x, x, None

    def interventions(self):
        """Every intervention GPT.intervene accepts for this scheme's settings, in a fixed order."""
        return []

    def dead_rows(self):
        """{parameter name: rows (first axis) that get no gradient by construction}, e.g. the query of
        a read that sees one source; every other row of every parameter must learn (tested)."""
        return {}

    # --- helpers ---

    def is_output(self, k):
        """Whether k is the output read (into ln_f and the head) rather than a sublayer."""
        return k == self.output_read

    def name_of(self, k):
        """The diagnostics name of read k: attn.{layer}, mlp.{layer}, or out."""
        return "out" if self.is_output(k) else f"attn.{layer_of(k)}" if is_attention(k) else f"mlp.{layer_of(k)}"

    def note(self, name, compute):
        """Record compute() under name while diagnostics run; free otherwise (compute is not called)."""
        if self.record is not None:
            self.record[name] = compute()

    def uniform(self, query, name):
        """query, or zeros (uniform depth weights) where an analysis made read `name` uniform."""
        return torch.zeros_like(query) if self.intervention == ("uniform", name) else query


class StandardResidual(ResidualScheme):
    """x <- x + f_k(x). No parameters; the state is the stream x."""

    @staticmethod
    def extra_params(config):
        return 0

    def start(self, x):
        return x

    def read(self, x, k):
        return x

    def write(self, x, k, out):
        return x + out


class Skip(NamedTuple):
    """scaled_residual's state: the stream x and the embedding it skips to every sublayer."""

    x: torch.Tensor
    embedding: torch.Tensor


class ScaledResidual(ResidualScheme):
    """
    x <- lambda_k x + mu_k h_0 + f_k(x): a learned scalar on the stream and one on an embedding skip
    per sublayer (the dense baseline of modded-nanogpt and nanochat). lambda = 1, mu = 0 at init:
    exactly `standard` (1 * x and 0 * h_0 are exact), yet both get a gradient from the first step.
    Intervention ("identity_scales",): every lambda 1 and every mu 0, the standard residual.
    """

    intervention_kinds = ("identity_scales",)

    @staticmethod
    def extra_params(config):
        return 2 * 2 * config.n_layer  # lambda and mu per sublayer

    def __init__(self, config):
        super().__init__(config)
        self.residual_scale = nn.Parameter(torch.ones(self.n_sublayers))  # lambda_k
        self.embedding_scale = nn.Parameter(torch.zeros(self.n_sublayers))  # mu_k

    def start(self, x):
        return Skip(x, x)

    def interventions(self):
        return [("identity_scales",)]

    def read(self, state, k):
        return state.x

    def write(self, state, k, out):
        lam, mu = self.residual_scale[k], self.embedding_scale[k]
        self.note(f"scales/{self.name_of(k)}", lambda: torch.stack([lam, mu]).expand(*out.shape[:-1], 2))
        if self.intervention == ("identity_scales",):
            return state._replace(x=state.x + out)
        return state._replace(x=lam * state.x + mu * state.embedding + out)


class History(NamedTuple):
    """An AttnRes stream: its sealed blocks (the embedding, then one sum of attnres_block_size
    sublayer outputs each), the open block's running sum `partial` (None right after a seal) and
    `sealed_reads`: read k -> phase 1's DepthSoftmax of it over the sealed blocks, for every read
    of the open block (DAR: weights only, addressed by the keys of the stream that keys this one)."""

    blocks: list
    partial: torch.Tensor | None
    sealed_reads: dict

    def sources(self):
        """Everything a read of the open block looks at, oldest first: the sealed blocks, then the partial."""
        return self.blocks if self.partial is None else self.blocks + [self.partial]


def reads_in_block(k, block_size, n_sublayers):
    """The reads of the block that opens at sublayer k: k .. k + block_size - 1, or the output read."""
    return [k] if k == n_sublayers else range(k, k + block_size)


class AttnRes(ResidualScheme):
    """
    Full (block_size=1) and Block AttnRes. Sources are the embedding, every sealed block (a sum
    of block_size sublayer outputs) and the running partial sum of the current block. Sublayer k
    reads them with its own (query[k], key_gain[k]); row output_read is the output read.
    Intervention ("uniform", read name): that read's depth weights become uniform (a zero query).
    """

    intervention_kinds = ("uniform",)

    @staticmethod
    def check(config):
        size, n_sublayers = config.attnres_block_size, 2 * config.n_layer
        if size < 1 or (size != 1 and size % 2 != 0) or n_sublayers % size != 0:
            valid = [s for s in range(1, n_sublayers + 1) if n_sublayers % s == 0 and (s == 1 or s % 2 == 0)]
            raise ValueError(
                f"attnres_block_size={size} must be 1 (Full) or an even divisor of "
                f"2*n_layer={n_sublayers}; valid: {', '.join(map(str, valid))}"
            )

    @staticmethod
    def extra_params(config):
        return 2 * (2 * config.n_layer + 1) * config.n_embd  # a query and a key gain per read

    def __init__(self, config):
        super().__init__(config)
        # zero queries = uniform weights = the mean of the sources, which is the standard residual
        # stream divided by the source count; the next RMSNorm removes the scale: standard at init
        self.query = nn.Parameter(torch.zeros(self.n_sublayers + 1, config.n_embd))
        self.key_gain = nn.Parameter(torch.ones(self.n_sublayers + 1, config.n_embd))
        self.block_size = config.attnres_block_size
        self.eps = config.norm_eps

    def directions(self, k):
        """(R, d): query times key gain for each route of read k (AttnRes: one)."""
        return self.uniform(self.query[k : k + 1], self.name_of(k)) * self.key_gain[k]

    def open_block(self, blocks, k):
        reads = reads_in_block(k, self.block_size, self.n_sublayers)
        return History(
            blocks, None, depth_read_sealed(blocks, blocks, {j: self.directions(j) for j in reads}, self.eps)
        )

    def start(self, x):
        return self.open_block([x], 0)

    def interventions(self):
        # read 0 sees the embedding alone (the identity whatever its weights); every later read sees 2+ sources
        return [("uniform", self.name_of(k)) for k in range(1, self.output_read + 1)]

    def dead_rows(self):
        return {"query": {0}, "key_gain": {0}}  # sublayer 0 reads the embedding alone

    def full_read(self, state, k):
        """Read k over every source: phase 1's read, extended by the partial sum where there is one."""
        read = state.sealed_reads[k]
        if state.partial is None:
            return read
        return depth_read_extend(read, state.partial, state.partial, self.directions(k), self.eps)

    def read(self, state, k):
        (out,), weights, _ = self.full_read(state, k)
        self.note(self.name_of(k), lambda: weights[..., 0, :])
        if self.is_output(k):  # every source exists here: how alike they are (depth-wise diversity)
            self.note("source_cosine/out", lambda: cosine_matrix(state.blocks))
        return out

    def write(self, state, k, out):
        partial = out if state.partial is None else state.partial + out
        if (k + 1) % self.block_size == 0:  # the block is sealed: it becomes a source of the next block's reads
            return self.open_block(state.blocks + [partial], k + 1)
        return state._replace(partial=partial)


class MultiHeadAttnRes(AttnRes):
    """
    MHAR, Multi-Head Attention Residuals (Luo et al. 2026, arXiv 2607.27230, as the hyper-connection-factory
    code defines it): AttnRes whose every read is HEADS softmaxes over the same sources, head h routing its own
    d / HEADS channels. Head h's logit is its channels' share of AttnRes's, <(w * g)_h, s_h> / rms(s) (the norm
    over all d channels), and channels h of the read are sum_i alpha_hi s_i[h]. Through the depth read's
    weights-only pair (as DAR): HEADS directions, each w * g masked to one head's channels, then one mix of the
    sources with each head's weights on its channels. Zero queries make every head uniform, the AttnRes read:
    `standard` at init. The parameters and the block structure (attnres_block_size) are AttnRes's.
    """

    HEADS = 4  # the peer's default

    @staticmethod
    def check(config):
        AttnRes.check(config)
        if config.n_embd % MultiHeadAttnRes.HEADS != 0:
            raise ValueError(
                f"n_embd={config.n_embd} must split into mhar's {MultiHeadAttnRes.HEADS} depth heads; "
                f"use a multiple of {MultiHeadAttnRes.HEADS}"
            )

    def directions(self, k):
        """(HEADS, d): AttnRes's direction of read k, row h kept on head h's channels only."""
        u = super().directions(k)
        heads = torch.eye(self.HEADS, dtype=u.dtype, device=u.device)
        return heads.repeat_interleave(u.size(-1) // self.HEADS, dim=1) * u

    def open_block(self, blocks, k):
        reads = reads_in_block(k, self.block_size, self.n_sublayers)
        return History(blocks, None, depth_weights_sealed(blocks, {j: self.directions(j) for j in reads}, self.eps))

    def read(self, state, k):
        read, sources = state.sealed_reads[k], state.sources()
        if state.partial is not None:
            read = depth_weights_extend(read, state.partial, self.directions(k), self.eps)
        weights = read.weights  # (B, T, HEADS, n)
        # the heads' mean is the share of the read's channels each source gives; each head's own under 'heads/'
        self.note(self.name_of(k), lambda: weights.mean(-2))
        self.note(f"heads/{self.name_of(k)}", lambda: weights)
        self.note(f"head_entropy/{self.name_of(k)}", lambda: -torch.special.xlogy(weights, weights).sum(-1))
        if self.is_output(k):
            self.note("source_cosine/out", lambda: cosine_matrix(state.blocks))
        with torch.autocast(sources[0].device.type, enabled=False):  # accumulated in the weights' fp32
            x = sum(
                weights[..., i, None] * s.to(weights.dtype).unflatten(-1, (self.HEADS, -1))
                for i, s in enumerate(sources)
            )
        return x.flatten(-2).to(sources[0].dtype)


class DeltaAttnRes(ResidualScheme):
    """
    Delta Attention Residuals (Luo, Cai and Hu, arXiv 2605.18855; the per-sublayer form of the authors' code):
    the stream stays the standard one, x <- x + f_k(.), and each sublayer's input ADDS a softmax read over the
    embedding and every earlier sublayer output (the deltas): x + sum_i softmax_i(<w_k, RMSNorm(v_i)>) v_i,
    where AttnRes replaces the stream by such a read. Sublayer 0 reads x alone (nothing to add yet), the output
    is the stream itself (no output read). NOT `standard` at init: the uniform read adds the sources' mean; the
    authors draw the queries as their model's other weights (normal, std 0.02) and so does this.
    Intervention ("uniform", read name): that read's weights become uniform (a zero query).
    """

    standard_at_init = False
    intervention_kinds = ("uniform",)

    class Deltas(NamedTuple):
        """The state: the standard stream x and the sources its reads add from: the embedding, then every
        sublayer output so far (empty before sublayer 0 has written). Inside the class, so that adding the
        scheme changes no definition another scheme computes with (records.code_record)."""

        x: torch.Tensor
        sources: list

    @staticmethod
    def extra_params(config):
        return 2 * (2 * config.n_layer - 1) * config.n_embd  # a query and a key gain for reads 1 .. 2L - 1

    def __init__(self, config):
        super().__init__(config)
        self.query = nn.Parameter(torch.randn(self.n_sublayers - 1, config.n_embd) * 0.02)  # row k - 1: read k
        self.key_gain = nn.Parameter(torch.ones(self.n_sublayers - 1, config.n_embd))
        self.eps = config.norm_eps

    def start(self, x):
        return self.Deltas(x, [])

    def interventions(self):
        return [("uniform", self.name_of(k)) for k in range(1, self.n_sublayers)]

    def read(self, state, k):
        if not state.sources or self.is_output(k):
            return state.x
        directions = self.uniform(self.query[k - 1 : k], self.name_of(k)) * self.key_gain[k - 1]
        (added,), weights, _ = depth_read(state.sources, state.sources, directions, self.eps)
        self.note(self.name_of(k), lambda: weights[..., 0, :])
        return state.x + added

    def write(self, state, k, out):
        return self.Deltas(state.x + out, (state.sources or [state.x]) + [out])


class DeltaAttnResPaper(DeltaAttnRes):
    """
    Delta AttnRes at the zero query its peer code starts from: every read starts uniform, adding the sources' mean,
    x / (k + 1) at sublayer k (the embedding and the outputs so far sum to the stream x), which the sublayer's
    pre-norm removes: `standard` at init up to the norms' eps.
    """

    standard_at_init = True

    def __init__(self, config):
        super().__init__(config)
        with torch.no_grad():
            self.query.zero_()


class RDAttnRes(AttnRes):
    """
    RD-AttnRes: Block AttnRes whose attention sublayer reads the same sources twice with the same
    key gain - query[k] routes Q/K (the parent's parameter), value_query[l] routes V. Controls:
      none     the method: a zero-init value query per layer (+L d parameters)
      dup      both routes use the parent's query: the parent's function at RD's cost
      param    one route, plus a zero-init per-channel gain u on the value input: V = W_V((1+u) n(a)),
               applied after the block's norm (+L d parameters)
      fixed_v  the value route has uniform weights (a constant zero query, not a parameter)
      mix      RD's two routes and parameters, not split by role: Q, K and V all read the average
               of the two reads, (x_qk + x_v) / 2 (+L d parameters)
    Interventions: AttnRes's, ("uniform", "attn_v.{l}") for the second route, and ("tie_value",)
    or ("tie_value", l): the second route uses the Q/K query (every layer, or layer l): the parent.
    """

    options = ("rd_control",)
    intervention_kinds = ("uniform", "tie_value")
    CONTROLS = ("none", "dup", "param", "fixed_v", "mix")

    @staticmethod
    def check(config):
        AttnRes.check(config)
        if config.rd_control not in RDAttnRes.CONTROLS:
            raise ValueError(f"unknown rd_control {config.rd_control!r}; choose one of {', '.join(RDAttnRes.CONTROLS)}")

    @staticmethod
    def extra_params(config):
        learned = config.rd_control in ("none", "param", "mix")  # a value query or a value gain per layer
        return AttnRes.extra_params(config) + (config.n_layer * config.n_embd if learned else 0)

    def __init__(self, config):
        super().__init__(config)
        self.control, self.n_layer = config.rd_control, config.n_layer
        if self.control in ("none", "mix"):
            self.value_query = nn.Parameter(torch.zeros(config.n_layer, config.n_embd))
        elif self.control == "param":
            self.value_gain = nn.Parameter(torch.zeros(config.n_layer, config.n_embd))

    def interventions(self):
        if self.control not in ("none", "mix"):  # no learned second route: nothing of RD's own to change
            return super().interventions()
        layers = range(1, self.n_layer)  # layer 0's attention reads the embedding alone
        return (
            super().interventions()
            + [("uniform", f"attn_v.{l}") for l in layers]
            + [("tie_value", l) for l in layers]
            + [("tie_value",)]
        )

    def dead_rows(self):
        return super().dead_rows() | ({"value_query": {0}} if self.control in ("none", "mix") else {})

    def directions(self, k):
        """An attention read has two routes, Q/K and V (one under the 'param' control)."""
        if not is_attention(k) or self.is_output(k) or self.control == "param":
            return super().directions(k)
        layer = layer_of(k)
        query = self.uniform(self.query[k], f"attn.{layer}")
        if self.control == "dup" or self.intervention in (("tie_value",), ("tie_value", layer)):
            value_query = query
        elif self.control in ("none", "mix"):
            value_query = self.uniform(self.value_query[layer], f"attn_v.{layer}")
        else:  # fixed_v
            value_query = torch.zeros_like(query)
        return torch.stack([query, value_query]) * self.key_gain[k]

    def read_attention(self, state, k):
        layer = layer_of(k)
        if self.control == "param":
            x = self.read(state, k)
            return x, x, x, self.value_gain[layer]
        (x_qk, x_v), weights, _ = self.full_read(state, k)
        self.note(f"attn.{layer}", lambda: weights[..., 0, :])
        self.note(f"attn_v.{layer}", lambda: weights[..., 1, :])
        if self.control == "mix":
            x = (x_qk + x_v) / 2
            return x, x, x, None
        return x_qk, x_qk, x_v, None


class DualAttnRes(ResidualScheme):
    """
    DAR (design inferred from the abstract): two streams, each with its own History, same block
    boundaries; the state is the pair. Sublayer k reads stream s with its query w[k, s] against the
    keys of the OTHER stream (reciprocal; dar_keys='self' uses its own) and the values of its own;
    a softmax fusion pi[k] mixes the two reads into the one input of the sublayer. The output y is
    written to both partials through per-channel gates beta[k, s] = 2 sigmoid(theta[k, s]) in
    (0, 2)^d, after the partials are mixed by the doubly stochastic [[rho, 1-rho], [1-rho, rho]]:
        p0 <- rho p0 + (1 - rho) p1 + beta0 * y,    p1 <- (1 - rho) p0 + rho p1 + beta1 * y
    (elementwise; a block's first write is p_s = beta_s * y). Per channel, not one scalar per
    stream: with scalars and blocks of 1, every source of stream 1 would be a positive multiple of
    stream 0's, which RMS-normalised keys cannot tell apart (reciprocal keys = own keys).
    Start (dar_start):
      distinct  the streams differ from the first write: antisymmetric gates theta[k, 1] = -theta[k, 0],
                drawn in (-1, 1) per channel, and an even fusion pi = (1/2, 1/2). Then beta0 + beta1 = 2,
                the mix keeps p0 + p1, so with uniform (zero-query) reads the fused input is the
                standard stream over the source count: `standard` at init, the streams apart.
      copy      both streams copies (zero gates), the symmetry broken only by the fusion's
                alternating init (stream 0 on even sublayers, stream 1 on odd): Block AttnRes at init.
    Interventions: ("uniform", read name) as AttnRes, for both streams' reads; ("own_keys",): each
    stream is addressed by its own keys; ("one_stream", s): every read takes stream s alone.
    """

    options = ("dar_keys", "dar_start")
    intervention_kinds = ("uniform", "own_keys", "one_stream")
    KEYS = ("reciprocal", "self")
    STARTS = ("distinct", "copy")

    @staticmethod
    def check(config):
        AttnRes.check(config)
        if config.dar_keys not in DualAttnRes.KEYS:
            raise ValueError(f"unknown dar_keys {config.dar_keys!r}; choose one of {', '.join(DualAttnRes.KEYS)}")
        if config.dar_start not in DualAttnRes.STARTS:
            raise ValueError(f"unknown dar_start {config.dar_start!r}; choose one of {', '.join(DualAttnRes.STARTS)}")

    @staticmethod
    def extra_params(config):
        n_sublayers, d = 2 * config.n_layer, config.n_embd
        # per read: 2 queries, a key gain, 2 fusion logits; per sublayer: 2 write gates of d, and one
        # rho where blocks hold more than one sublayer (blocks of 1 never mix partials)
        return (
            (n_sublayers + 1) * (3 * d + 2)
            + n_sublayers * 2 * d
            + (n_sublayers if config.attnres_block_size > 1 else 0)
        )

    def __init__(self, config):
        super().__init__(config)
        n_sublayers, d = self.n_sublayers, config.n_embd
        self.query = nn.Parameter(torch.zeros(n_sublayers + 1, 2, d))  # row output_read: the output read
        self.key_gain = nn.Parameter(torch.ones(n_sublayers + 1, d))  # one key gain for both streams
        fusion, write_gate = torch.zeros(n_sublayers + 1, 2), torch.zeros(n_sublayers, 2, d)
        if config.dar_start == "distinct":  # beta0 + beta1 = 2 sigmoid(t) + 2 sigmoid(-t) = 2 per channel
            theta = torch.rand(n_sublayers, d) * 2 - 1
            write_gate = torch.stack([theta, -theta], dim=1)
        else:  # copy: beta = 2 sigmoid(0) = 1 for both; the output read starts at (0, 0), an even mix
            fusion[:n_sublayers] = torch.tensor(
                [[3.0, -3.0] if is_attention(k) else [-3.0, 3.0] for k in range(n_sublayers)]
            )
        self.fusion = nn.Parameter(fusion)
        self.write_gate = nn.Parameter(write_gate)
        self.block_size, self.eps = config.attnres_block_size, config.norm_eps
        # rho = sigmoid(3): mostly keep own; none in blocks of 1, where DDP would find it unused
        self.mixing = nn.Parameter(torch.full((n_sublayers,), 3.0)) if self.block_size > 1 else None
        self.reciprocal = config.dar_keys == "reciprocal"

    def directions(self, k, s):
        return self.uniform(self.query[k, s : s + 1], self.name_of(k)) * self.key_gain[k]

    def keyed_by(self, s):
        """The stream whose keys address stream s."""
        return 1 - s if self.reciprocal and self.intervention != ("own_keys",) else s

    def open_block(self, blocks, k):
        """blocks: each stream's sealed blocks; phase 1 for both streams' reads of the block."""
        # weights only: one mix of both streams at read time keeps nothing new for backward, where
        # phase-1 reads would cost two (B, T, d) tensors per read (the fusion's gradient needs both)
        reads = reads_in_block(k, self.block_size, self.n_sublayers)
        return tuple(
            History(
                blocks[s],
                None,
                depth_weights_sealed(blocks[self.keyed_by(s)], {j: self.directions(j, s) for j in reads}, self.eps),
            )
            for s in (0, 1)
        )

    def start(self, x):
        return self.open_block(([x], [x]), 0)

    def interventions(self):
        own = [("own_keys",)] if self.reciprocal else []  # dar_keys='self' reads by its own keys already
        return (
            [("uniform", self.name_of(k)) for k in range(1, self.output_read + 1)]
            + own
            + [("one_stream", 0), ("one_stream", 1)]
        )

    def dead_rows(self):
        # sublayer 0 reads the embedding alone (the same one in both streams); rho is unused where a block starts
        dead = {"query": {0}, "key_gain": {0}, "fusion": {0}}
        if self.mixing is not None:
            dead["mixing"] = set(range(0, self.n_sublayers, self.block_size))
        return dead

    def read(self, state, k):
        weights = []
        for s in (0, 1):
            read, key = state[s].sealed_reads[k], state[self.keyed_by(s)].partial
            if key is not None:  # the partial sums join the weights (the mix below reads them)
                read = depth_weights_extend(read, key, self.directions(k, s), self.eps)
            weights.append(read.weights)
        pi = self.fusion[k].softmax(-1)
        if self.intervention in (("one_stream", 0), ("one_stream", 1)):
            pi = torch.eye(2, dtype=pi.dtype, device=pi.device)[self.intervention[1]]
        sources = [stream.sources() for stream in state]
        # both streams' reads and their fusion in one pass: x = sum_s pi_s sum_i alpha_si h_si
        (x,) = depth_mix(sources[0] + sources[1], torch.cat([pi[0] * weights[0], pi[1] * weights[1]], dim=-1))
        self.note_read(k, x, pi, weights, sources)
        return x

    def note_read(self, k, x, pi, weights, sources):
        """Diagnostics of read k: each stream's depth weights, the fusion, how alike the streams are."""
        name, own = self.name_of(k), [s[1:] for s in sources]  # the embedding is shared: compare the rest
        for s in (0, 1):
            self.note(f"{name}.s{s}", lambda: weights[s][..., 0, :])
        self.note(f"fusion/{name}", lambda: pi.expand(*x.shape[:-1], 2))
        if own[0]:
            self.note(
                f"stream_cosine/{name}",
                lambda: torch.stack([F.cosine_similarity(a, b, dim=-1) for a, b in zip(*own)]).mean(0),
            )
        if self.is_output(k):  # every block exists here: each stream's diversity, and the streams' per block
            for s in (0, 1):
                self.note(f"source_cosine/out.s{s}", lambda: cosine_matrix(sources[s]))
            self.note(
                "block_cosine/out",
                lambda: torch.stack([F.cosine_similarity(a.float(), b.float(), dim=-1) for a, b in zip(*own)], -1),
            )

    def write(self, state, k, out):
        p0, p1 = state[0].partial, state[1].partial
        beta = 2 * torch.sigmoid(self.write_gate[k])
        if p0 is None:  # a block starts: nothing to mix yet
            p0, p1 = beta[0] * out, beta[1] * out
        else:
            rho = torch.sigmoid(self.mixing[k])
            p0, p1 = rho * p0 + (1 - rho) * p1 + beta[0] * out, (1 - rho) * p0 + rho * p1 + beta[1] * out
            self.note(f"mixing/{self.name_of(k)}", lambda: rho.expand(out.shape[:-1]))
        self.note(f"write_gate/{self.name_of(k)}", lambda: beta.mean(-1).expand(*out.shape[:-1], 2))  # per stream
        if (k + 1) % self.block_size == 0:  # both blocks are sealed
            return self.open_block((state[0].blocks + [p0], state[1].blocks + [p1]), k + 1)
        return state[0]._replace(partial=p0), state[1]._replace(partial=p1)


class Streams(NamedTuple):
    """HC/mHC state: n streams H (B, T, n, d) and their normalised features, computed once per
    state for the read and the write of the next sublayer (None after the last write)."""

    H: torch.Tensor
    features: torch.Tensor | None


class MultiStream(ResidualScheme):
    """n residual streams H (B, T, n, d), all starting as the embedding. Sublayer k reads
    x = sum_j pre_j H_j and writes H_i <- sum_j mix[i, j] H_j + post_i f(x); the output is the sum
    of the streams. Subclasses say how (pre, mix, post) follow from the features of H.
    Intervention ("identity_mixing",): every stream is kept as it is (mix = I)."""

    options = ("hc_streams",)
    intervention_kinds = ("identity_mixing",)

    @staticmethod
    def check(config):
        if config.hc_streams < 2:
            raise ValueError(f"hc_streams={config.hc_streams} must be at least 2")

    def __init__(self, config):
        super().__init__(config)
        self.n_streams, self.eps = config.hc_streams, config.norm_eps

    def features(self, H):
        """What the stream weights are computed from (fp32)."""
        raise NotImplementedError

    def read_weights(self, state, k):
        """pre (B, T, n): sublayer k reads sum_j pre_j H_j."""
        raise NotImplementedError

    def write_weights(self, state, k):
        """(mix (B, T, n, n), post (B, T, n)): H_i <- sum_j mix[i, j] H_j + post_i f(x)."""
        raise NotImplementedError

    def start(self, x):
        H = x.unsqueeze(-2).expand(*x.shape[:-1], self.n_streams, x.size(-1))
        with torch.autocast(x.device.type, enabled=False):  # stream weights in fp32
            return Streams(H, self.features(H))

    def interventions(self):
        return [("identity_mixing",)]

    def read(self, state, k):
        if self.is_output(k):
            self.note("stream_cosine/out", lambda: cosine_matrix(state.H.unbind(-2)))  # used as different streams?
            return state.H.sum(-2)
        with torch.autocast(state.H.device.type, enabled=False):
            return (self.read_weights(state, k).unsqueeze(-1) * state.H).sum(-2)

    def write(self, state, k, out):
        with torch.autocast(out.device.type, enabled=False):
            mix, post = self.write_weights(state, k)
            if self.intervention == ("identity_mixing",):
                mix = torch.eye(self.n_streams, device=mix.device).expand_as(mix)
            self.note(f"stream_mixing/{self.name_of(k)}", lambda: mix)
            H = torch.einsum("btij,btjd->btid", mix, state.H) + post.unsqueeze(-1) * out.unsqueeze(-2)
            return Streams(H, self.features(H) if k + 1 < self.n_sublayers else None)


class HyperConnections(MultiStream):
    """
    HC (arXiv 2409.19606): static weights plus dynamic terms s * tanh(RMSNorm(H_j) W) for the read
    vector, the write vector and the mixing matrix. Init: read e_{k mod n}, mixing I, write 1,
    W = 0, s = 0.01 (both at 0 would keep their gradients at 0 forever): every stream is then
    the pre-norm residual stream.
    """

    @staticmethod
    def extra_params(config):
        n, d = config.hc_streams, config.n_embd  # per sublayer: static a, A, b; dynamic r, W, q; 3 scales
        return 2 * config.n_layer * (2 * n + n * n + (2 + n) * d + 3)

    def __init__(self, config):
        super().__init__(config)
        n, d, n_sublayers = self.n_streams, config.n_embd, self.n_sublayers
        self.read_static = nn.Parameter(F.one_hot(torch.arange(n_sublayers) % n, n).float())
        self.mix_static = nn.Parameter(torch.eye(n).repeat(n_sublayers, 1, 1))
        self.write_static = nn.Parameter(torch.ones(n_sublayers, n))
        self.read_dynamic = nn.Parameter(torch.zeros(n_sublayers, d))
        self.mix_dynamic = nn.Parameter(torch.zeros(n_sublayers, d, n))
        self.write_dynamic = nn.Parameter(torch.zeros(n_sublayers, d))
        self.dynamic_scale = nn.Parameter(torch.full((n_sublayers, 3), 0.01))  # read, mix, write

    def features(self, H):
        return F.rms_norm(H, (H.size(-1),), eps=self.eps)  # each stream on its own

    def read_weights(self, state, k):
        return self.read_static[k] + self.dynamic_scale[k, 0] * torch.tanh(state.features @ self.read_dynamic[k])

    def write_weights(self, state, k):
        # HC's A_r: row j holds stream j's contributions, H_i <- sum_j A_r[j, i] H_j
        mix = self.mix_static[k] + self.dynamic_scale[k, 1] * torch.tanh(state.features @ self.mix_dynamic[k])
        post = self.write_static[k] + self.dynamic_scale[k, 2] * torch.tanh(state.features @ self.write_dynamic[k])
        return mix.transpose(-1, -2), post


def sinkhorn(logits, iterations=20):
    """Sinkhorn-Knopp on exp(logits) in fp32: alternately normalise columns and rows; rows end exact."""
    m = logits.float().exp()
    for _ in range(iterations):
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


class ManifoldHyperConnections(MultiStream):
    """
    mHC (arXiv 2512.24880): from x' = RMSNorm(all streams flattened), pre = sigmoid(a x' phi_pre
    + b_pre), post = 2 sigmoid(a x' phi_post + b_post), mix = Sinkhorn(exp(a x' phi_res + b_res)),
    a doubly stochastic matrix. Init: phi = 0, a = 0.01, post = 1, mix near I (b_res 0 on the
    diagonal, -4 off it), pre favouring stream k mod n (+2 / -2; a stream-symmetric init would
    give every stream identical gradients forever).
    """

    @staticmethod
    def extra_params(config):
        n, d = config.hc_streams, config.n_embd  # per sublayer: phi_pre, phi_post, phi_res; 3 scales; biases
        return 2 * config.n_layer * (n * n * d * (2 + n) + 3 + 2 * n + n * n)

    def __init__(self, config):
        super().__init__(config)
        n, d, n_sublayers = self.n_streams, config.n_embd, self.n_sublayers
        self.phi_pre = nn.Parameter(torch.zeros(n_sublayers, n * d, n))
        self.phi_post = nn.Parameter(torch.zeros(n_sublayers, n * d, n))
        self.phi_res = nn.Parameter(torch.zeros(n_sublayers, n * d, n * n))
        self.scale = nn.Parameter(torch.full((n_sublayers, 3), 0.01))  # a for pre, post, res
        self.bias_pre = nn.Parameter(torch.where(F.one_hot(torch.arange(n_sublayers) % n, n).bool(), 2.0, -2.0))
        self.bias_post = nn.Parameter(torch.zeros(n_sublayers, n))
        self.bias_res = nn.Parameter(torch.where(torch.eye(n).bool(), 0.0, -4.0).repeat(n_sublayers, 1, 1))

    def dead_rows(self):
        # a doubly stochastic mix of identical streams (sublayer 0), or of streams that are then summed (the last)
        return {"phi_res": {0, self.n_sublayers - 1}, "bias_res": {0, self.n_sublayers - 1}}

    def features(self, H):
        return F.rms_norm(H.flatten(-2), (H.size(-2) * H.size(-1),), eps=self.eps)  # all streams as one vector

    def read_weights(self, state, k):
        return torch.sigmoid(self.scale[k, 0] * (state.features @ self.phi_pre[k]) + self.bias_pre[k])

    def write_weights(self, state, k):
        post = 2 * torch.sigmoid(self.scale[k, 1] * (state.features @ self.phi_post[k]) + self.bias_post[k])
        logits = self.scale[k, 2] * (state.features @ self.phi_res[k]).unflatten(-1, (self.n_streams, self.n_streams))
        return sinkhorn(logits + self.bias_res[k]), post


class ManifoldHyperConnectionsPaper(ManifoldHyperConnections):
    """
    mHC at its paper's start (as the hyper-connection-factory peer reads it): the projections phi drawn N(0, 0.02^2),
    every bias 0 (uniform doubly stochastic mixing, pre = 1/2 and post = 1 around it), a = 0.01; Sinkhorn-Knopp
    row-softmax first, then column and row normalisations (20 in all, eps 1e-6, ending on columns); pre + 1e-6; and a
    read-out head: the output is sum_i w_i H_i, w = sigmoid(a x' phi_head + b_head) + 1e-6. NOT `standard` at init, but
    close: the streams stay copies of the pre-norm stream (read at 1/2 each, mixed uniformly, written at 1; the norms
    remove the scale) but for the random projections' terms, a = 0.01 times phi's.
    """

    standard_at_init = False

    @staticmethod
    def extra_params(config):
        n, d = config.hc_streams, config.n_embd  # the sublayers' as mHC's, and the head's phi, scale and bias
        return ManifoldHyperConnections.extra_params(config) + n * d * n + 1 + n

    def __init__(self, config):
        super().__init__(config)
        n, d = self.n_streams, config.n_embd
        with torch.no_grad():
            for phi in (self.phi_pre, self.phi_post, self.phi_res):
                nn.init.normal_(phi, std=0.02)
            for bias in (self.bias_pre, self.bias_post, self.bias_res):
                bias.zero_()
        self.head_phi = nn.Parameter(torch.randn(n * d, n) * 0.02)
        self.head_scale = nn.Parameter(torch.full((1,), 0.01))
        self.head_bias = nn.Parameter(torch.zeros(n))

    def dead_rows(self):
        return {"phi_res": {0}, "bias_res": {0}}  # a mix of identical streams; the head reads the last one's

    @staticmethod
    def sinkhorn_rows_first(logits, iterations=20, eps=1e-6):
        m = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1) + eps
        m = m / (m.sum(-2, keepdim=True) + eps)
        for _ in range(iterations - 1):
            m = m / (m.sum(-1, keepdim=True) + eps)
            m = m / (m.sum(-2, keepdim=True) + eps)
        return m

    def read_weights(self, state, k):
        return super().read_weights(state, k) + 1e-6

    def write_weights(self, state, k):
        post = 2 * torch.sigmoid(self.scale[k, 1] * (state.features @ self.phi_post[k]) + self.bias_post[k])
        logits = self.scale[k, 2] * (state.features @ self.phi_res[k]).unflatten(-1, (self.n_streams, self.n_streams))
        # the paper's res[j, i] takes stream j into stream i; MultiStream's mix[i, j] does
        return self.sinkhorn_rows_first(logits + self.bias_res[k]).transpose(-1, -2), post

    def read(self, state, k):
        if not self.is_output(k):
            return super().read(state, k)
        with torch.autocast(state.H.device.type, enabled=False):
            w = torch.sigmoid(self.head_scale * (self.features(state.H) @ self.head_phi) + self.head_bias) + 1e-6
            self.note("stream_readout/out", lambda: w)
            return (w.unsqueeze(-1) * state.H).sum(-2)


class Dense(NamedTuple):
    """DenseFormer state: the stream x and every layer output so far (the embedding first)."""

    x: torch.Tensor
    outputs: list


class DenseFormer(ResidualScheme):
    """
    DenseFormer (Pagliardini et al., arXiv 2402.02622): the standard stream, except that after
    layer l (its MLP write) the stream becomes a depth-weighted average (DWA) of the embedding
    y_0 and the layer outputs y_1 .. y_{l+1} so far, y_{l+1} = x + attn + mlp being layer l's:
        x <- sum_{j <= l+1} alpha[l][j] y_j.
    Static weights (the same at every token), l + 2 for layer l. Init alpha[l] = (0, .., 0, 1), the
    paper's: the model is `standard`. Intervention ("identity_dwa",) or ("identity_dwa", l): every
    average (or layer l's) becomes the standard residual's alpha = (0, .., 0, 1).
    """

    intervention_kinds = ("identity_dwa",)

    @staticmethod
    def extra_params(config):
        return config.n_layer * (config.n_layer + 3) // 2  # sum over layers l of l + 2

    def __init__(self, config):
        super().__init__(config)
        self.dwa = nn.ParameterList(
            [nn.Parameter(F.one_hot(torch.tensor(l + 1), l + 2).float()) for l in range(config.n_layer)]
        )

    def start(self, x):
        return Dense(x, [x])

    def interventions(self):
        return [("identity_dwa", l) for l in range(len(self.dwa))] + [("identity_dwa",)]

    def read(self, state, k):
        return state.x

    def write(self, state, k, out):
        x = state.x + out
        if is_attention(k):  # after attention the layer is not done yet
            return Dense(x, state.outputs)
        layer = layer_of(k)
        outputs, alpha = state.outputs + [x], self.dwa[layer]
        self.note(f"dwa/{self.name_of(k)}", lambda: alpha.expand(*x.shape[:-1], len(outputs)))
        if k + 1 == self.output_read:  # every layer output exists here: how alike they are
            self.note("source_cosine/out", lambda: cosine_matrix(outputs))
        if self.intervention in (("identity_dwa",), ("identity_dwa", layer)):
            return Dense(x, outputs)  # the standard residual: alpha = (0, .., 0, 1) exactly
        return Dense(sum(alpha[j] * y for j, y in enumerate(outputs)), outputs)


# --- the field's schemes (issue #50): Post-LN, LAuReL, Frac-Connections, MUDDFormer ---


class PostNorm(ResidualScheme):
    """
    Post-LN (the original Transformer's placement): x <- RMSNorm_k(x + f_k(x)), a norm of its own per
    sublayer (weight 1 at init) on the sum; the stream is the normalised sum, which each block's pre-norm
    then reads almost unchanged (a per-channel gain). NOT `standard` at init: the skip itself is
    normalised at every sublayer, so no init makes it the pre-norm model; it says so (standard_at_init),
    and the zero-init tests read that.
    """

    standard_at_init = False

    @staticmethod
    def extra_params(config):
        return 2 * config.n_layer * config.n_embd  # a norm weight per sublayer

    def __init__(self, config):
        super().__init__(config)
        self.norm_weight = nn.Parameter(torch.ones(self.n_sublayers, config.n_embd))
        self.eps = config.norm_eps

    def start(self, x):
        return x

    def read(self, x, k):
        return x

    def write(self, x, k, out):
        with torch.autocast(out.device.type, enabled=False):  # the stream's norm in its own dtype (fp32)
            return F.rms_norm(x + out, (x.size(-1),), self.norm_weight[k], self.eps)


class LaurelRW(ResidualScheme):
    """
    LAuReL-RW (Menghani et al., arXiv 2411.07501), learned residual weights: x <- alpha_k f_k(x) + beta_k x,
    two scalars per sublayer. The paper also tries normalising (alpha, beta) with a softmax; that cannot
    start at `standard` (it halves both), so here they are plain scalars at alpha = beta = 1: exactly
    `standard` at init.
    """

    @staticmethod
    def extra_params(config):
        return 2 * 2 * config.n_layer  # alpha and beta per sublayer

    def __init__(self, config):
        super().__init__(config)
        self.output_weight = nn.Parameter(torch.ones(self.n_sublayers))  # alpha_k
        self.skip_weight = nn.Parameter(torch.ones(self.n_sublayers))  # beta_k

    def start(self, x):
        return x

    def read(self, x, k):
        return x

    def write(self, x, k, out):
        alpha, beta = self.output_weight[k], self.skip_weight[k]
        self.note(f"laurel_weights/{self.name_of(k)}", lambda: torch.stack([alpha, beta]).expand(*out.shape[:-1], 2))
        return alpha * out + beta * x


class LaurelLR(ResidualScheme):
    """
    LAuReL-LR (arXiv 2411.07501), a low-rank learned skip: x <- f_k(x) + x + B_k A_k x, A_k (r x d) and
    B_k (d x r) per sublayer, rank r = RANK. A_k is drawn N(0, 1/d), B_k starts at zero (the LoRA recipe;
    the paper's init is inferred): exactly `standard` at init, and B learns from the first step.
    """

    RANK = 16

    @staticmethod
    def extra_params(config):
        return 2 * config.n_layer * 2 * LaurelLR.RANK * config.n_embd  # A and B per sublayer

    def __init__(self, config):
        super().__init__(config)
        d = config.n_embd
        self.down = nn.Parameter(torch.randn(self.n_sublayers, self.RANK, d) / math.sqrt(d))  # A_k
        self.up = nn.Parameter(torch.zeros(self.n_sublayers, d, self.RANK))  # B_k

    def start(self, x):
        return x

    def read(self, x, k):
        return x

    def low_rank(self, x, k):
        """B_k A_k x, in the stream's dtype (fp32 under autocast: the stream is not rounded to bf16)."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(F.linear(x, self.down[k]), self.up[k])

    def write(self, x, k, out):
        return out + x + self.low_rank(x, k)


class Laurel(LaurelLR):
    """
    LAuReL-RW+LR (arXiv 2411.07501), the paper's combination: x <- alpha_k f_k(x) + beta_k (x + B_k A_k x),
    LaurelLR's low-rank skip weighted as LaurelRW's (alpha = beta = 1, B = 0: exactly `standard` at init).
    """

    @staticmethod
    def extra_params(config):
        return LaurelLR.extra_params(config) + LaurelRW.extra_params(config)

    def __init__(self, config):
        super().__init__(config)
        self.output_weight = nn.Parameter(torch.ones(self.n_sublayers))  # alpha_k
        self.skip_weight = nn.Parameter(torch.ones(self.n_sublayers))  # beta_k

    def write(self, x, k, out):
        return self.output_weight[k] * out + self.skip_weight[k] * (x + self.low_rank(x, k))


class LaurelRWPaper(ResidualScheme):
    """
    LAuReL-RW with the bounded weights the paper asks for, bounded as the hyper-connection-factory peer bounds them:
    (alpha_k, beta_k) = 2 softmax(w_k), w_k = 0 at init, so alpha + beta = 2 always and alpha = beta = 1 at init
    (exactly `standard`: 2 x 0.5 is exact). The paper names no normalisation that starts at 1; this one is the peer's.
    """

    @staticmethod
    def extra_params(config):
        return 2 * 2 * config.n_layer  # w_k, two logits per sublayer

    def __init__(self, config):
        super().__init__(config)
        self.weight_logits = nn.Parameter(torch.zeros(self.n_sublayers, 2))

    def start(self, x):
        return x

    def read(self, x, k):
        return x

    def write(self, x, k, out):
        alpha, beta = 2 * self.weight_logits[k].softmax(0)
        self.note(f"laurel_weights/{self.name_of(k)}", lambda: torch.stack([alpha, beta]).expand(*out.shape[:-1], 2))
        return alpha * out + beta * x


class LaurelLRPaper(LaurelLR):
    """
    LAuReL-LR at the paper's init, as the peer writes it: A_k "column orthogonal", A_k[j, i] = 1/sqrt(r d) where
    i mod r = j (output j sums its own d/r channels), B_k = 0: exactly `standard`, and A_k x starts r = 16 times
    smaller than under LaurelLR's A ~ N(0, 1/d) (|A x| / |x| = 1/sqrt(r d) against sqrt(r / d)).
    """

    def __init__(self, config):
        super().__init__(config)
        d = config.n_embd
        columns = (torch.arange(d) % self.RANK == torch.arange(self.RANK)[:, None]).float() / math.sqrt(self.RANK * d)
        self.down = nn.Parameter(columns.repeat(self.n_sublayers, 1, 1))


class LaurelPaper(LaurelLRPaper):
    """LAuReL-RW+LR at the paper's recipe: x <- alpha_k f_k(x) + beta_k (x + B_k A_k x), (alpha, beta) bounded as in
    LaurelRWPaper, A as in LaurelLRPaper, B = 0: exactly `standard` at init."""

    @staticmethod
    def extra_params(config):
        return LaurelLR.extra_params(config) + LaurelRWPaper.extra_params(config)

    def __init__(self, config):
        super().__init__(config)
        self.weight_logits = nn.Parameter(torch.zeros(self.n_sublayers, 2))

    def write(self, x, k, out):
        alpha, beta = 2 * self.weight_logits[k].softmax(0)
        return alpha * out + beta * (x + self.low_rank(x, k))


class FracConnections(ResidualScheme):
    """
    Frac-Connections (Zhu et al., arXiv 2503.14125), hyper-connections at expansion rate 1/m: the stream is
    not copied n times but split into m = FRACTIONS fractions H_1 .. H_m of d/m channels. Sublayer k reads
    x = concat_i (sum_j R[j, i] H_j) and writes H_i <- sum_j M[j, i] H_j + b_i f_k(x)_i, f's output split
    the same way; the output read is concat_i H_i. As in HC (the dynamic form, DFC), each of R (m x m),
    M (m x m) and b (m) is a static part plus s * tanh(RMSNorm(H_j) W) from fraction j's normalised
    features (W of d/m rows; s = 0.01, W = 0 at init). Init: R = M = I, b = 1, the paper's: exactly
    `standard`. The per-fraction norm of the features is inferred from HC's per-stream one.
    """

    FRACTIONS = 2

    @staticmethod
    def check(config):
        if config.n_embd % FracConnections.FRACTIONS:
            raise ValueError(f"n_embd={config.n_embd} must split into {FracConnections.FRACTIONS} fractions")

    @staticmethod
    def extra_params(config):
        m, width = FracConnections.FRACTIONS, config.n_embd // FracConnections.FRACTIONS
        # per sublayer: static R, M, b; dynamic W for R, M (m columns each) and b; 3 scales
        return 2 * config.n_layer * (2 * m * m + m + width * (2 * m + 1) + 3)

    def __init__(self, config):
        super().__init__(config)
        m, width, n_sublayers = self.FRACTIONS, config.n_embd // self.FRACTIONS, self.n_sublayers
        self.read_static = nn.Parameter(torch.eye(m).repeat(n_sublayers, 1, 1))
        self.mix_static = nn.Parameter(torch.eye(m).repeat(n_sublayers, 1, 1))
        self.write_static = nn.Parameter(torch.ones(n_sublayers, m))
        self.read_dynamic = nn.Parameter(torch.zeros(n_sublayers, width, m))
        self.mix_dynamic = nn.Parameter(torch.zeros(n_sublayers, width, m))
        self.write_dynamic = nn.Parameter(torch.zeros(n_sublayers, width))
        self.dynamic_scale = nn.Parameter(torch.full((n_sublayers, 3), 0.01))  # read, mix, write
        self.eps = config.norm_eps

    def features(self, H):
        return F.rms_norm(H, (H.size(-1),), eps=self.eps)  # each fraction on its own

    def start(self, x):
        H = x.unflatten(-1, (self.FRACTIONS, -1))  # (B, T, m, d/m)
        with torch.autocast(x.device.type, enabled=False):  # the fraction weights in fp32
            return Streams(H, self.features(H))

    def read(self, state, k):
        if self.is_output(k):
            return state.H.flatten(-2)
        with torch.autocast(state.H.device.type, enabled=False):
            R = self.read_static[k] + self.dynamic_scale[k, 0] * torch.tanh(state.features @ self.read_dynamic[k])
            self.note(f"fraction_read/{self.name_of(k)}", lambda: R)
            return torch.einsum("btji,btjd->btid", R, state.H).flatten(-2)

    def write(self, state, k, out):
        with torch.autocast(out.device.type, enabled=False):
            M = self.mix_static[k] + self.dynamic_scale[k, 1] * torch.tanh(state.features @ self.mix_dynamic[k])
            b = self.write_static[k] + self.dynamic_scale[k, 2] * torch.tanh(state.features @ self.write_dynamic[k])
            self.note(f"fraction_mixing/{self.name_of(k)}", lambda: M)
            H = torch.einsum("btji,btjd->btid", M, state.H) + b.unsqueeze(-1) * out.unflatten(-1, (self.FRACTIONS, -1))
            return Streams(H, self.features(H) if k + 1 < self.n_sublayers else None)


class MUDDFormer(ResidualScheme):
    """
    MUDDFormer (Xiao et al., arXiv 2502.12170), multiway dynamic dense connections. Layer l's attention
    reads its queries, keys and values from three inputs and adds its output to a fourth, the residual
    input: X_A = X^R + attn(X^Q, X^K, X^V), then X_{l+1} = X_A + mlp(X_A). After each layer, the next
    layer's four inputs are depth aggregations over every layer output so far, the embedding X_0 first:
        X^c = sum_{j <= l+1} a^c_j X_j,   a = static_l + W2_l GELU(W1_l RMSNorm(X_{l+1})),   c in Q, K, V, R,
    a (B, T, 4, l+2) per token, from a small MLP of hidden width 4 (l+2); after the last layer only the
    R way, which the output reads. Init: W2 = 0 and static_l selects X_{l+1} in every way, the paper's
    identity start: exactly `standard` (the three attention inputs are equal, not one tensor, so Q, K
    and V take three matmuls). Inferred: the MLP's hidden width and its parameter-free norm.
    """

    WAYS = 4  # query, key, value, residual

    class State(NamedTuple):
        """The layer outputs so far (X_0 first), and the current layer's inputs (q, k, v: None after the
        last layer; r: the residual input, which the attention's output joins)."""

        outputs: list
        q: torch.Tensor | None
        k: torch.Tensor | None
        v: torch.Tensor | None
        r: torch.Tensor

    @staticmethod
    def ways(config, layer):
        """The aggregations after layer `layer`: all four, or the R way alone after the last."""
        return MUDDFormer.WAYS if layer + 1 < config.n_layer else 1

    @staticmethod
    def extra_params(config):
        total = 0
        for layer in range(config.n_layer):  # W1 (d x h), W2 (h x h), static (h), h = ways x sources
            h = MUDDFormer.ways(config, layer) * (layer + 2)
            total += h * (config.n_embd + h + 1)
        return total

    def __init__(self, config):
        super().__init__(config)
        d, L = config.n_embd, config.n_layer
        shapes = [(self.ways(config, l), l + 2) for l in range(L)]
        self.hidden_in = nn.ParameterList([nn.Parameter(torch.randn(d, c * n) / math.sqrt(d)) for c, n in shapes])
        self.hidden_out = nn.ParameterList([nn.Parameter(torch.zeros(c * n, c * n)) for c, n in shapes])
        self.static = nn.ParameterList([nn.Parameter(F.one_hot(torch.full((c,), n - 1), n).float()) for c, n in shapes])
        self.eps = config.norm_eps

    def start(self, x):
        return self.State([x], x, x, x, x)

    def read_attention(self, state, k):
        return state.q, state.k, state.v, None

    def read(self, state, k):
        return state.r

    def weights(self, x, layer):
        """a (B, T, ways, sources) in fp32 (fp64 for fp64 x) whatever the autocast."""
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            h = F.gelu(F.rms_norm(x.to(acc), (x.size(-1),), eps=self.eps) @ self.hidden_in[layer].to(acc))
            dynamic = (h @ self.hidden_out[layer].to(acc)).unflatten(-1, self.static[layer].shape)
            return self.static[layer].to(acc) + dynamic

    def write(self, state, k, out):
        if is_attention(k):
            return state._replace(r=state.r + out)
        layer = layer_of(k)
        outputs = state.outputs + [state.r + out]
        a = self.weights(outputs[-1], layer)
        self.note(f"dense_weights/{self.name_of(k)}", lambda: a)
        mixed = depth_mix(outputs, a)  # one sum of products per way, in the stream's dtype
        if len(mixed) == 1:  # after the last layer: the output read's
            return self.State(outputs, None, None, None, mixed[0])
        return self.State(outputs, *mixed)


class MUDDFormerPaper(MUDDFormer):
    """
    MUDDFormer at its release's recipe for deep, narrow models (PrePostDANorm: the official code's mudd_prenorm and
    mudd_postnorm, with its PyTorch release's generator width). Each source is normalised before it is aggregated,
    S_j = RMSNorm_j(X_j) with a gain of its own (the embedding's too); the query, key and value ways aggregate them,
    and the residual way adds a normalised aggregation to the layer's output:
        X^c = sum_j a^c_j S_j (c in Q, K, V),   X^R = X_{l+1} + RMSNorm^post_l(sum_j a^R_j S_j), gain 0.001 at init,
        a = static_l + W2_l GELU(W1_l RMSNorm^gen_l(X_{l+1})),  W1 of width h rounded up past a multiple of 64
    (h = 4 (l+2); the last layer's 4 x (l+2)), W2 = 0 at init. After the last layer only the R way, which the output
    reads. The release's three attention norms: V's is the block's ln_1 times a gain of its own (1 + value_gain_l, 0
    at init); Q and K share ln_1 (a gain on either would rescale W_q's or W_k's columns, which the block owns).
    Init of the static weights: the official code starts every way at 0 with both norms on; there the query and key
    inputs are 0 and stay 0 (every attention logit is 0, and its gradient with respect to q or k is k or q), so here
    Q, K and V start at the newest source, as the release does without the norms, and R at 0: `standard` at init up
    to the norms' eps (S_{l+1} is X_{l+1} normalised, which ln_1 normalises again; X^R = X_{l+1}).
    """

    @staticmethod
    def generator_width(config, layer):
        ways, sources = MUDDFormer.ways(config, layer), layer + 2
        width = ways * sources * (4 if ways == 1 else 1)
        return (width // 64 + 1) * 64

    @staticmethod
    def extra_params(config):
        d, L = config.n_embd, config.n_layer
        total = d + (L - 1) * d  # the embedding's source norm; V's gain in layers 1 .. L-1
        for layer in range(L):  # generator norm, W1 (d x width), W2 (width x ways*sources), static; 2 norms
            h, width = MUDDFormer.ways(config, layer) * (layer + 2), MUDDFormerPaper.generator_width(config, layer)
            total += d + d * width + width * h + h + 2 * d
        return total

    def __init__(self, config):
        super().__init__(config)
        d, L = config.n_embd, config.n_layer
        widths = [self.generator_width(config, layer) for layer in range(L)]
        self.hidden_in = nn.ParameterList([nn.Parameter(torch.randn(d, w) / math.sqrt(d)) for w in widths])
        self.hidden_out = nn.ParameterList(
            [nn.Parameter(torch.zeros(w, s.numel())) for w, s in zip(widths, self.static)]
        )
        with torch.no_grad():
            for static in self.static:
                static[-1].zero_()  # R (the last layer's only way) at 0; Q, K, V at the newest source
        self.generator_norm = nn.Parameter(torch.ones(L, d))
        self.source_norm = nn.Parameter(torch.ones(L + 1, d))  # row 0: the embedding's; row l + 1: X_{l+1}'s
        self.post_norm = nn.Parameter(torch.full((L, d), 1e-3))
        self.value_gain = nn.Parameter(torch.zeros(L - 1, d))  # row l - 1: layer l's

    def norm(self, x, weight):
        with torch.autocast(x.device.type, enabled=False):  # the stream's dtype (fp32 under autocast)
            return F.rms_norm(x, (x.size(-1),), weight.to(x.dtype), self.eps)

    def start(self, x):
        return self.State([self.norm(x, self.source_norm[0])], x, x, x, x)

    def read_attention(self, state, k):
        layer = layer_of(k)
        return state.q, state.k, state.v, self.value_gain[layer - 1] if layer else None

    def weights(self, x, layer):
        """a (B, T, ways, sources) in fp32 (fp64 for fp64 x): MUDDFormer's, its generator's norm with a gain."""
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            normed = F.rms_norm(x.to(acc), (x.size(-1),), self.generator_norm[layer].to(acc), self.eps)
            dynamic = F.gelu(normed @ self.hidden_in[layer].to(acc)) @ self.hidden_out[layer].to(acc)
            return self.static[layer].to(acc) + dynamic.unflatten(-1, self.static[layer].shape)

    def write(self, state, k, out):
        if is_attention(k):
            return state._replace(r=state.r + out)
        layer = layer_of(k)
        x = state.r + out
        sources = state.outputs + [self.norm(x, self.source_norm[layer + 1])]
        a = self.weights(x, layer)
        self.note(f"dense_weights/{self.name_of(k)}", lambda: a)
        *qkv, r = depth_mix(sources, a)
        r = x + self.norm(r, self.post_norm[layer])
        return self.State(sources, *(qkv or (None, None, None)), r)


# -----------------------------------------------------------------------------
# The registry and the optimizer: RESIDUALS names every scheme (the config check, train.py,
# bench.py and the tests read it); MuonAdamW steps Muon and AdamW as one optimizer.

# the one list of schemes: the config check, train.py, bench.py and the tests read it
RESIDUALS = dict(
    standard=StandardResidual,
    attnres=AttnRes,
    rd_attnres=RDAttnRes,
    dar=DualAttnRes,
    hc=HyperConnections,
    mhc=ManifoldHyperConnections,
    denseformer=DenseFormer,
    postnorm=PostNorm,
    laurel_rw=LaurelRW,
    laurel_lr=LaurelLR,
    laurel=Laurel,
    frac=FracConnections,
    muddformer=MUDDFormer,
    delta_attnres=DeltaAttnRes,
    mhar=MultiHeadAttnRes,
    muddformer_paper=MUDDFormerPaper,
    laurel_rw_paper=LaurelRWPaper,
    laurel_lr_paper=LaurelLRPaper,
    laurel_paper=LaurelPaper,
    mhc_paper=ManifoldHyperConnectionsPaper,
    delta_attnres_paper=DeltaAttnResPaper,
    scaled_residual=ScaledResidual,
)


def option_owners(key):
    """The schemes whose own option key is (empty: a setting of every scheme)."""
    return [name for name, scheme in RESIDUALS.items() if key in scheme.options]


class MuonAdamW:
    """Muon for the hidden matrices and AdamW for the rest, stepped as one optimizer: param_groups
    holds both's groups (train.py's schedule sets each one's lr), .optimizers the two (checkpoints)."""

    def __init__(self, adamw, muon):
        self.optimizers = (adamw, muon)

    @property
    def param_groups(self):
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


# -----------------------------------------------------------------------------
# GPTConfig and GPT: the settings (each checked, a scheme's own options only under it) and the
# model, whose hidden() is the one loop over the 2L sublayers that every scheme plugs into.

MOE_OPTIONS = ("moe_top_k", "moe_shared_experts", "moe_expert_hidden", "moe_bias_rate", "moe_router_lr_scale")
MOE_COUNTS_FROM_ZERO = ("moe_shared_experts", "moe_expert_hidden")  # 0: none, and the automatic width


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    norm_eps: float = 1e-6
    residual: str = "standard"  # a key of RESIDUALS
    attnres_block_size: int = 4  # attnres, rd_attnres, dar: sublayers per block; 1 = Full AttnRes
    rd_control: str = "none"  # rd_attnres only
    dar_keys: str = "reciprocal"  # dar only: address a stream by the other's keys, or its own ('self')
    dar_start: str = "distinct"  # dar only: the streams apart from the first write, or copies ('copy')
    hc_streams: int = 4  # hc and mhc only
    routing_lr_scale: float = 1.0  # the routing parameters' learning rate, as a multiple of the shared weights'
    # sparse mixture-of-experts MLP (class MoE), in every layer of every scheme; 1 = the dense MLP
    n_experts: int = 1
    moe_top_k: int = 2  # routed experts per token (at least 2: a lone gate is normalised to exactly 1)
    moe_shared_experts: int = 0  # experts every token reaches, beside its top k
    moe_expert_hidden: int = 0  # an expert's hidden width; 0 = the dense MLP's active FLOPs (expert_hidden)
    moe_bias_rate: float = 1e-3  # the balancing bias's step per optimizer step (DeepSeek-V3's gamma); 0 = off
    moe_router_lr_scale: float = 1.0  # the routers' learning rate, as a multiple of the shared weights'

    def __post_init__(self):
        for field in fields(self):  # a size of 0 would fail later, as a ZeroDivisionError or an empty model
            value, least = getattr(self, field.name), 0 if field.name in MOE_COUNTS_FROM_ZERO else 1
            if field.type is int and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(
                    f"{field.name}={value!r} must be {'a non-negative' if least == 0 else 'a positive'} integer"
                )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be > 0")
        if not (math.isfinite(self.routing_lr_scale) and self.routing_lr_scale > 0):
            raise ValueError(f"routing_lr_scale={self.routing_lr_scale!r} must be a finite number > 0")
        if self.residual not in RESIDUALS:
            raise ValueError(f"unknown residual {self.residual!r}; choose one of {', '.join(RESIDUALS)}")
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(
                f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even "
                f"size (rotary embeddings rotate channel pairs)"
            )
        for field in fields(self):  # a scheme's own option set under another scheme is a mistake
            owners = option_owners(field.name)
            value = getattr(self, field.name)
            if owners and self.residual not in owners and value != field.default:
                raise ValueError(
                    f"{field.name}={value!r} needs residual={' or '.join(map(repr, owners))} "
                    f"(got {self.residual!r}); use {field.name}={field.default!r} for other residuals"
                )
        RESIDUALS[self.residual].check(self)
        self.check_moe()

    def check_moe(self):
        defaults = {field.name: field.default for field in fields(self)}
        if self.n_experts == 1:  # the dense MLP: an MoE setting here would be silently unused
            for name in MOE_OPTIONS:
                if getattr(self, name) != defaults[name]:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} needs n_experts > 1 (n_experts=1 is the dense MLP); "
                        f"set n_experts, or {name}={defaults[name]!r}"
                    )
            return
        if not 2 <= self.moe_top_k <= self.n_experts:
            raise ValueError(
                f"moe_top_k={self.moe_top_k} must be in [2, n_experts={self.n_experts}] (top-1 gates are "
                f"normalised to exactly 1, so the router would get no gradient)"
            )
        if not (math.isfinite(self.moe_bias_rate) and self.moe_bias_rate >= 0):
            raise ValueError(f"moe_bias_rate={self.moe_bias_rate!r} must be a finite number >= 0")
        if not (math.isfinite(self.moe_router_lr_scale) and self.moe_router_lr_scale > 0):
            raise ValueError(f"moe_router_lr_scale={self.moe_router_lr_scale!r} must be a finite number > 0")


def scheme_seed(name):
    """The seed of a scheme's init: from the seed the model is drawn with (torch.initial_seed(), the
    last torch.manual_seed) and the scheme's name; sha256, as Python's str hash changes per process."""
    return int.from_bytes(hashlib.sha256(f"{torch.initial_seed()}/{name}".encode()).digest()[:8], "little")


def is_routing(name):
    """Whether a GPT parameter or state_dict name is its scheme's (GPT.residual), not a shared weight."""
    return name.startswith("residual.")


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=RMSNorm(config.n_embd, config.norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embedding and unembedding
        for name, p in self.transformer.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled init of the projections into the residual
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif p.dim() == 2:
                torch.nn.init.normal_(p, mean=0.0, std=0.02)
            else:
                torch.nn.init.ones_(p)
        # the scheme comes after the shared weights and draws from an RNG of its own, so the shared
        # weights and the global RNG afterwards are bit-identical for one seed in every arm (paired arms)
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: the scheme is built on the CPU
            torch.default_generator.manual_seed(scheme_seed(config.residual))
            self.residual = RESIDUALS[config.residual](config)
        self.activation_checkpointing = False  # train.py's key: recompute each sublayer in backward (hidden)

    def num_params(self, non_embedding=True, active=False):
        """Parameter count; the tied embedding counts once, and not at all with non_embedding. active:
        the parameters one token uses (of each MoE layer's experts its k routed ones, with the shared ones and the
        router)."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            n -= sum(
                (len(moe.experts) - moe.top_k) * sum(p.numel() for p in moe.experts[0].parameters())
                for moe in self.moes().values()
            )
        return n - self.transformer.wte.weight.numel() if non_embedding else n

    def moes(self):
        """{'mlp.{layer}': its MoE} (empty for the dense MLP)."""
        return {
            f"mlp.{layer}": block.mlp for layer, block in enumerate(self.transformer.h) if isinstance(block.mlp, MoE)
        }

    @torch.no_grad()
    def update_expert_bias(self):
        """Call after each optimizer.step(), on every rank: each MoE layer's balancing bias moves by
        moe_bias_rate * sign(mean load - load) over the step's routed tokens (all micro-batches, summed
        over ranks when torch.distributed is initialized, so the ranks' biases stay equal); the counts
        restart at zero. Nothing for a dense model."""
        moes = list(self.moes().values())
        if not moes:
            return
        loads = torch.stack([moe.expert_load for moe in moes])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loads)
        for moe, load in zip(moes, loads.to(moes[0].expert_bias.dtype)):
            moe.expert_bias += moe.bias_rate * torch.sign(load.mean() - load)
            moe.expert_load.zero_()

    def hidden(self, idx):
        """Final normalised hidden states (B, T, d)."""
        x = self.transformer.drop(self.transformer.wte(idx))
        state = self.residual.start(x)
        # activation checkpointing: a sublayer keeps only its inputs for backward and is recomputed
        # there (its dropout masks too); the scheme's reads and writes stay outside, as without it
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if recompute else (lambda f, *a: f(*a))
        for k in range(self.residual.n_sublayers):
            block = self.transformer.h[layer_of(k)]
            if is_attention(k):
                out = run(block.attention, *self.residual.read_attention(state, k))
            else:
                out = run(block.feedforward, self.residual.read(state, k))
            # sublayer outputs join the stream in its own dtype (fp32 under autocast) in every
            # scheme, so all arms sum their residuals at the same precision
            state = self.residual.write(state, k, out.to(x.dtype))
        return self.transformer.ln_f(self.residual.read(state, self.residual.output_read))

    def forward(self, idx, targets=None, reduction="mean"):
        """
        Without targets: the last position's logits and None. With targets (B, T): all logits and
        the fp32 cross-entropy over the tokens whose target is not -1, as their mean
        (reduction="mean"), their sum ("sum"), or per token ("none": (B, T), 0 where ignored).
        """
        x = self.hidden(idx)
        if targets is None:  # inference: only the last position is needed
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=reduction
        )
        return logits, loss.view(targets.shape) if reduction == "none" else loss

    # --- the analysis API: what the routing does (routing_diagnostics) and what it is worth (intervene) ---

    @torch.no_grad()
    def routing_diagnostics(self, idx):
        """
        Where each read looks, from one forward pass over idx (no graph kept):
          weights   read name -> 1-D fp32 CPU tensor over its sources (embedding first, running
                    partial last), averaged over batch and positions. Names: attn.{l} (the QK
                    route for RD), attn_v.{l} (RD's second route), mlp.{l}, out.
          entropy   read name -> token-averaged entropy of its depth weights (nats)
          effective_sources  read name -> exp(entropy) per token, averaged over tokens: 1 when a read
                    takes one source, S when it weighs its S sources equally
          qk_v_jsd  layer -> token-wise Jensen-Shannon divergence between attn.{l} and attn_v.{l},
                    averaged over tokens (nats); only for schemes with a second route
        and every other group a scheme records ('group/read name', see ResidualScheme), as group ->
        read name -> its average over tokens: DAR's fusion (pi), write_gate (each stream's gate
        averaged over channels: 2 numbers), mixing (rho), stream_cosine, block_cosine (per block
        after the shared embedding, the two streams' cosine) and source_cosine (S x S at the output,
        per stream: out.s0, out.s1); AttnRes's and DenseFormer's source_cosine; HC/mHC's
        stream_mixing (M[i, j], H_i <- sum_j M[i, j] H_j) and stream_cosine; DenseFormer's dwa (per
        layer, named by its MLP sublayer); scaled_residual's scales (lambda_k, mu_k per sublayer); MHAR's
        heads (each head's weights, heads x sources; its `weights`, so its entropy, are the heads' mean)
        and head_entropy (each head's own, averaged over tokens). DAR's
        depth weights are per stream: attn.{l}.s0, ....
        MoE models (n_experts > 1) add, per layer mlp.{l}: expert_load (the fraction of tokens that reach
        each expert: k/E each when balanced, summing to k) and router_entropy (of the scores normalised
        over the experts, averaged over tokens, in nats: log E when uniform).
        """
        record = self.residual.record = {}  # the schemes fill it during this one pass
        moes = self.moes()
        for moe in moes.values():
            moe.record = {}
        try:
            self.hidden(idx)
        finally:
            self.residual.record = None
            moe_records = {name: moe.record for name, moe in moes.items()}
            for moe in moes.values():
                moe.record = None
        weights = {name: w for name, w in record.items() if "/" not in name}
        entropy = {name: -torch.special.xlogy(w, w).sum(-1) for name, w in weights.items()}
        result = dict(
            weights={name: w.mean(dim=(0, 1)).cpu() for name, w in weights.items()},
            entropy={name: h.mean().item() for name, h in entropy.items()},
            effective_sources={name: h.exp().mean().item() for name, h in entropy.items()},
            qk_v_jsd={},
        )
        for layer in range(self.config.n_layer):
            if f"attn_v.{layer}" in weights:
                result["qk_v_jsd"][layer] = (
                    js_divergence(weights[f"attn.{layer}"], weights[f"attn_v.{layer}"]).mean().item()
                )
        for key, value in record.items():
            if "/" in key:
                group, name = key.split("/")
                result.setdefault(group, {})[name] = value.float().mean(dim=(0, 1)).cpu()
        if moes:
            result["expert_load"] = {name: r["load"].cpu() for name, r in moe_records.items()}
            result["router_entropy"] = {name: r["entropy"].item() for name, r in moe_records.items()}
        return result

    def intervene(self, intervention=None):
        """
        Analysis only, off by default (then free): replace one piece of the learned routing until the
        next call; intervene() turns it off. An intervention is a tuple (kind, *where), one of
        interventions(); each scheme's docstring says what its kinds do (e.g. ("uniform", "mlp.3"):
        that read's depth weights become uniform).
        """
        kinds = self.residual.intervention_kinds
        if intervention is not None and intervention[0] not in kinds:
            raise ValueError(
                f"residual={self.config.residual!r} has no intervention {intervention[0]!r}; "
                f"it has: {', '.join(kinds) or 'none'}"
            )
        self.residual.intervention = intervention

    def interventions(self):
        """Every intervention intervene() accepts for this model, in a fixed order (none for standard)."""
        return self.residual.interventions()

    def configure_optimizers(
        self, weight_decay, learning_rate, betas, device_type, optimizer="adamw", muon_learning_rate=0.02
    ):
        """
        AdamW with three groups, in every arm (empty for standard's routing): the shared matrices and
        the tied embedding (decayed), the shared norms, the routing parameters (never decayed). Each
        group's "lr_scale" is its learning rate over the schedule's (routing: routing_lr_scale).
        optimizer="muon": the hidden matrices (attention and MLP weights) leave the first group for a
        torch.optim.Muon group (lr_scale = muon_learning_rate / learning_rate), decayed by the same
        fraction per step as AdamW decays (torch's Muon multiplies its weight decay by its own lr);
        the tied embedding, the norms and every routing parameter stay in AdamW. One object either way.
        MoE models add an AdamW group before the routing one: the routers (never decayed, lr_scale moe_router_lr_scale);
        under Muon each expert's two matrices are orthogonalised on their own, as any hidden matrix.
        """
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer={optimizer!r}: choose adamw or muon")
        routers = [moe.router.weight for moe in self.moes().values()]
        not_router = lambda p: all(p is not r for r in routers)
        shared = [p for p in self.transformer.parameters() if not_router(p)]  # lm_head's weight is the tied embedding
        hidden = (
            [p for p in self.transformer.h.parameters() if p.dim() == 2 and not_router(p)]
            if optimizer == "muon"
            else []
        )
        matrices = [p for p in shared if p.dim() >= 2 and all(p is not q for q in hidden)]
        groups = [
            {"params": matrices, "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": [p for p in shared if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0},
            {"params": list(self.residual.parameters()), "weight_decay": 0.0, "lr_scale": self.config.routing_lr_scale},
        ]
        if routers:  # never decayed (decay pulls every score to 1/2); before the routing group, which may be
            # empty: torch.distributed.checkpoint restores an empty group's settings only as the last group
            groups.insert(2, {"params": routers, "weight_decay": 0.0, "lr_scale": self.config.moe_router_lr_scale})
        for group in groups:
            group["lr"] = learning_rate * group["lr_scale"]
        fused = device_type == "cuda"  # fused AdamW kernels exist for CUDA tensors
        adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)
        if optimizer == "adamw":
            return adamw
        scale = muon_learning_rate / learning_rate
        muon = torch.optim.Muon(
            [{"params": hidden, "lr_scale": scale}], lr=muon_learning_rate, weight_decay=weight_decay / scale
        )
        return MuonAdamW(adamw, muon)

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (PaLM appendix B): 6N for the matmuls + 12 L d T for attention; N the
        active parameters (an MoE layer's k routed experts of E, its shared experts and its router)."""
        c = self.config
        return 6 * self.num_params(non_embedding=False, active=True) + 12 * c.n_layer * c.n_embd * seq_len

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
