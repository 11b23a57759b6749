"""
The model, on CPU: every residual scheme against the standard residual at init and against an
independent reference of its formulas (written from the papers, in the tests), the depth read
against its definition (values, gradients, gradcheck, compile), the attention against a naive
rotary attention, causality, activation checkpointing, the optimizer groups, the config checks,
and the generic contract every scheme in RESIDUALS must meet (parametrized over the registry:
a new scheme is tested with no edit here, and a failure says what to fix).

    OMP_NUM_THREADS=1 python -m pytest tests/test_model.py -q          # all (about a minute or two)
    OMP_NUM_THREADS=1 python -m pytest tests -q -k dar                 # every test of one scheme, all files
"""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import (
    ROUTED,
    STARTS_AS_STANDARD,
    TINY,
    VARIANTS,
    logits_of,
    make,
    naive_depth_read,
    randomize_routing,
    rel_err,
    tokens,
    two_phase_read,
)
from model import (
    GPT,
    RESIDUALS,
    CausalSelfAttention,
    DualAttnRes,
    GPTConfig,
    History,
    HyperConnections,
    StandardResidual,
    Streams,
    depth_read,
    depth_read_extend,
    depth_read_sealed,
    depth_weights_extend,
    depth_weights_sealed,
    is_routing,
    js_divergence,
    sinkhorn,
)


@pytest.mark.parametrize("variant", STARTS_AS_STANDARD)
def test_zero_init_equals_standard(variant):
    standard = make("standard", seed=3, norm_eps=1e-10)
    model = make(variant, seed=4, norm_eps=1e-10)  # another seed: the weights must come from the load
    missing, unexpected = model.load_state_dict(standard.state_dict(), strict=False)
    assert unexpected == [], f"{variant} lacks parameters of `standard` ({unexpected}): keep every shared weight"
    assert all(is_routing(k) for k in missing), "a scheme keeps its parameters under GPT.residual"
    idx = tokens()
    assert rel_err(logits_of(model, idx), logits_of(standard, idx)) < 1e-5, (
        f"{variant} is not `standard` at init: make its routing parameters start at the identity"
    )


def test_default_eps_shifts_zero_init_but_not_much():
    # a uniform read divides the stream by the source count, so the norm's eps weighs more; still small
    idx = tokens()
    err = rel_err(logits_of(make("attnres_full", seed=3), idx), logits_of(make("standard", seed=3), idx))
    assert 1e-6 < err < 0.1


def shared_init_and_rng_after(build, seed):
    """The shared (non-routing) parameters of a model that build() makes, and the global RNG state after it."""
    torch.manual_seed(seed)
    model = build()
    return {n: p for n, p in model.named_parameters() if not is_routing(n)}, torch.get_rng_state()


@pytest.mark.parametrize("variant", ROUTED)
def test_shared_init_is_bit_identical_across_variants(variant):
    reference, reference_rng = shared_init_and_rng_after(lambda: make("standard", seed=5), 5)
    shared, rng = shared_init_and_rng_after(lambda: make(variant, seed=5), 5)
    assert shared.keys() == reference.keys(), f"{variant}: a scheme's parameters live under GPT.residual only"
    for n in reference:
        assert torch.equal(shared[n], reference[n]), f"{n}: a scheme must not draw from the shared RNG"
    # what is drawn after the model (data order, dropout) is paired too
    assert torch.equal(rng, reference_rng), (
        f"building {variant} moved the global RNG: draw only in the scheme's "
        f"__init__ (GPT builds it under a generator of its own)"
    )
    assert not torch.equal(make("standard", seed=6).lm_head.weight, reference["transformer.wte.weight"])


class ToyMLPWrite(StandardResidual):
    """A test-only scheme with random init: x <- x + out + W2 gelu(W1 out), W1 drawn in __init__, W2 zero."""

    @staticmethod
    def extra_params(config):
        return 2 * 8 * config.n_embd

    def __init__(self, config):
        super().__init__(config)
        self.W1 = nn.Parameter(torch.empty(8, config.n_embd))
        nn.init.normal_(self.W1, std=1.0)
        self.W2 = nn.Parameter(torch.zeros(config.n_embd, 8))  # zero last layer: standard at init

    def write(self, x, k, out):
        return x + out + F.gelu(out @ self.W1.T) @ self.W2.T


class DeadToyMLPWrite(ToyMLPWrite):
    """Broken on purpose: W1 zero as well, so gelu(W1 out) = 0 and neither layer ever gets a gradient."""

    def __init__(self, config):
        super().__init__(config)
        nn.init.zeros_(self.W1)


@pytest.fixture
def toy_schemes(monkeypatch):
    monkeypatch.setitem(RESIDUALS, "toy_mlp", ToyMLPWrite)
    monkeypatch.setitem(RESIDUALS, "toy_dead_mlp", DeadToyMLPWrite)


def toy(residual, seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY, residual=residual))


def test_random_scheme_init_keeps_the_shared_init_and_rng(toy_schemes):
    reference, reference_rng = shared_init_and_rng_after(lambda: make("standard", seed=5), 5)
    shared, rng = shared_init_and_rng_after(lambda: toy("toy_mlp", 5), 5)
    for n in reference:
        assert torch.equal(shared[n], reference[n]), n
    assert torch.equal(rng, reference_rng)


def test_random_scheme_init_is_drawn_and_reproducible(toy_schemes):
    W1 = toy("toy_mlp", 5).residual.W1
    assert W1.std() > 0.5  # drawn
    assert torch.equal(W1, toy("toy_mlp", 5).residual.W1)  # the same for a seed
    assert not torch.equal(W1, toy("toy_mlp", 6).residual.W1)  # another for another seed
    idx = tokens()
    assert torch.equal(logits_of(toy("toy_mlp", 5), idx), logits_of(make("standard", seed=5), idx))  # standard at init


def random_parent():
    parent = make("attnres", seed=7)
    randomize_routing(parent)
    return parent


def rd_from(parent, tie):
    """rd_attnres with the parent's parameters; its value queries tied to the Q/K queries, or random."""
    rd = make("rd_attnres")
    rd.load_state_dict(parent.state_dict(), strict=False)
    with torch.no_grad():
        if tie:
            rd.residual.value_query.copy_(parent.residual.query[0:-1:2])  # w_v := w_qk per layer
        else:
            rd.residual.value_query.normal_()
    return rd


def test_rd_attnres_dup_equals_its_parent():
    parent = random_parent()
    dup = make("rd_attnres_dup")
    dup.load_state_dict(parent.state_dict(), strict=True)
    idx = tokens()
    assert rel_err(logits_of(dup, idx), logits_of(parent, idx)) < 1e-5


def test_rd_attnres_with_tied_value_queries_equals_its_parent():
    parent = random_parent()
    idx = tokens()
    assert rel_err(logits_of(rd_from(parent, tie=True), idx), logits_of(parent, idx)) < 1e-5


def test_rd_attnres_with_its_own_value_queries_differs_from_its_parent():
    parent = random_parent()
    idx = tokens()
    assert rel_err(logits_of(rd_from(parent, tie=False), idx), logits_of(parent, idx)) > 1e-3


def test_rd_attnres_mix_tied_is_the_parent_and_untied_neither_rd_nor_parent():
    parent = make("attnres", seed=7)
    randomize_routing(parent)
    mix, rd = make("rd_attnres_mix"), make("rd_attnres")
    for model in (mix, rd):
        model.load_state_dict(parent.state_dict(), strict=False)
    idx = tokens()
    with torch.no_grad():
        expected = logits_of(parent, idx)
        mix.residual.value_query.copy_(parent.residual.query[0:-1:2])  # tied as at init (both zero): two equal reads
        assert rel_err(logits_of(mix, idx), expected) < 1e-6  # whose average is the parent's read
        mix.residual.value_query.normal_()
        rd.residual.value_query.copy_(mix.residual.value_query)  # the same parameters, the same two reads
        mixed = logits_of(mix, idx)
        assert rel_err(mixed, expected) > 1e-3
        assert rel_err(mixed, logits_of(rd, idx)) > 1e-3


