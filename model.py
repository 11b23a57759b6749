"""
A GPT whose residual connections are pluggable: one decoder, every depth-routing scheme behind
`GPTConfig.residual`.

- standard:    x <- x + f_k(x), the pre-norm baseline.
- attnres:     Attention Residuals (Kimi Team, arXiv 2603.15031). Each sublayer reads a softmax
               mix of earlier block outputs; attnres_block_size=1 is Full AttnRes, >1 Block.
- rd_attnres:  Role-Decoupled AttnRes (arXiv 2608.01075; design inferred from the abstract): the
               attention sublayer reads its queries/keys and its values through separate routes.

The transformer branch (attention, MLP) never learns which scheme feeds it: attention takes one
input for Q/K and one for V, the MLP takes one input. A scheme is a small module with four
methods - start (from the embedding), read (for an MLP sublayer and for the output), read_attention
(Q/K and V inputs) and write (a sublayer's output) - and GPT.hidden is one loop over the 2L
sublayers.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


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
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).type_as(x)


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

    def forward(self, h_qk, h_v):
        """h_qk feeds queries and keys, h_v feeds values (both already normalised)."""
        B, T, C = h_qk.size()
        if h_v is h_qk:  # one fused projection when all three read the same input
            q, k, v = self.c_attn(h_qk).split(C, dim=2)
        else:
            q, k = F.linear(h_qk, self.c_attn.weight[: 2 * C]).split(C, dim=2)
            v = F.linear(h_v, self.c_attn.weight[2 * C:])
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        cos, sin = self.rotary_cos[:T], self.rotary_sin[:T]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # exact (erf) GELU


class Block(nn.Module):
    """One layer = two sublayers, each with its own pre-norm. The residual scheme does the adding."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def attention(self, x_qk, x_v, value_gain=None):
        h_qk = self.ln_1(x_qk)
        h_v = h_qk if x_v is x_qk else self.ln_1(x_v)
        if value_gain is not None:
            h_v = h_v * (1 + value_gain)
        return self.attn(h_qk, h_v)

    def feedforward(self, x):
        return self.mlp(self.ln_2(x))


# -----------------------------------------------------------------------------
# The depth read: the one primitive behind every AttnRes-family route

def depth_read(sources, queries, key_gain, eps):
    """
    Softmax attention over depth at every token: route r returns sum_i alpha_ri * s_i with
    alpha_r = softmax_i(<q_r, RMSNorm_gain(s_i)>). No 1/sqrt(d), no mixing across tokens.

    sources: list of S tensors (B, T, d) in the residual stream's dtype, oldest first.
    queries: (R, d), R routes that share the keys (RD's QK and V routes read in one pass).
    Returns a list of R outputs in the sources' dtype and the weights (B, T, R, S) in fp32 (or fp64).

    Stats, logits, softmax and the mix run in fp32 whatever the autocast. The sources are never
    stacked: autograd keeps references to them (alive anyway) and per-token scalars, not a copy.
    """
    R = queries.size(0)
    if len(sources) == 1:  # a read over one source is the identity
        ones = torch.ones(*sources[0].shape[:-1], R, 1, device=sources[0].device)
        return [sources[0]] * R, ones
    acc = torch.promote_types(sources[0].dtype, torch.float32)  # fp32, or fp64 for gradcheck
    with torch.autocast(sources[0].device.type, enabled=False):
        # <w, gain * s / rms(s)> = <w * gain, s> / rms(s): one matvec and one norm per source
        directions = (queries.to(acc) * key_gain.to(acc)).t()
        logits = torch.stack([(s.to(acc) @ directions)
                              * torch.rsqrt(s.to(acc).pow(2).mean(-1, keepdim=True) + eps)
                              for s in sources], dim=-1)
        weights = logits.softmax(dim=-1)
        outputs = []
        for r in range(R):
            mixed = weights[..., r, 0, None] * sources[0].to(acc)
            for i in range(1, len(sources)):
                mixed = mixed + weights[..., r, i, None] * sources[i].to(acc)
            outputs.append(mixed.to(sources[0].dtype))
    return outputs, weights


def js_divergence(p, q):
    """Jensen-Shannon divergence (nats) between distributions on the last axis."""
    m = 0.5 * (p + q)
    kl = lambda a: (torch.special.xlogy(a, a) - torch.special.xlogy(a, m)).sum(-1)
    return 0.5 * kl(p) + 0.5 * kl(q)


