"""
The field's schemes beside ours (issue #50): postnorm, the LAuReL family (laurel_rw, laurel_lr, laurel),
frac (Frac-Connections), muddformer, delta_attnres and mhar. Each model equals, on the same weights with its routing
parameters random, a plain-loop float64 implementation written here from the paper's equations (one
source, one fraction, one way at a time; no code of model.py's schemes); each is `standard` at init where
the paper's init gives it (postnorm is not, and says so). The generic contract (zero init, gradients,
fp32 stream, compile, MoE, activation checkpointing, warm start, ...) runs over them from the registry
in test_model.py, test_moe.py and test_train.py; two ranks under FSDP2 train them as one process does.
"""

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import train
from helpers import logged, make, randomize_routing, rel_err, tiny, tokens, torchrun
from model import RESIDUALS, LaurelLR
from test_configs import settings_of

ZOO = ["postnorm", "laurel_rw", "laurel_lr", "laurel", "frac", "muddformer", "delta_attnres", "mhar"]


def reference_model(variant, seed=0):
    """The tiny model in float64 with random routing, and the same batch."""
    model = make(variant, seed=seed)
    randomize_routing(model)
    return model.double(), tokens()


def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def sublayer(model, k, x, x_k=None, x_v=None):
    """Sublayer k's output from its input(s): layer k // 2's attention (queries from x, keys from x_k,
    values from x_v; each pre-normed by ln_1) or its MLP (pre-normed by ln_2)."""
    block = model.transformer.h[k // 2]
    if k % 2 == 1:
        return block.mlp(block.ln_2(x))
    x_k, x_v = (x if t is None else t for t in (x_k, x_v))
    return block.attn(block.ln_1(x), block.ln_1(x_k), block.ln_1(x_v))


def head(model, x):
    return model.lm_head(model.transformer.ln_f(x))


# --- postnorm ---------------------------------------------------------------------------------------


def postnorm_reference(model, idx):
    res, eps = model.residual, model.config.norm_eps
    x = model.transformer.wte(idx)
    for k in range(2 * model.config.n_layer):
        x = rms(x + sublayer(model, k, x), res.norm_weight[k], eps)  # the sum normalised, skip included
    return head(model, x)


# --- LAuReL -----------------------------------------------------------------------------------------


def low_rank_skip(res, k, x):
    """B_k A_k x one rank-one term at a time: sum_r B[:, r] <A[r], x>."""
    total = torch.zeros_like(x)
    for r in range(res.down.size(1)):
        total = total + (x * res.down[k, r]).sum(-1, keepdim=True) * res.up[k, :, r]
    return total


def laurel_weights(res, k):
    """(alpha_k, beta_k): free scalars, or in the paper recipes 2 softmax(w_k) written out."""
    if not hasattr(res, "weight_logits"):
        return res.output_weight[k], res.skip_weight[k]
    e = [torch.exp(w) for w in res.weight_logits[k]]
    return 2 * e[0] / (e[0] + e[1]), 2 * e[1] / (e[0] + e[1])


def laurel_reference(model, idx):
    """x <- alpha f(x) + beta x (RW), f(x) + x + B A x (LR), alpha f(x) + beta (x + B A x) (both); the *_paper
    recipes the same with their bounded weights."""
    res, residual = model.residual, model.config.residual.removesuffix("_paper")
    x = model.transformer.wte(idx)
    for k in range(2 * model.config.n_layer):
        out = sublayer(model, k, x)
        skip = x + low_rank_skip(res, k, x) if residual != "laurel_rw" else x
        alpha, beta = laurel_weights(res, k) if residual != "laurel_lr" else (1, 1)
        x = alpha * out + beta * skip
    return head(model, x)


# --- Frac-Connections -------------------------------------------------------------------------------


def frac_reference(model, idx):
    """The stream as m fractions; each weight from one fraction's normalised features, one at a time."""
    res, eps, m = model.residual, model.config.norm_eps, model.residual.FRACTIONS
    H = list(model.transformer.wte(idx).chunk(m, dim=-1))
    for k in range(2 * model.config.n_layer):
        feats = [h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) for h in H]
        s_read, s_mix, s_write = res.dynamic_scale[k]
        read = [
            [res.read_static[k, j, i] + s_read * torch.tanh(feats[j] @ res.read_dynamic[k][:, i]) for i in range(m)]
            for j in range(m)
        ]  # read[j][i] (B, T): fraction j's part of input i
        x = torch.cat([sum(read[j][i].unsqueeze(-1) * H[j] for j in range(m)) for i in range(m)], dim=-1)
        out = sublayer(model, k, x).chunk(m, dim=-1)
        H = [
            sum(
                (res.mix_static[k, j, i] + s_mix * torch.tanh(feats[j] @ res.mix_dynamic[k][:, i])).unsqueeze(-1) * H[j]
                for j in range(m)
            )
            + (res.write_static[k, i] + s_write * torch.tanh(feats[i] @ res.write_dynamic[k])).unsqueeze(-1) * out[i]
            for i in range(m)
        ]
    return head(model, torch.cat(H, dim=-1))