def test_attnres_parameter_count_by_hand():
    parent = make("attnres")
    d, L = TINY["n_embd"], TINY["n_layer"]
    assert parent.num_params() - make("standard").num_params() == 4 * d * L + 2 * d
    assert parent.num_params(non_embedding=False) - parent.num_params() == TINY["vocab_size"] * d


@pytest.mark.parametrize("control", ["rd_attnres", "rd_attnres_param", "rd_attnres_mix"])
def test_rd_attnres_learned_controls_add_one_vector_per_layer(control):
    d, L = TINY["n_embd"], TINY["n_layer"]
    assert make(control).num_params() == make("attnres").num_params() + L * d


@pytest.mark.parametrize("control", ["rd_attnres_dup", "rd_attnres_fixed_v"])
def test_rd_attnres_parameter_free_controls_load_their_parent_strictly(control):
    parent, model = make("attnres"), make(control)
    assert model.num_params() == parent.num_params()
    model.load_state_dict(parent.state_dict(), strict=True)


EXPECTED_SOURCES = {  # the AttnRes paper's block bookkeeping, 4 layers = 8 sublayer reads, then the output read
    "attnres_full": [1, 2, 3, 4, 5, 6, 7, 8, 9],
    "attnres_s2": [1, 2, 2, 3, 3, 4, 4, 5, 5],
    "attnres": [1, 2, 2, 2, 2, 3, 3, 3, 3],
}


@pytest.mark.parametrize("variant", list(EXPECTED_SOURCES))
def test_routing_weights_source_counts(variant):
    weights = make(variant).routing_diagnostics(tokens())["weights"]
    names = [f"{kind}.{l}" for l in range(TINY["n_layer"]) for kind in ("attn", "mlp")] + ["out"]
    assert list(weights) == names
    assert [weights[n].numel() for n in names] == EXPECTED_SOURCES[variant]
    for w in weights.values():
        assert w.dtype == torch.float32
        assert w.device.type == "cpu"
        assert not w.requires_grad
        assert abs(w.sum().item() - 1) < 1e-5


def test_rd_attnres_value_route_alone_moves_only_attn_v():
    model = make("rd_attnres")
    with torch.no_grad():
        model.residual.value_query.normal_(std=3.0)
    diag = model.routing_diagnostics(tokens())
    weights = diag["weights"]
    assert set(weights) >= {f"attn_v.{l}" for l in range(TINY["n_layer"])}
    for l in range(1, TINY["n_layer"]):
        qk, v = weights[f"attn.{l}"], weights[f"attn_v.{l}"]
        assert torch.allclose(qk, torch.full_like(qk, 1 / qk.numel()), atol=1e-6)
        assert (v - 1 / v.numel()).abs().max() > 1e-2
        assert diag["qk_v_jsd"][l] > 1e-4
    assert diag["qk_v_jsd"][0] == 0.0  # one source: both routes are the identity


def test_jsd_is_token_wise_not_of_averages():
    # two tokens with mirrored routes: averages agree (JSD of averages = 0) but each token disagrees
    p = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    q = p.flip(0)
    assert js_divergence(p.mean(0), q.mean(0)).item() < 1e-7
    assert js_divergence(p, q).mean().item() > 0.3


# --- a slow, obviously-correct AttnRes written straight from the paper's equations --------------