def read_name(k):
    """Diagnostic name of sublayer k's read: attention reads are even, MLP reads odd."""
    return f"attn.{k // 2}" if k % 2 == 0 else f"mlp.{k // 2}"


# -----------------------------------------------------------------------------
# Residual schemes. State flows functionally: write() returns the new state.

class StandardResidual(nn.Module):
    """x <- x + f_k(x). No parameters."""

    def __init__(self, config):
        super().__init__()

    def start(self, x):
        return x

    def read(self, x, k, record):
        return x

    def read_attention(self, x, k, record):
        return x, x, None

    def write(self, x, k, out):
        return x + out


class AttnRes(nn.Module):
    """
    Full (block_size=1) and Block AttnRes. Sources are the embedding, every sealed block (a sum
    of S sublayer outputs) and the running partial sum of the current block. Sublayer k reads
    them with its own (query[k], key_gain[k]); row 2L is the output read.
    """

    def __init__(self, config):
        super().__init__()
        n_reads = 2 * config.n_layer + 1
        # zero queries = uniform weights = the mean of the sources, which is the standard residual
        # stream divided by the source count; the next RMSNorm removes the scale: standard at init
        self.query = nn.Parameter(torch.zeros(n_reads, config.n_embd))
        self.key_gain = nn.Parameter(torch.ones(n_reads, config.n_embd))
        self.block_size = config.attnres_block_size
        self.eps = config.norm_eps

    def start(self, x):
        return [x], None  # (sealed blocks, running partial)

    def sources(self, state):
        done, partial = state
        return done if partial is None else done + [partial]

    def read(self, state, k, record):
        (out,), weights = depth_read(self.sources(state), self.query[k:k + 1], self.key_gain[k], self.eps)
        if record is not None:
            record["out" if k == self.query.size(0) - 1 else read_name(k)] = weights[..., 0, :]
        return out

    def read_attention(self, state, k, record):
        x = self.read(state, k, record)
        return x, x, None

    def write(self, state, k, out):
        done, partial = state
        partial = out if partial is None else partial + out
        if (k + 1) % self.block_size == 0:  # seal the block: it becomes a source of its own
            return done + [partial], None
        return done, partial


class RDAttnRes(AttnRes):
    """
    RD-AttnRes: Block AttnRes whose attention sublayer reads the same sources twice with the same
    key gain - query[k] routes Q/K (the parent's parameter), value_query[l] routes V. Controls:
      none     the method: a zero-init value query per layer (+d parameters per layer)
      dup      both routes use the parent's query: the parent's function at RD's cost
      param    one route, plus a zero-init per-channel gain u on the value input: V = W_V((1+u) n(a))
      fixed_v  the value route has uniform weights (a constant zero query, not a parameter)
    """

    def __init__(self, config):
        super().__init__(config)
        self.control = config.rd_control
        if self.control == "none":
            self.value_query = nn.Parameter(torch.zeros(config.n_layer, config.n_embd))
        elif self.control == "param":
            self.value_gain = nn.Parameter(torch.zeros(config.n_layer, config.n_embd))

    def read_attention(self, state, k, record):
        layer = k // 2
        if self.control == "param":
            x = self.read(state, k, record)
            return x, x, self.value_gain[layer]
        query = self.query[k]
        if self.control == "none":
            value_query = self.value_query[layer]
        elif self.control == "dup":
            value_query = query
        else:  # fixed_v
            value_query = torch.zeros_like(query)
        (x_qk, x_v), weights = depth_read(self.sources(state), torch.stack([query, value_query]),
                                          self.key_gain[k], self.eps)
        if record is not None:
            record[f"attn.{layer}"], record[f"attn_v.{layer}"] = weights[..., 0, :], weights[..., 1, :]
        return x_qk, x_v, None


# -----------------------------------------------------------------------------