# --- MUDDFormer -------------------------------------------------------------------------------------


def mudd_reference(model, idx):
    """After each layer, each way's aggregation over the layer outputs, one source and one way at a time."""
    res, eps, L = model.residual, model.config.norm_eps, model.config.n_layer
    X = [model.transformer.wte(idx)]
    q = k = v = r = X[0]
    for layer in range(L):
        r = r + sublayer(model, 2 * layer, q, k, v)  # the attention's output joins the residual input
        X.append(r + sublayer(model, 2 * layer + 1, r))
        ways = 4 if layer + 1 < L else 1
        normed = X[-1] / torch.sqrt(X[-1].pow(2).mean(-1, keepdim=True) + eps)
        dynamic = F.gelu(normed @ res.hidden_in[layer]) @ res.hidden_out[layer]  # (B, T, ways * sources)
        inputs = []
        for c in range(ways):
            a = [res.static[layer][c, j] + dynamic[..., c * len(X) + j] for j in range(len(X))]
            inputs.append(sum(a[j].unsqueeze(-1) * X[j] for j in range(len(X))))
        q, k, v, r = inputs if ways == 4 else (None, None, None, inputs[0])
    return head(model, r)


# --- Delta AttnRes ----------------------------------------------------------------------------------


def delta_reference(model, idx):
    """The standard stream; each sublayer's input adds a softmax over the embedding and the outputs so far."""
    res, eps = model.residual, model.config.norm_eps
    x = model.transformer.wte(idx)
    sources = []
    for k in range(2 * model.config.n_layer):
        given = x
        if sources:
            u = res.query[k - 1] * res.key_gain[k - 1]
            logits = torch.stack([(s * u).sum(-1) / torch.sqrt(s.pow(2).mean(-1) + eps) for s in sources], -1)
            a = logits.softmax(-1)
            given = x + sum(a[..., i, None] * s for i, s in enumerate(sources))
        out = sublayer(model, k, given)
        sources = (sources or [x]) + [out]  # the embedding is the first source, once sublayer 0 has run
        x = x + out
    return head(model, x)


def test_delta_attnres_adds_to_the_stream_and_is_not_standard_at_init():
    with torch.no_grad():  # the uniform read adds the sources' mean at init
        assert rel_err(make("delta_attnres")(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0]) > 1e-3
        model = make("delta_attnres").double()
        model.residual.query.zero_()
        model.residual.key_gain.zero_()  # every logit 0: uniform weights, whatever the sources
        assert rel_err(model(tokens(), tokens())[0], delta_reference(model, tokens())) < 1e-10


# --- MHAR -------------------------------------------------------------------------------------------


def mhar_reference(model, idx):
    """Block AttnRes whose reads are one softmax per channel group: group h's logits from its own channels of
    query, key gain and source, the norm over all of a source's channels; its channels mixed by its weights."""
    res, cfg = model.residual, model.config
    H, size, eps = res.HEADS, cfg.attnres_block_size, cfg.norm_eps
    group = cfg.n_embd // H

    def read(sources, k):
        channels = []
        for h in range(H):
            part = slice(h * group, (h + 1) * group)
            u = res.query[k, part] * res.key_gain[k, part]
            logits = [(s[..., part] * u).sum(-1) / torch.sqrt(s.pow(2).mean(-1) + eps) for s in sources]
            a = torch.stack(logits, -1).softmax(-1)
            channels.append(sum(a[..., i, None] * s[..., part] for i, s in enumerate(sources)))
        return torch.cat(channels, -1)

    blocks, partial = [model.transformer.wte(idx)], []  # the sealed blocks; the open block's sum (empty: none yet)
    for k in range(2 * cfg.n_layer):
        out = sublayer(model, k, read(blocks + partial, k))
        partial = [partial[0] + out] if partial else [out]
        if (k + 1) % size == 0:
            blocks, partial = blocks + partial, []
    return head(model, read(blocks + partial, 2 * cfg.n_layer))


@pytest.mark.parametrize("size", [1, 2, 8])  # the peer's default, Full (1); the registry's default, 4, is in ZOO
def test_mhar_matches_its_reference_at_every_block_size(size):
    model = make("mhar", attnres_block_size=size)
    randomize_routing(model)
    model, idx = model.double(), tokens()
    with torch.no_grad():
        assert rel_err(model(idx, idx)[0], mhar_reference(model, idx)) < 1e-10