def reference_logits(model, idx):
    cfg, res = model.config, model.residual
    S, L = cfg.attnres_block_size, cfg.n_layer

    def AR(src, w, gamma):
        V = torch.stack(src)  # (n, B, T, d)
        keys = gamma * V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        alpha = torch.softmax((keys * w).sum(-1), dim=0)
        return (alpha.unsqueeze(-1) * V).sum(0)

    done, p = [model.transformer.wte(idx)], None
    for k in range(2 * L):
        src = done + ([] if p is None else [p])
        if k > 0 and k % S == 0:
            done, p = src, None
        block = model.transformer.h[k // 2]
        a = AR(src, res.query[k], res.key_gain[k])
        if k % 2 == 1:
            o = block.mlp(block.ln_2(a))
        elif cfg.residual == "rd_attnres" and cfg.rd_control == "mix":  # one input: the two reads' average
            a = (a + AR(src, res.value_query[k // 2], res.key_gain[k])) / 2
            o = block.attn(block.ln_1(a), block.ln_1(a), block.ln_1(a))
        elif cfg.residual == "rd_attnres":
            a_v = AR(src, res.value_query[k // 2], res.key_gain[k])
            o = block.attn(block.ln_1(a), block.ln_1(a), block.ln_1(a_v))
        else:
            o = block.attn(block.ln_1(a), block.ln_1(a), block.ln_1(a))
        p = o if p is None else p + o
    a_out = AR(done + [p], res.query[2 * L], res.key_gain[2 * L])
    return model.lm_head(model.transformer.ln_f(a_out))


@pytest.mark.parametrize("variant", ["attnres_full", "attnres", "attnres_s2", "rd_attnres", "rd_attnres_mix"])
def test_matches_slow_reference(variant):
    model = make(variant)
    randomize_routing(model)
    idx = tokens()
    with torch.no_grad():
        expected = reference_logits(model, idx)
        assert rel_err(logits_of(model, idx), expected) < 1e-5
        # the routing matters: the same model at zero queries is far from it
        model.residual.query.zero_()
        assert rel_err(logits_of(model, idx), expected) > 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causality(variant):
    model = make(variant)
    randomize_routing(model)
    idx = tokens(B=1)
    t = 9
    changed = idx.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = logits_of(model, idx), logits_of(model, changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1]), (
        f"{variant} lets a position see later tokens: a read or "
        f"write mixes over the sequence axis (mix over depth only)"
    )
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :]), f"{variant}'s logits ignore the tokens"


def test_the_depth_read_stays_fp32_under_bf16_autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        sources = [torch.randn(2, 3, 32) for _ in range(3)]
        outputs = two_phase_read(sources, torch.randn(2, 32), torch.ones(32), 1e-6)
    assert all(o.dtype == torch.float32 for o in outputs)  # the residual stream stays fp32


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_autocast_diagnostics_are_fp32(variant):
    model = make(variant)
    randomize_routing(model)
    record = model.residual.record = {}  # per-token diagnostics, as routing_diagnostics collects them
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model.hidden(tokens())
    if not record:
        pytest.skip(f"{variant} notes no diagnostics (self.note is optional)")
    weights = {name: w for name, w in record.items() if "/" not in name}
    for name, v in record.items():
        assert v.dtype == torch.float32, f"{variant} notes {name} in {v.dtype} under autocast: compute it in fp32"
    for name, w in weights.items():  # bf16 softmax would be off by ~1e-3
        assert (w.sum(-1) - 1).abs().max().item() < 1e-6, (
            f"{variant}'s depth weights {name} do not sum to 1 under bf16 autocast: compute the softmax in fp32"
        )


def stream_under_autocast(model, idx):
    """GPT.hidden with every sublayer output zero (every block weight zeroed), in fp32 and under CPU bf16
    autocast: the stream is then the embedding times what the routing makes of it, so the two differ
    only where the scheme rounds the stream itself (the final norm takes out a per-token scale)."""
    with torch.no_grad():
        for p in model.transformer.h.parameters():
            p.zero_()
        fp32 = model.hidden(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model.hidden(idx)
    return fp32, autocast


class RoundingMix(StandardResidual):
    """Broken on purpose: x <- [x, out] @ (1, 1), a depth mix written as a matmul, which autocast runs in bf16."""

    def write(self, x, k, out):
        return torch.stack([x, out], -1) @ torch.ones(2, device=x.device)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_stream_stays_fp32_under_bf16_autocast(variant):
    model = make(variant)
    randomize_routing(model)
    fp32, autocast = stream_under_autocast(model, tokens())
    assert autocast.dtype == torch.float32, f"{variant}'s stream is {autocast.dtype} under autocast; keep it fp32"
    assert rel_err(autocast, fp32) < 1e-5, (
        f"{variant} rounds the residual stream under bf16 autocast (a depth mix written as a matmul or einsum "
        f"runs in bf16): mix the stream by sums of products, or in fp32 with torch.autocast(..., enabled=False)"
    )


def test_a_scheme_that_rounds_the_stream_is_caught(monkeypatch):
    monkeypatch.setitem(RESIDUALS, "rounding_mix", RoundingMix)
    torch.manual_seed(0)
    fp32, autocast = stream_under_autocast(GPT(GPTConfig(**TINY, residual="rounding_mix")), tokens())
    assert rel_err(autocast, fp32) > 1e-3  # bf16 keeps 8 bits of mantissa
    assert rel_err(*stream_under_autocast(make("standard"), tokens())) == 0


def dead_rows(model, name):
    """The rows of routing parameter `name` that its scheme declares get no gradient by construction."""
    return model.residual.dead_rows().get(name, set())


@pytest.mark.parametrize("variant", ROUTED)
def test_declared_dead_rows_name_parameters_of_the_scheme(variant):
    model = make(variant)
    names = dict(model.residual.named_parameters())
    for name, rows in model.residual.dead_rows().items():
        assert name in names, f"dead_rows() names {name!r}, which is not a parameter of the scheme"
        assert all(0 <= r < names[name].size(0) for r in rows), f"dead_rows() of {name!r}: {rows} out of range"


@pytest.mark.parametrize("variant", ROUTED)
def test_every_routing_parameter_gets_a_gradient(variant):
    model = make(variant)
    randomize_routing(model)
    idx = tokens()
    model(idx, idx)[1].backward()
    for name, p in model.residual.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad_norm = grad.reshape(p.size(0), -1).norm(dim=1)  # one row per read, sublayer or layer
        dead = dead_rows(model, name)
        for r in range(p.size(0)):
            if r in dead:  # dead rows may carry rounding noise (DAR's fusion at sublayer 0 mixes two equal reads)
                assert grad_norm[r] < 1e-8, f"{name}[{r}] gets a gradient: remove it from {variant}'s dead_rows()"
            else:
                assert grad_norm[r] > 0, (
                    f"{name}[{r}] gets no gradient with random routing: a bug, or "
                    f"declare it in {variant}'s dead_rows() if no gradient can reach it"
                )


def rows_that_never_learn(model, steps=3):
    """(name, row) of each routing parameter row outside dead_rows whose gradient is zero at every
    one of a few AdamW steps from the init, on one tiny batch: a route that can never start learning."""
    optimizer = model.configure_optimizers(0.0, 1e-2, (0.9, 0.95), "cpu")
    idx = tokens()
    params = dict(model.residual.named_parameters())
    learned = {name: torch.zeros(p.size(0), dtype=torch.bool) for name, p in params.items()}
    for _ in range(steps):
        optimizer.zero_grad()
        model(idx, idx)[1].backward()
        for name, p in params.items():
            if p.grad is not None:
                learned[name] |= p.grad.reshape(p.size(0), -1).abs().amax(1) > 0
        optimizer.step()
    return [
        (name, r)
        for name, rows in learned.items()
        for r in range(len(rows))
        if not rows[r] and r not in dead_rows(model, name)
    ]


@pytest.mark.parametrize("variant", ROUTED)
def test_every_routing_parameter_learns_from_the_init(variant):
    assert rows_that_never_learn(make(variant)) == [], (
        "these (parameter, row) never get a gradient from the init: an init that multiplies two zeros, "
        "or rows to declare in dead_rows()"
    )


def test_a_route_that_cannot_learn_is_caught(toy_schemes):
    assert rows_that_never_learn(toy("toy_mlp", 0)) == []  # W2 learns at step 1, then W1
    dead = rows_that_never_learn(toy("toy_dead_mlp", 0))
    assert {name for name, _ in dead} == {"W1", "W2"}
    assert len(dead) == 8 + TINY["n_embd"]


def one_phase_read(sources, queries, key_gain, eps, keys=None):
    return depth_read(sources if keys is None else keys, sources, queries * key_gain, eps).outputs


@pytest.mark.parametrize("read", [one_phase_read, two_phase_read])
@pytest.mark.parametrize("separate_keys", [False, True])  # DAR addresses a stream by the other's keys
def test_depth_read_equals_naive_reference_with_gradients(read, separate_keys):
    g = torch.Generator().manual_seed(0)
    make_inputs = lambda dtype: (
        [torch.randn(2, 3, 8, generator=g).to(dtype).requires_grad_() for _ in range(4)],
        [torch.randn(2, 3, 8, generator=g).to(dtype).requires_grad_() for _ in range(4)],
        torch.randn(2, 8, generator=g).to(dtype).requires_grad_(),
        (torch.rand(8, generator=g) + 0.5).to(dtype).requires_grad_(),
    )
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        sources, keys, queries, gain = make_inputs(dtype)
        keys = keys if separate_keys else None
        fast = read(sources, queries, gain, 1e-6, keys)
        slow = naive_depth_read(sources, queries, gain, 1e-6, keys)
        assert all(f.dtype == dtype for f in fast)
        for f, s in zip(fast, slow):
            assert (f.double() - s).abs().max() < tol * s.abs().max()
        weights = [torch.randn(2, 3, 8, generator=g).double() for _ in fast]
        inputs = sources + (keys or []) + [queries, gain]
        grads_fast = torch.autograd.grad(sum((f.double() * w).sum() for f, w in zip(fast, weights)), inputs)
        grads_slow = torch.autograd.grad(sum((s * w).sum() for s, w in zip(slow, weights)), inputs)
        for gf, gs in zip(grads_fast, grads_slow):
            assert (gf.double() - gs).abs().max() < 5 * tol * gs.abs().max()


def test_depth_read_extend_weights_and_logsumexp_are_the_full_reads():
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(2, 3, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    directions = torch.randn(2, 8, generator=g, dtype=torch.float64)
    full = depth_read(sources, sources, directions, 1e-6)
    extended = depth_read_extend(
        depth_read(sources[:-1], sources[:-1], directions, 1e-6), sources[-1], sources[-1], directions, 1e-6
    )
    for a, b in ((extended.weights, full.weights), (extended.lse, full.lse), *zip(extended.outputs, full.outputs)):
        assert (a - b).abs().max() < 1e-13


def test_weights_only_reads_equal_the_full_reads_weights():
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(2, 3, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    directions = {
        0: torch.randn(2, 8, generator=g, dtype=torch.float64),
        1: torch.randn(1, 8, generator=g, dtype=torch.float64),
    }
    full = depth_read_sealed(sources, sources, directions, 1e-6)
    weights_only = depth_weights_sealed(sources, directions, 1e-6)
    for k in directions:
        assert weights_only[k].outputs is None
        assert torch.equal(weights_only[k].weights, full[k].weights)
        assert torch.equal(weights_only[k].lse, full[k].lse)
    extra = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    extended = depth_weights_extend(weights_only[0], extra, directions[0], 1e-6)
    reference = depth_read_extend(full[0], extra, extra, directions[0], 1e-6)
    assert extended.outputs is None
    assert torch.equal(extended.weights, reference.weights)
    assert torch.equal(extended.lse, reference.lse)


@pytest.mark.parametrize("dar_keys", ["reciprocal", "self"])
def test_dar_read_equals_two_naive_reads_with_gradients(dar_keys):
    # DAR reads both streams in two phases and fuses them; the reference does two stacked reads
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=8, n_head=2, residual="dar", dar_keys=dar_keys, attnres_block_size=2)
    scheme = DualAttnRes(config).double()
    for p in scheme.parameters():
        p.data.normal_()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)  # the shared embedding
    own = [[torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)] for _ in range(2)]
    state = scheme.open_block(([x, own[0][0]], [x, own[1][0]]), 2)  # the second block opens at sublayer 2
    state = tuple(history._replace(partial=blocks[1]) for history, blocks in zip(state, own))
    k = 3
    fused = scheme.read(state, k)
    streams = [[x] + blocks for blocks in own]
    keys = streams[::-1] if dar_keys == "reciprocal" else streams
    pi = scheme.fusion[k].softmax(-1)
    slow = sum(
        pi[s]
        * naive_depth_read(streams[s], scheme.query[k, s : s + 1], scheme.key_gain[k], scheme.eps, keys=keys[s])[0]
        for s in (0, 1)
    )
    assert (fused - slow).abs().max() < 1e-12 * slow.abs().max()
    w = torch.randn_like(slow)
    inputs = [x, *own[0], *own[1], scheme.query, scheme.key_gain, scheme.fusion]
    for gf, gs in zip(torch.autograd.grad((fused * w).sum(), inputs), torch.autograd.grad((slow * w).sum(), inputs)):
        assert (gf - gs).abs().max() < 1e-11 * gs.abs().max()


def test_depth_read_compiles_fullgraph_with_its_backward():
    torch._dynamo.reset()
    make_inputs = lambda: (
        [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3)],
        torch.randn(2, 8, generator=torch.Generator().manual_seed(9)).requires_grad_(),
    )
    eager_inputs, compiled_inputs = make_inputs(), make_inputs()
    read = lambda sources, q: sum(
        o.sum() * (r + 1) for r, o in enumerate(two_phase_read(sources, q, torch.ones(8), 1e-6))
    )
    eager = read(*eager_inputs)
    compiled = torch.compile(read, fullgraph=True)(*compiled_inputs)
    assert torch.allclose(compiled, eager, atol=1e-5)
    eager.backward(), compiled.backward()
    for a, b in zip(compiled_inputs[0] + [compiled_inputs[1]], eager_inputs[0] + [eager_inputs[1]]):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


@pytest.mark.parametrize("read", [one_phase_read, two_phase_read])
def test_depth_read_gradcheck(read):
    torch.manual_seed(0)
    sources = [torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    keys = [torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    queries = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    gain = torch.rand(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: tuple(read(list(a[:4]), a[8], a[9], 1e-6, list(a[4:8]))), (*sources, *keys, queries, gain)
    )


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(residual="bogus"), "standard, attnres, rd_attnres"),
        (dict(residual="rd_attnres", rd_control="bogus"), "none, dup, param, fixed_v"),
        (dict(residual="attnres", rd_control="dup"), "needs residual='rd_attnres'"),
        (dict(residual="attnres", attnres_block_size=3), "valid: 1, 2, 4, 8"),
        (dict(residual="attnres", attnres_block_size=6), "valid: 1, 2, 4, 8"),
        (dict(n_embd=30, n_head=4), "heads of even size"),
        (dict(n_embd=36, n_head=4), "heads of even size"),
        (dict(residual="dar", dar_keys="other"), "reciprocal, self"),
        (dict(residual="attnres", dar_keys="self"), "needs residual='dar'"),
        (dict(residual="dar", dar_start="bogus"), "unknown dar_start 'bogus'; choose one of distinct, copy"),
        (dict(residual="standard", dar_start="copy"), "needs residual='dar'"),
        (dict(residual="standard", hc_streams=2), "needs residual='hc' or 'mhc'"),
        (dict(residual="mhc", hc_streams=1), "at least 2"),
        (dict(residual="dar", attnres_block_size=5), "valid: 1, 2, 4, 8"),
        *[
            (dict(**{name: 0}), f"{name}=0 must be a positive integer")
            for name in ("n_head", "n_layer", "block_size", "n_embd", "vocab_size", "attnres_block_size", "hc_streams")
        ],
        (dict(n_layer=-2), "n_layer=-2 must be a positive integer"),
        (dict(n_layer=2.0), "n_layer=2.0 must be a positive integer"),
        (dict(n_layer=True), "n_layer=True must be a positive integer"),
        (dict(dropout=-0.1), "dropout=-0.1 must be in [0, 1)"),
        (dict(dropout=1.0), "dropout=1.0 must be in [0, 1)"),
        (dict(dropout=float("nan")), "dropout=nan must be in [0, 1)"),
        (dict(norm_eps=0.0), "norm_eps=0.0 must be > 0"),
        (dict(norm_eps=-1e-6), "norm_eps=-1e-06 must be > 0"),
        *[
            (dict(routing_lr_scale=v), f"routing_lr_scale={v!r} must be a finite number > 0")
            for v in (0.0, -1.0, float("nan"), float("inf"))
        ],
    ],
)
def test_bad_config_raises_one_line(kwargs, needle):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{**TINY, **kwargs})
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_block_size_checked_only_where_used():
    for residual in ("standard", "hc", "mhc", "denseformer"):
        GPTConfig(**TINY, residual=residual, attnres_block_size=3)