RESIDUALS = ("standard", "attnres", "rd_attnres")
RD_CONTROLS = ("none", "dup", "param", "fixed_v")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    norm_eps: float = 1e-6
    residual: str = "standard"
    attnres_block_size: int = 4  # sublayers per block; 1 = Full AttnRes
    rd_control: str = "none"

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"unknown residual {self.residual!r}; choose one of {', '.join(RESIDUALS)}")
        if self.rd_control not in RD_CONTROLS:
            raise ValueError(f"unknown rd_control {self.rd_control!r}; choose one of {', '.join(RD_CONTROLS)}")
        if self.rd_control != "none" and self.residual != "rd_attnres":
            raise ValueError(f"rd_control={self.rd_control!r} needs residual='rd_attnres' "
                             f"(got {self.residual!r}); use rd_control='none' for other residuals")
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even "
                             f"size (rotary embeddings rotate channel pairs)")
        if self.residual != "standard":
            S, n_sub = self.attnres_block_size, 2 * self.n_layer
            if S < 1 or (S != 1 and S % 2 != 0) or n_sub % S != 0:
                valid = [s for s in range(1, n_sub + 1) if n_sub % s == 0 and (s == 1 or s % 2 == 0)]
                raise ValueError(f"attnres_block_size={S} must be 1 (Full) or an even divisor of "
                                 f"2*n_layer={n_sub}; valid: {', '.join(map(str, valid))}")


def residual_scheme(config):
    if config.residual == "standard":
        return StandardResidual(config)
    if config.residual == "attnres":
        return AttnRes(config)
    return RDAttnRes(config)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embedding and unembedding
        # the scheme's parameters are constants at init and draw nothing from the RNG, so the shared
        # weights below are bit-identical for one seed whatever the variant (paired arms)
        self.residual = residual_scheme(config)
        for name, p in self.transformer.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled init of the projections into the residual
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif p.dim() == 2:
                torch.nn.init.normal_(p, mean=0.0, std=0.02)
            else:
                torch.nn.init.ones_(p)

    def num_params(self, non_embedding=True):
        """Parameter count; the tied embedding counts once, and not at all with non_embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wte.weight.numel() if non_embedding else n

    def hidden(self, idx, record=None):
        """Final normalised hidden states (B, T, d); record, if a dict, collects depth weights."""
        x = self.transformer.drop(self.transformer.wte(idx))
        state = self.residual.start(x)
        for k in range(2 * self.config.n_layer):
            block = self.transformer.h[k // 2]
            if k % 2 == 0:
                out = block.attention(*self.residual.read_attention(state, k, record))
            else:
                out = block.feedforward(self.residual.read(state, k, record))
            # sublayer outputs join the stream in its own dtype (fp32 under autocast) in every
            # scheme, so all arms sum their residuals at the same precision
            state = self.residual.write(state, k, out.to(x.dtype))
        return self.transformer.ln_f(self.residual.read(state, 2 * self.config.n_layer, record))

    def forward(self, idx, targets=None):
        x = self.hidden(idx)
        if targets is None:  # inference: only the last position is needed
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def routing_diagnostics(self, idx):
        """
        Where each read looks, from one forward pass over idx (no graph kept):
          weights   read name -> 1-D fp32 CPU tensor over its sources (embedding first, running
                    partial last), averaged over batch and positions. Names: attn.{l} (the QK
                    route for RD), attn_v.{l} (RD's value route), mlp.{l}, out.
          entropy   read name -> token-averaged entropy of its depth weights (nats)
          qk_v_jsd  layer -> token-wise Jensen-Shannon divergence between attn.{l} and attn_v.{l},
                    averaged over tokens (nats); only for schemes with a value route
        """
        record = {}
        self.hidden(idx, record)
        weights = {name: w.mean(dim=(0, 1)).cpu() for name, w in record.items()}
        entropy = {name: -torch.special.xlogy(w, w).sum(-1).mean().item() for name, w in record.items()}
        qk_v_jsd = {}
        for layer in range(self.config.n_layer):
            if f"attn_v.{layer}" in record:
                qk_v_jsd[layer] = js_divergence(record[f"attn.{layer}"], record[f"attn_v.{layer}"]).mean().item()
        return dict(weights=weights, entropy=entropy, qk_v_jsd=qk_v_jsd)

    def routing_weights(self, idx):
        return self.routing_diagnostics(idx)["weights"]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # decay the shared matrices (and the tied embedding); never norms or routing parameters
        decay = [p for p in self.transformer.parameters() if p.dim() >= 2]
        decay_ids = {id(p) for p in decay}
        no_decay = [p for p in self.parameters() if id(p) not in decay_ids]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = device_type == "cuda"  # fused AdamW kernels exist for CUDA tensors
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (PaLM appendix B): 6N for the matmuls + 12 L d T for attention."""
        c = self.config
        return 6 * self.num_params(non_embedding=False) + 12 * c.n_layer * c.n_embd * seq_len

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