def test_mhar_of_one_head_is_attnres_and_its_heads_route_apart(monkeypatch):
    mhar, attnres = make("mhar").double(), make("attnres").double()
    randomize_routing(mhar)
    attnres.load_state_dict(mhar.state_dict())
    with torch.no_grad():
        assert rel_err(mhar(tokens(), tokens())[0], attnres(tokens(), tokens())[0]) > 1e-3
        monkeypatch.setattr(type(mhar.residual), "HEADS", 1)
        assert rel_err(mhar(tokens(), tokens())[0], attnres(tokens(), tokens())[0]) < 1e-12


# --- the paper recipes (*_paper) ------------------------------------------------------------------


def mhc_paper_reference(model, idx):
    """The peer's mHC, one stream and one entry at a time: pre, post and res from the flattened streams' RMS
    features, Sinkhorn row-softmax first, then columns and rows with eps, and the sigmoid read-out head."""
    res, eps, n = model.residual, model.config.norm_eps, model.config.hc_streams
    x = model.transformer.wte(idx)
    H = [x] * n

    def features(H):
        flat = torch.cat(H, -1)
        return flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + eps)

    for k in range(2 * model.config.n_layer):
        f = features(H)
        pre = [
            torch.sigmoid(res.scale[k, 0] * (f @ res.phi_pre[k][:, i]) + res.bias_pre[k, i]) + 1e-6 for i in range(n)
        ]
        out = sublayer(model, k, sum(pre[i].unsqueeze(-1) * H[i] for i in range(n)))
        post = [
            2 * torch.sigmoid(res.scale[k, 1] * (f @ res.phi_post[k][:, i]) + res.bias_post[k, i]) for i in range(n)
        ]
        logit = [
            [res.scale[k, 2] * (f @ res.phi_res[k][:, j * n + i]) + res.bias_res[k, j, i] for i in range(n)]
            for j in range(n)
        ]
        m = [
            [torch.exp(logit[j][i]) / sum(torch.exp(logit[j][c]) for c in range(n)) + 1e-6 for i in range(n)]
            for j in range(n)
        ]
        for step in range(
            20
        ):  # the first pass normalises columns only (after the row softmax), the rest rows then columns
            if step:
                m = [[m[j][i] / (sum(m[j]) + 1e-6) for i in range(n)] for j in range(n)]
            m = [[m[j][i] / (sum(m[c][i] for c in range(n)) + 1e-6) for i in range(n)] for j in range(n)]
        H = [sum(m[j][i].unsqueeze(-1) * H[j] for j in range(n)) + post[i].unsqueeze(-1) * out for i in range(n)]
    f = features(H)
    w = [torch.sigmoid(res.head_scale * (f @ res.head_phi[:, i]) + res.head_bias[i]) + 1e-6 for i in range(n)]
    return head(model, sum(w[i].unsqueeze(-1) * H[i] for i in range(n)))


def mudd_paper_reference(model, idx):
    """PrePostDANorm written out: normalised sources, a normed generator input, X^R = X + RMSNorm^post(agg_R), V's
    norm gain (1 + value_gain) after ln_1."""
    res, eps, L = model.residual, model.config.norm_eps, model.config.n_layer
    x = model.transformer.wte(idx)
    S = [rms(x, res.source_norm[0], eps)]
    q = k = v = r = x
    for layer in range(L):
        block = model.transformer.h[layer]
        gain = 1 + res.value_gain[layer - 1] if layer else 1
        r = r + block.attn(block.ln_1(q), block.ln_1(k), block.ln_1(v) * gain)
        X = r + sublayer(model, 2 * layer + 1, r)
        S.append(rms(X, res.source_norm[layer + 1], eps))
        ways = 4 if layer + 1 < L else 1
        dynamic = F.gelu(rms(X, res.generator_norm[layer], eps) @ res.hidden_in[layer]) @ res.hidden_out[layer]
        inputs = []
        for c in range(ways):
            a = [res.static[layer][c, j] + dynamic[..., c * len(S) + j] for j in range(len(S))]
            inputs.append(sum(a[j].unsqueeze(-1) * S[j] for j in range(len(S))))
        R = X + rms(inputs[-1], res.post_norm[layer], eps)
        q, k, v, r = (*inputs[:3], R) if ways == 4 else (None, None, None, R)
    return head(model, r)


PAPER = ["muddformer_paper", "laurel_rw_paper", "laurel_lr_paper", "laurel_paper", "mhc_paper", "delta_attnres_paper"]