@pytest.mark.parametrize("variant", list(RESIDUALS))
def test_optimizer_groups_scale_routing_and_keep_it_out_of_decay(variant):
    model = make(variant, routing_lr_scale=3.0)
    groups = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups
    ids = [id(p) for group in groups for p in group["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    routing = {id(p) for p in model.residual.parameters()}
    norms = {id(p) for name, p in model.named_parameters() if ".ln_" in name}
    assert norms
    assert bool(routing) == (model.residual.extra_params(model.config) > 0), (
        f"{variant}: extra_params(config) and the scheme's nn.Parameters disagree on whether it has any"
    )
    assert len(groups) == 3  # in every arm, so that every arm's optimizer state has one layout
    (scaled,) = [group for group in groups if group["lr_scale"] != 1.0]  # the routing group (empty for standard)
    assert {id(p) for p in scaled["params"]} == routing, (
        f"{variant}: every parameter of the scheme (GPT.residual) is routing, at routing_lr_scale, never decayed"
    )
    assert scaled["lr_scale"] == 3.0
    assert scaled["weight_decay"] == 0.0
    for group in groups:
        assert group["lr"] == 1e-3 * group["lr_scale"]
        if norms & {id(p) for p in group["params"]}:
            assert group["weight_decay"] == 0.0
    assert sum(group["weight_decay"] == 0.1 for group in groups) == 1


def test_generate_and_flops():
    model = make("rd_attnres").eval()
    out = model.generate(tokens(B=1, T=4), max_new_tokens=20, top_k=5)  # runs past block_size
    assert out.shape == (1, 24)
    n = model.num_params(non_embedding=False)
    assert model.flops_per_token(16) == 6 * n + 12 * 4 * 32 * 16


@pytest.mark.parametrize(
    "variant", list(RESIDUALS) + ["attnres_full", "rd_attnres_dup", "rd_attnres_param", "rd_attnres_fixed_v"]
)
def test_compile_fullgraph_matches_eager(variant):
    model = make(variant, n_layer=2)  # 2 layers: compile time grows with depth, the code paths do not
    randomize_routing(model)
    idx = tokens()
    torch._dynamo.reset()  # each test is a fresh compile, not a recompile counted against dynamo's limit
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        assert rel_err(compiled(idx, idx)[0], model(idx, idx)[0]) < 1e-5, (
            f"{variant} compiled differs from eager: Python state that changes between calls (a counter, a "
            f"cache) is baked into the graph; keep what varies in tensors or in the state start() returns"
        )


# --- DAR, HC, mHC -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameter_counts_as_each_scheme_states(variant):
    model = make(variant)  # extra_params is the scheme's formula (docs/variants.md writes the same)
    extra = model.num_params() - make("standard").num_params()
    assert extra == model.residual.extra_params(model.config), (
        f"{variant} has {extra} parameters beyond `standard`, but its extra_params(config) says "
        f"{model.residual.extra_params(model.config)}: fix the formula (or the tensors)"
    )


@pytest.mark.parametrize("variant", ["dar", "dar_full"])
def test_dar_routing_weights_per_stream(variant):
    model = make(variant)
    randomize_routing(model)
    diag = model.routing_diagnostics(tokens())
    counts = EXPECTED_SOURCES["attnres" if variant == "dar" else "attnres_full"]
    names = [f"{kind}.{l}" for l in range(TINY["n_layer"]) for kind in ("attn", "mlp")] + ["out"]
    for name, count in zip(names, counts):
        for s in ("s0", "s1"):
            assert diag["weights"][f"{name}.{s}"].numel() == count
    assert set(diag["fusion"]) == set(names)
    assert set(diag["write_gate"]) == set(names[:-1])
    gates = model.residual.write_gate
    for k, gate in enumerate(diag["write_gate"].values()):  # each stream's gate, averaged over channels
        assert torch.allclose(gate, (2 * torch.sigmoid(gates[k])).mean(-1), atol=1e-6)
    assert ("mixing" in diag) == (variant == "dar")  # no partial to mix in the per-sublayer form
    assert all(-1 <= c <= 1 for c in diag["stream_cosine"].values())


def sgd_step(model, idx, lr=0.1):
    model(idx, idx)[1].backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def stream_weight_gap(model, idx):
    """The largest difference between the two streams' depth weights at a few reads."""
    weights = model.routing_diagnostics(idx)["weights"]
    return max((weights[f"{n}.s0"] - weights[f"{n}.s1"]).abs().max().item() for n in ("mlp.2", "attn.3", "out"))


@pytest.mark.parametrize("block_size", [1, 4])
def test_dar_copy_start_alternating_fusion_breaks_the_stream_symmetry(block_size):
    idx = tokens()
    model = make("dar_copy", attnres_block_size=block_size)
    sgd_step(model, idx)
    assert (model.residual.query[:, 0] - model.residual.query[:, 1]).abs().max() > 1e-4
    assert stream_weight_gap(model, idx) > 1e-5


@pytest.mark.parametrize("block_size", [1, 4])
def test_dar_copy_start_with_an_even_fusion_stays_symmetric(block_size):
    # the fixed point the distinct start avoids: equal streams, equal gates, pi = (1/2, 1/2)
    idx = tokens()
    model = make("dar_copy", attnres_block_size=block_size)
    with torch.no_grad():
        model.residual.fusion.zero_()
    for _ in range(2):
        sgd_step(model, idx)
    res = model.residual
    assert (res.query[:, 0] - res.query[:, 1]).abs().max() < 1e-7
    assert (res.write_gate[:, 0] - res.write_gate[:, 1]).abs().max() < 1e-7
    assert stream_weight_gap(model, idx) < 1e-7
    assert min(c.item() for c in model.routing_diagnostics(idx)["stream_cosine"].values()) > 1 - 1e-6


@pytest.mark.parametrize("block_size", [1, 4])
def test_dar_distinct_start_is_standard_at_init(block_size):
    standard = make("standard", seed=3, norm_eps=1e-10)
    model = make("dar", seed=4, norm_eps=1e-10, attnres_block_size=block_size)
    model.load_state_dict(standard.state_dict(), strict=False)
    idx = tokens()
    assert rel_err(logits_of(model, idx), logits_of(standard, idx)) < 1e-5


@pytest.mark.parametrize("block_size", [1, 4])
def test_dar_distinct_start_streams_differ_at_init(block_size):
    cosines = make("dar", attnres_block_size=block_size).routing_diagnostics(tokens())["block_cosine"]["out"]
    assert cosines.min() < 0.95, f"the streams start as near copies: block cosines {cosines.tolist()}"


@pytest.mark.parametrize("block_size", [1, 4])
def test_dar_copy_start_streams_are_copies_at_init(block_size):
    cosines = make("dar", attnres_block_size=block_size, dar_start="copy").routing_diagnostics(tokens())[
        "block_cosine"
    ]["out"]
    assert (cosines - 1).abs().max() < 1e-6


def test_dar_distinct_start_gates_are_antisymmetric_draws():
    gate = make("dar").residual.write_gate
    assert torch.equal(gate[:, 1], -gate[:, 0])  # beta0 + beta1 = 2: the fused input is standard's, scaled
    assert gate.abs().max() < 1
    assert gate[:, 0].std() > 0.4  # uniform in (-1, 1): std 0.58
    assert torch.equal(gate, make("dar").residual.write_gate)  # the scheme's own RNG: the same for a seed
    assert not torch.equal(gate, make("dar", seed=1).residual.write_gate)


def test_dar_distinct_start_fusion_is_even_and_copy_start_alternates():
    assert torch.equal(make("dar").residual.fusion, torch.zeros(2 * TINY["n_layer"] + 1, 2))
    fusion = make("dar_copy").residual.fusion
    assert fusion[0].tolist() == [3.0, -3.0]  # attention: stream 0
    assert fusion[1].tolist() == [-3.0, 3.0]  # MLP: stream 1
    assert fusion[-1].tolist() == [0.0, 0.0]  # the output read: an even mix


def test_dar_mixing_is_exactly_doubly_stochastic():
    model = make("dar")
    randomize_routing(model)
    p0, p1 = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    zero = torch.zeros(2, 3, 32)
    (_, q0, _), (_, q1, _) = model.residual.write((History([zero], p0, {}), History([zero], p1, {})), 1, zero)
    assert torch.allclose(q0 + q1, p0 + p1, atol=1e-6)  # columns sum to 1: the total is kept
    (_, q0, _), (_, q1, _) = model.residual.write((History([zero], p0, {}), History([zero], p0, {})), 1, zero)
    assert torch.allclose(q0, p0, atol=1e-6)
    assert torch.allclose(q1, p0, atol=1e-6)  # rows sum to 1


@pytest.mark.parametrize("variant", ["dar", "dar_copy", "dar_self"])
def test_dar_partials_start_mostly_kept_at_sigmoid_3(variant):
    # inside a block, at init: each stream keeps sigmoid(3) of its own partial and takes the rest from the other's
    # (docs/variants.md; issue #41: an even 1/2 mix is still standard at init, so nothing else sees it)
    model = make(variant)
    ones, zero = torch.ones(2, 3, 32), torch.zeros(2, 3, 32)
    for k in (1, 2):  # the sublayers whose write mixes (not the block's last)
        (_, q0, _), (_, q1, _) = model.residual.write((History([zero], ones, {}), History([zero], zero, {})), k, zero)
        assert torch.allclose(q0, torch.full_like(q0, 1 / (1 + math.exp(-3))), rtol=0, atol=1e-6)
        assert torch.allclose(q1, torch.full_like(q1, 1 / (1 + math.exp(3))), rtol=0, atol=1e-6)


def test_mhc_mixing_is_doubly_stochastic():
    model = make("mhc")
    for m in model.routing_diagnostics(tokens())["stream_mixing"].values():  # at init
        assert (m.sum(0) - 1).abs().max() < 1e-5
        assert (m.sum(1) - 1).abs().max() < 1e-5
    logits = torch.randn(1000, 4, 4, generator=torch.Generator().manual_seed(0))  # unit scale
    m = sinkhorn(logits)
    assert (m.sum(-1) - 1).abs().max() < 1e-6  # the last normalisation is exact
    assert (m.sum(-2) - 1).abs().max() < 1e-3
    assert (m >= 0).all()


@pytest.mark.parametrize("variant", ["hc", "mhc"])
def test_hc_and_mhc_stream_mixing_in_fp32_under_autocast(variant):
    model = make(variant)
    randomize_routing(model)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        diag = model.routing_diagnostics(tokens())
        assert model.hidden(tokens()).dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in diag["stream_mixing"].values())


# --- the loss reductions ------------------------------------------------------------------------


def test_loss_reductions_agree_with_cross_entropy():
    model = make("rd_attnres")
    randomize_routing(model)
    idx = tokens()
    targets = tokens(seed=9)
    targets[0, :5] = targets[1, -3:] = -1  # ignored positions
    keep = targets != -1
    logits, mean = model(idx, targets)
    _, total = model(idx, targets, reduction="sum")
    _, per_token = model(idx, targets, reduction="none")
    expected = F.cross_entropy(logits.double().transpose(1, 2), targets, ignore_index=-1, reduction="none")
    assert per_token.shape == targets.shape
    assert per_token.dtype == mean.dtype == total.dtype == torch.float32
    assert torch.allclose(per_token.double(), expected, atol=1e-5)
    assert (per_token[~keep] == 0).all()
    assert abs(total.item() - expected.sum().item()) < 1e-4
    assert abs(mean.item() - expected.sum().item() / keep.sum().item()) < 1e-6
    assert abs(mean.item() - total.item() / keep.sum().item()) < 1e-6


# --- independent references for the attention and the stream updates -----------------------------


def naive_attention(attn, x_q, x_k, x_v):
    """Causal self-attention with rotary embeddings, from the definitions, in float64: Q, K, V are
    W_Q x_q, W_K x_k, W_V x_v; per head of size D, q_t and k_t turn each channel pair (i, i + D/2)
    by the angle t * 10000^(-2i/D); then softmax(q k^T / sqrt(D) + causal mask) v, heads
    concatenated, the output projection."""
    B, T, C = x_q.shape
    H = attn.n_head
    D = C // H
    W = attn.c_attn.weight.double()
    q, k, v = ((x.double() @ W[i * C : (i + 1) * C].T).view(B, T, H, D) for i, x in enumerate((x_q, x_k, x_v)))
    angle = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * torch.arange(D // 2).double() / D)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # (T, 1, D/2): every head alike

    def rotate(x):
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    scores = torch.einsum("bthd,bshd->bhts", rotate(q), rotate(k)) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, C)
    return y @ attn.c_proj.weight.double().T


def attention_and_inputs():
    torch.manual_seed(0)
    attn = CausalSelfAttention(GPTConfig(**TINY)).eval()
    return attn, [torch.randn(2, 12, 32) for _ in range(3)]  # T < block_size: the tables are cut


@pytest.mark.parametrize("routes", ["fused", "qk_v", "q_k_v"])
def test_attention_equals_naive_reference(routes):
    # one input (the fused projection), Q/K and V apart (RD), and three inputs (a scheme routing each)
    attn, (x_q, x_k, x_v) = attention_and_inputs()
    # None is "the query's input": the fused projection (one matmul) and RD's split (Q/K fused, V apart)
    inputs = dict(fused=(x_q, None, None), qk_v=(x_q, None, x_v), q_k_v=(x_q, x_k, x_v))[routes]
    reference = tuple(x_q if x is None else x for x in inputs)
    with torch.no_grad():
        assert rel_err(attn(*inputs).double(), naive_attention(attn, *reference)) < 1e-5


def test_attention_reference_is_sensitive_to_the_rotation():
    attn, (x_q, x_k, x_v) = attention_and_inputs()
    with torch.no_grad():
        attn.rotary_sin.zero_(), attn.rotary_cos.fill_(1.0)  # no rotation at all
        assert rel_err(attn(x_q, x_k, x_v).double(), naive_attention(attn, x_q, x_k, x_v)) > 1e-2


def test_three_route_attention_reads_each_input_in_its_role():
    # the key input matters where it is not the query input: swapping the roles changes the output
    attn, (x_q, x_k, x_v) = attention_and_inputs()
    with torch.no_grad():
        assert rel_err(attn(x_q, x_k, x_v), attn(x_k, x_q, x_v)) > 1e-2
        assert rel_err(attn(x_q, x_k, x_v), attn(x_q, x_q, x_v)) > 1e-2


def test_block_attention_normalises_each_of_three_inputs():
    torch.manual_seed(0)
    block = GPT(GPTConfig(**TINY)).transformer.h[1]
    x_q, x_k, x_v = (torch.randn(2, 12, 32) for _ in range(3))
    gain = torch.randn(32)
    with torch.no_grad():
        expected = naive_attention(block.attn, block.ln_1(x_q), block.ln_1(x_k), block.ln_1(x_v) * (1 + gain))
        assert rel_err(block.attention(x_q, x_k, x_v, gain).double(), expected) < 1e-5


def dar_write_case(k):
    """A DAR scheme (blocks of 4) with random per-channel gates and rho = sigmoid(0.7), partials p0, p1,
    an output y, and what write k must give each stream by the formulas:
        p0 <- rho p0 + (1 - rho) p1 + beta0 * y,   p1 <- (1 - rho) p0 + rho p1 + beta1 * y."""
    scheme = DualAttnRes(GPTConfig(**TINY, residual="dar"))
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(scheme.n_sublayers, 2, 32, generator=g)  # a gate per sublayer, stream and channel
    with torch.no_grad():
        scheme.write_gate.copy_(theta)
        scheme.mixing.fill_(0.7)
    rho = 1 / (1 + math.exp(-0.7))
    embedding, p0, p1, y = (torch.randn(2, 3, 32, generator=g) for _ in range(4))
    beta0, beta1 = 2 / (1 + torch.exp(-theta[k, 0])), 2 / (1 + torch.exp(-theta[k, 1]))  # (d,) each
    expected = (rho * p0 + (1 - rho) * p1 + beta0 * y, (1 - rho) * p0 + rho * p1 + beta1 * y)
    return scheme, embedding, (p0, p1), y, (beta0, beta1), expected


def test_dar_write_inside_a_block_mixes_then_adds_each_gate():
    scheme, embedding, (p0, p1), y, _, expected = dar_write_case(1)
    with torch.no_grad():
        streams = scheme.write((History([embedding], p0, {}), History([embedding], p1, {})), 1, y)
    for s in (0, 1):
        assert torch.allclose(streams[s].partial, expected[s], atol=1e-6), f"stream {s}"
        assert len(streams[s].blocks) == 1  # not sealed


def test_dar_write_at_a_block_end_seals_each_stream():
    scheme, embedding, (p0, p1), y, _, expected = dar_write_case(3)
    with torch.no_grad():
        streams = scheme.write((History([embedding], p0, {}), History([embedding], p1, {})), 3, y)
    for s in (0, 1):
        assert streams[s].partial is None
        assert torch.allclose(streams[s].blocks[1], expected[s], atol=1e-6), f"stream {s}"


def test_dar_write_at_a_block_start_is_the_output_times_its_gate():
    scheme, embedding, (p0, p1), y, beta, _ = dar_write_case(4)
    with torch.no_grad():
        streams = scheme.write((History([embedding, p0], None, {}), History([embedding, p1], None, {})), 4, y)
    for s in (0, 1):
        assert torch.allclose(streams[s].partial, beta[s] * y, atol=1e-6), f"stream {s}"


@pytest.mark.parametrize("block_size", [1, 4])
def test_dar_reciprocal_keys_differ_from_own_keys(block_size):
    # with one scalar write gate per stream and blocks of 1, every source of stream 1 was a positive
    # multiple of stream 0's: RMS-normalised keys cannot tell them apart, and the two settings were one
    models = [
        make("dar", attnres_block_size=block_size, dar_keys=keys, norm_eps=1e-12).double() for keys in DualAttnRes.KEYS
    ]
    randomize_routing(models[0])
    models[1].load_state_dict(models[0].state_dict())
    idx = tokens()
    with torch.no_grad():
        assert rel_err(logits_of(models[0], idx), logits_of(models[1], idx)) > 1e-2
    if block_size == 1:  # the two streams hold different blocks
        assert max(models[0].routing_diagnostics(idx)["block_cosine"]["out"]) < 1 - 1e-3


def naive_sinkhorn(logits, iterations=20):
    m = logits.double().exp()
    for _ in range(iterations):  # columns, then rows, as mHC's Sinkhorn-Knopp
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    return m


def stream_weights_from_the_papers(scheme, H, k):
    """(pre (B, T, n), M (B, T, n, n), post (B, T, n)) in float64, M[i, j] the weight of stream j in the
    new stream i. HC: H_i <- sum_j A_r[j, i] H_j (HC's A_r, rows per source stream); mHC: H <- H_res H."""
    H = H.double()
    p = {name: t.detach().double() for name, t in scheme.named_parameters()}
    if isinstance(scheme, HyperConnections):
        normed = H / torch.sqrt(H.pow(2).mean(-1, keepdim=True) + scheme.eps)  # each stream on its own
        s = p["dynamic_scale"][k]
        pre = p["read_static"][k] + s[0] * torch.tanh(normed @ p["read_dynamic"][k])
        A = p["mix_static"][k] + s[1] * torch.tanh(normed @ p["mix_dynamic"][k])  # A[..., j, i], j = source
        post = p["write_static"][k] + s[2] * torch.tanh(normed @ p["write_dynamic"][k])
        return pre, A.transpose(-1, -2), post
    flat = H.flatten(-2)
    x = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + scheme.eps)
    a, n = p["scale"][k], H.size(-2)
    pre = torch.sigmoid(a[0] * (x @ p["phi_pre"][k]) + p["bias_pre"][k])
    post = 2 * torch.sigmoid(a[1] * (x @ p["phi_post"][k]) + p["bias_post"][k])
    H_res = naive_sinkhorn(a[2] * (x @ p["phi_res"][k]).view(*x.shape[:-1], n, n) + p["bias_res"][k])
    return pre, H_res, post