REFERENCES = {
    "postnorm": postnorm_reference,
    "laurel_rw": laurel_reference,
    "laurel_lr": laurel_reference,
    "laurel": laurel_reference,
    "frac": frac_reference,
    "muddformer": mudd_reference,
    "delta_attnres": delta_reference,
    "mhar": mhar_reference,
    "muddformer_paper": mudd_paper_reference,
    "laurel_rw_paper": laurel_reference,
    "laurel_lr_paper": laurel_reference,
    "laurel_paper": laurel_reference,
    "mhc_paper": mhc_paper_reference,
    "delta_attnres_paper": delta_reference,
}


@pytest.mark.parametrize("variant", ZOO + PAPER)
def test_matches_its_plain_loop_reference_in_float64(variant):
    model, idx = reference_model(variant)
    with torch.no_grad():
        assert rel_err(model(idx, idx)[0], REFERENCES[variant](model, idx)) < 1e-10


def test_postnorm_is_not_standard_at_init():
    # Post-LN normalises the skip at every sublayer: no init makes it the pre-norm model
    with torch.no_grad():
        assert rel_err(make("postnorm")(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0]) > 1e-2


@pytest.mark.parametrize(
    "variant", ["laurel_rw", "laurel_lr", "laurel", "laurel_rw_paper", "laurel_lr_paper", "laurel_paper"]
)
def test_laurel_is_bit_identical_to_standard_at_init(variant):
    # alpha = beta = 1 and B = 0 are exact: not only close, the same floats
    with torch.no_grad():
        assert torch.equal(make(variant)(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0])


def test_laurel_low_rank_is_of_its_rank():
    model = make("laurel_lr")
    randomize_routing(model)
    res = model.residual
    assert res.down.shape[1:] == (res.RANK, 32) and res.up.shape[1:] == (32, res.RANK)
    assert torch.linalg.matrix_rank(res.up[3] @ res.down[3]).item() == res.RANK


def test_frac_splits_the_stream_into_its_fractions_and_is_standard_at_init():
    model = make("frac")
    assert model.residual.start(torch.ones(2, 3, 32)).H.shape == (2, 3, model.residual.FRACTIONS, 32 // 2)
    with torch.no_grad():
        assert rel_err(model(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0]) < 1e-6


def test_muddformer_is_standard_at_init_and_reads_four_ways():
    model = make("muddformer")
    with torch.no_grad():
        assert rel_err(model(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0]) < 1e-6
    # weights per layer: four ways over the layer outputs so far (embedding first), the last layer one way
    assert [tuple(s.shape) for s in model.residual.static] == [(4, 2), (4, 3), (4, 4), (1, 5)]
    randomize_routing(model)
    seen = []
    for block in model.transformer.h:

        def attention(x_q, x_k, x_v, gain, sublayer=block.attention):
            seen.append((x_q is x_k, x_k is x_v, torch.equal(x_q, x_k), torch.equal(x_k, x_v)))
            return sublayer(x_q, x_k, x_v, gain)

        block.attention = attention
    with torch.no_grad():
        model(tokens())
    assert seen[0] == (True, True, True, True)  # layer 0 reads the embedding alone: one fused projection
    assert all(s == (False, False, False, False) for s in seen[1:])  # later: three inputs, all different


def test_laurel_paper_init_is_column_orthogonal_and_sixteen_times_smaller():
    r, d = LaurelLR.RANK, 32
    down = make("laurel_lr_paper").residual.down
    assert torch.equal((down != 0).sum(1), torch.ones(down.size(0), d, dtype=torch.long))  # one output per channel
    torch.testing.assert_close(down[0] @ down[0].T, torch.eye(r) / r**2)  # orthogonal rows of d/r entries 1/sqrt(rd)
    x = torch.randn(4096, d, generator=torch.Generator().manual_seed(0))
    gain = lambda A: ((x @ A.T).norm(dim=-1) / x.norm(dim=-1)).mean().item()  # |A x| / |x|
    assert gain(down[0]) == pytest.approx(1 / math.sqrt(r * d), rel=0.05)
    assert gain(make("laurel_lr").residual.down[0]) / gain(down[0]) == pytest.approx(r, rel=0.1)


def test_laurel_paper_weights_stay_bounded():
    model = make("laurel_paper")
    randomize_routing(model)
    alpha, beta = (2 * model.residual.weight_logits.softmax(-1)).unbind(-1)
    torch.testing.assert_close(alpha + beta, torch.full_like(alpha, 2.0))
    assert (alpha > 0).all() and (beta > 0).all()


def test_mhc_paper_starts_mixed_not_as_standard():
    with torch.no_grad():  # copies of the pre-norm stream, but for the random projections' terms at a = 0.01
        error = rel_err(make("mhc_paper")(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0])
    assert 1e-5 < error < 1e-2
    model = make("mhc_paper")
    state = model.residual.start(torch.randn(2, 3, 32))
    mix, _ = model.residual.write_weights(state, 1)
    torch.testing.assert_close(mix.sum(-2), torch.ones_like(mix.sum(-2)), atol=1e-5, rtol=0)  # doubly stochastic
    torch.testing.assert_close(mix.sum(-1), torch.ones_like(mix.sum(-1)), atol=1e-5, rtol=0)
    torch.testing.assert_close(mix, torch.full_like(mix, 1 / 4), atol=1e-2, rtol=0)  # near uniform at init


def test_muddformer_paper_starts_qkv_at_the_newest_source_because_all_zero_leaves_q_and_k_dead():
    # the official code starts every way at 0 with both norms on: q = k = 0 make each logit 0 and its
    # gradient with respect to q (or k) k (or q), so the Q and K ways never learn; here they start at the newest
    # source (and the model is `standard` at init: the generic tests)
    from test_model import rows_that_never_learn

    model = make("muddformer_paper")
    with torch.no_grad():
        for static in model.residual.static:
            static.zero_()
    dead = {(name, row) for name, row in rows_that_never_learn(model)}
    layers = model.config.n_layer - 1  # the layers whose next layer reads Q, K and V
    assert {(f"static.{layer}", way) for layer in range(layers) for way in (0, 1)} <= dead
    assert not any(name.startswith("static") and row == 2 for name, row in dead)  # V learns through uniform attention
    assert rows_that_never_learn(make("muddformer_paper")) == []


@pytest.mark.slow
def test_two_ranks_under_fsdp_train_the_zoo_as_one_process_with_moe(shards, tmp_path, monkeypatch):
    # every new scheme through train.py: 2 ranks under FSDP2 (its parameters sharded like any scheme's),
    # MoE layers and activation checkpointing on, against one process: the same losses within fp32 rounding
    import report

    monkeypatch.setattr(report, "main", lambda argv: None)
    args = [
        f"--arms={','.join(ZOO)}",
        "--batch_size=8",
        "--max_iters=4",
        "--eval_interval=2",
        "--n_experts=4",
        "--moe_top_k=2",
        "--activation_checkpointing=True",
    ]
    ranks = torchrun("train.py", tiny(shards, tmp_path / "fsdp", *args, "--fsdp=True"))
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    train.main(tiny(shards, tmp_path / "single", *args))
    for arm in ZOO:
        for key, rtol in (("loss", 1e-5), ("val_loss", 1e-6)):
            ranks, single = (logged(tmp_path / run, arm, key=key) for run in ("fsdp", "single"))
            np.testing.assert_allclose(ranks, single, rtol=rtol, err_msg=f"{arm} {key}")


@pytest.mark.parametrize("path", ["config/leaderboard.py", "config/leaderboard_120m.py"])
def test_the_leaderboards_train_every_registered_scheme_under_the_tuned_protocol(path):
    # (test_configs.py trains every config, these two included, at a tiny size)
    settings = settings_of(path)
    registered = [name for name in RESIDUALS if name != "gated" and not name.endswith("_paper")]  # gated: README's
    assert settings["arms"] == {name: {"residual": name} for name in registered}, (
        f"{path}: list every scheme of model.RESIDUALS at its defaults (not a *_paper recipe), in the registry's order"
    )
    assert {"standard", "scaled_residual"} <= set(settings["arms"])  # both baselines, each paired with every arm
    assert len(settings["seeds"]) >= 6 and not set(settings["seeds"]) & set(settings["tune_seeds"])
    assert len(settings["tune_learning_rates"]) >= 2 and settings["n_layer"] >= 12


def test_the_recipes_leaderboard_runs_each_scheme_at_its_paper_recipe():
    settings, defaults = settings_of("config/leaderboard_recipes.py"), settings_of("config/leaderboard.py")
    expected = {}
    for name in defaults["arms"]:
        recipe = f"{name}_paper" if f"{name}_paper" in RESIDUALS else name
        expected[recipe] = {"residual": recipe}
    assert settings["arms"] == expected
    assert sorted(settings["tune_routing_lr_scales"]) == [0.1, 1.0]
    same = {k: v for k, v in settings.items() if k not in ("arms", "out_dir", "tune_routing_lr_scales")}
    assert same == {k: v for k, v in defaults.items() if k not in ("arms", "out_dir")}