@pytest.mark.parametrize("variant", ["hc", "mhc"])
def test_stream_updates_follow_their_formulas(variant):
    model = make(variant)
    randomize_routing(model)
    scheme = model.residual
    g = torch.Generator().manual_seed(3)
    H, y = torch.randn(2, 3, 4, 32, generator=g), torch.randn(2, 3, 32, generator=g)
    k = 2
    pre, M, post = stream_weights_from_the_papers(scheme, H, k)
    assert (M - M.transpose(-1, -2)).abs().max() > 1e-2  # not symmetric: a transposed mix must fail
    state = Streams(H, scheme.features(H))
    with torch.no_grad():
        x, new = scheme.read(state, k), scheme.write(state, k, y).H
    Hd = H.double()
    assert rel_err(x.double(), sum(pre[..., j, None] * Hd[..., j, :] for j in range(4))) < 1e-5
    for i in range(4):  # each stream: H_i <- sum_j M[i, j] H_j + post_i y
        expected = sum(M[..., i, j, None] * Hd[..., j, :] for j in range(4)) + post[..., i, None] * y.double()
        assert rel_err(new[..., i, :].double(), expected) < 1e-5, i


def test_denseformer_matches_its_definition():
    model = make("denseformer")
    randomize_routing(model)
    idx = tokens()
    with torch.no_grad():
        x = model.transformer.wte(idx)
        outputs = [x]  # y_0 = the embedding, then each layer's output y_{l+1} = x + attn + mlp
        for l, block in enumerate(model.transformer.h):
            x = x + block.attn(block.ln_1(x), block.ln_1(x), block.ln_1(x))
            x = x + block.mlp(block.ln_2(x))
            outputs.append(x)
            x = sum(a * y for a, y in zip(model.residual.dwa[l], outputs))  # the depth-weighted average
        expected = model.lm_head(model.transformer.ln_f(x))
        assert rel_err(logits_of(model, idx), expected) < 1e-5
        assert rel_err(logits_of(make("standard"), idx), expected) > 1e-3


# --- the analysis switch (GPT.intervene) ---------------------------------------------------------

INTERVENTIONS = {  # (variant, change, exact): at init each changes nothing; exact where no rounding enters
    ("attnres", ("uniform", "mlp.2"), True),
    ("rd_attnres", ("uniform", "attn_v.2"), True),
    ("rd_attnres", ("uniform", "attn.2"), True),
    ("rd_attnres", ("tie_value",), True),
    ("dar", ("uniform", "out"), True),
    ("dar", ("own_keys",), True),  # zero queries: uniform whatever the keys
    ("dar_copy", ("one_stream", 1), False),  # copies: either stream is the fused read (distinct streams are not)
    ("hc", ("identity_mixing",), True),
    ("mhc", ("identity_mixing",), False),
    ("rd_attnres", ("tie_value", 1), True),
    ("rd_attnres_mix", ("tie_value",), True),
    ("rd_attnres_mix", ("uniform", "attn_v.2"), True),
    ("denseformer", ("identity_dwa", 2), True),
    ("denseformer", ("identity_dwa",), True),
    ("scaled_residual", ("identity_scales",), True),
}


def loss_with(model, intervention, idx):
    """(loss, loss under the intervention, loss once it is switched off again)."""
    with torch.no_grad():
        before = model(idx, idx)[1].item()
        model.intervene(intervention)
        during = model(idx, idx)[1].item()
        model.intervene()
        return before, during, model(idx, idx)[1].item()


@pytest.mark.parametrize("variant, intervention, exact", sorted(INTERVENTIONS))
def test_interventions_change_nothing_at_init(variant, intervention, exact):
    before, during, after = loss_with(make(variant), intervention, tokens())
    assert after == before  # switched off again
    if exact:
        assert during == before
    else:
        assert abs(during - before) < 1e-6 * before


@pytest.mark.parametrize("variant, intervention, exact", sorted(INTERVENTIONS))
def test_interventions_change_something_with_random_routing(variant, intervention, exact):
    model = make(variant)
    randomize_routing(model)
    before, during, after = loss_with(model, intervention, tokens())
    assert after == before  # switched off again
    assert abs(during - before) > 1e-4


def test_unknown_intervention_is_one_line():
    with pytest.raises(ValueError, match="has no intervention 'identity_mixing'; it has: uniform, tie_value"):
        make("rd_attnres").intervene(("identity_mixing",))


@pytest.mark.parametrize("variant", VARIANTS)
def test_listed_interventions_are_accepted_and_each_matters(variant):
    model = make(variant)
    interventions = model.interventions()
    if not interventions:
        pytest.skip(f"{variant} lists no interventions (they are optional)")
    assert len(set(interventions)) == len(interventions), f"{variant}'s interventions() lists one twice"
    idx = tokens()
    randomize_routing(model)
    with torch.no_grad():
        before = model(idx, idx)[1].item()
        for intervention in interventions:
            model.intervene(intervention)
            assert abs(model(idx, idx)[1].item() - before) > 1e-5, (
                f"{variant}: intervention {intervention} does not change the loss with random routing parameters; "
                f"make it change the routing or leave it out of interventions()"
            )
        model.intervene()


@pytest.mark.parametrize("variant", ["standard", "rd_attnres_param", "dar", "mhc"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(variant):
    model = make(variant, routing_lr_scale=3.0)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu", "muon", 0.02)
    adamw, muon = optimizer.optimizers
    assert isinstance(adamw, torch.optim.AdamW)
    assert isinstance(muon, torch.optim.Muon)
    groups = optimizer.param_groups
    ids = [id(p) for group in groups for p in group["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    # Muon: exactly the attention and MLP weights, by name
    hidden = {
        id(p)
        for name, p in model.named_parameters()
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
    }
    assert {id(p) for group in muon.param_groups for p in group["params"]} == hidden
    assert len(hidden) == 4 * TINY["n_layer"]
    # AdamW: the tied embedding (decayed), the norms and every routing parameter (never decayed), as under adamw
    routing = {id(p) for p in model.residual.parameters()}
    assert [{id(p) for p in g["params"]} for g in adamw.param_groups] == [
        {id(model.lm_head.weight)},
        {
            id(p)
            for n, p in model.named_parameters()
            if n.endswith("ln_1.weight") or n.endswith("ln_2.weight") or n == "transformer.ln_f.weight"
        },
        routing,
    ]
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0, 0.0]
    assert [g["lr_scale"] for g in groups] == [1.0, 1.0, 3.0, 20.0]
    for group in groups:
        assert group["lr"] == pytest.approx(1e-3 * group["lr_scale"])
    # Muon's decoupled decay is lr x weight_decay of its own group: the same fraction per step as AdamW's matrices
    (g,) = muon.param_groups
    assert g["lr"] * g["weight_decay"] == pytest.approx(1e-3 * 0.1)
    # a step changes every matrix Muon holds by the orthogonalized momentum: at step 1 (nesterov, buffer = (1-m) g)
    # that is NS(g (1 - m^2)) scaled by lr sqrt(max(1, rows/cols)), after the decay
    before = {id(p): p.detach().clone() for p in model.parameters()}
    model(tokens(), tokens())[1].backward()
    p = model.transformer.h[0].mlp.c_fc.weight
    grad = p.grad.clone()
    optimizer.step()
    from torch.optim._muon import _zeropower_via_newtonschulz

    update = _zeropower_via_newtonschulz(grad * (1 - 0.95**2), (3.4445, -4.775, 2.0315), 5, 1e-7)
    expected = before[id(p)] * (1 - 0.02 * g["weight_decay"]) - 0.02 * math.sqrt(4) * update.float()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_checkpointing_gives_the_same_loss_and_gradients(variant):
    # fp32, eager, dropout on (the recomputation must draw the same masks), routing away from its init
    model = make(variant, dropout=0.1)
    randomize_routing(model)
    x = tokens()

    def run(checkpointing):
        model.activation_checkpointing = checkpointing
        torch.manual_seed(3)
        loss = model(x, x)[1]
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    (loss, grads), (loss_ac, grads_ac) = run(False), run(True)
    fix = (
        f"{variant} computes otherwise under activation checkpointing: keep what a forward computes in the "
        f"state start() and write() return, never on self (a sublayer is recomputed from its inputs alone)"
    )
    assert torch.equal(loss, loss_ac), fix
    assert grads.keys() == grads_ac.keys(), fix
    for name in grads:
        assert torch.equal(grads[name], grads_ac[name]), f"{name}: {fix}"  # bit for bit
    # and it does recompute: each sublayer runs again in backward (attention and MLP, every layer)
    calls = []
    for block in model.transformer.h:
        for name in ("attention", "feedforward"):

            def counted(*args, sublayer=getattr(block, name)):
                calls.append(sublayer)
                return sublayer(*args)

            setattr(block, name, counted)
    model.activation_checkpointing = True
    loss = model(x, x)[1]
    assert len(calls) == 2 * TINY["n_layer"]
    loss.backward()
    assert len(calls) == 4 * TINY["n_layer"]


# --- scaled_residual -----------------------------------------------------------------------------


def test_scaled_residual_is_bit_identical_to_standard_at_init():
    idx = tokens()
    assert torch.equal(logits_of(make("scaled_residual"), idx), logits_of(make("standard"), idx))


def test_scaled_residual_matches_its_definition():
    model = make("scaled_residual")
    randomize_routing(model)
    lam, mu = model.residual.residual_scale, model.residual.embedding_scale
    idx = tokens()
    with torch.no_grad():
        x = h0 = model.transformer.wte(idx)
        for l, block in enumerate(model.transformer.h):  # x <- lambda_k x + mu_k h_0 + f_k(x), k = 2l, 2l + 1
            h = block.ln_1(x)
            x = lam[2 * l] * x + mu[2 * l] * h0 + block.attn(h, h, h)
            x = lam[2 * l + 1] * x + mu[2 * l + 1] * h0 + block.mlp(block.ln_2(x))
        expected = model.lm_head(model.transformer.ln_f(x))
        assert rel_err(logits_of(model, idx), expected) < 1e-5
        assert rel_err(logits_of(make("standard"), idx), expected) > 1e-3


# --- diagnostics: what every scheme records --------------------------------------------------------


def test_note_computes_nothing_when_not_recording():
    scheme = make("attnres").residual
    scheme.note("attn.1", lambda: pytest.fail("a diagnostic was computed while not recording"))
    scheme.record = {}
    scheme.note("attn.1", lambda: torch.ones(1))
    assert list(scheme.record) == ["attn.1"]


def read_of(name):
    """The read a depth-weights name belongs to: 'attn.2.s1' -> 'attn.2', 'attn_v.2' -> 'attn.2'."""
    kind, *rest = name.split(".")
    return ".".join([kind.replace("attn_v", "attn"), *[r for r in rest if r not in ("s0", "s1")]])


@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_diagnostics_follow_the_naming_rules(variant):
    model = make(variant)
    randomize_routing(model)
    diag = model.routing_diagnostics(tokens())
    assert model.residual.record is None, "routing_diagnostics must switch recording off again"
    reads = {model.residual.name_of(k) for k in range(model.residual.output_read + 1)}
    for name, w in diag["weights"].items():
        assert read_of(name) in reads, (
            f"depth weights {name!r}: name them name_of(k), plus '.s{{stream}}' or "
            f"'attn_v.{{layer}}' for a second route; other quantities 'group/read name'"
        )
        assert abs(w.sum().item() - 1) < 1e-5, f"depth weights {name!r} do not sum to 1"
    for group in set(diag) - {"weights", "entropy", "effective_sources", "qk_v_jsd"}:
        for name in diag[group]:
            assert read_of(name) in reads, f"{group}/{name}: the part after '/' must be a read's name_of(k)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_qk_v_jsd_exactly_where_a_scheme_records_a_value_route(variant):
    diag = make(variant).routing_diagnostics(tokens())
    value_routes = {int(name.split(".")[1]) for name in diag["weights"] if name.startswith("attn_v.")}
    assert set(diag["qk_v_jsd"]) == value_routes, "name a second (value) route's depth weights attn_v.{layer}"
