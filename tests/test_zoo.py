"""
The field's schemes beside ours (issue #50): postnorm, the LAuReL family (laurel_rw, laurel_lr, laurel),
frac (Frac-Connections) and muddformer. Each model equals, on the same weights with its routing
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

ZOO = ["postnorm"]


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


REFERENCES = {"postnorm": postnorm_reference}


@pytest.mark.parametrize("variant", ZOO)
def test_matches_its_plain_loop_reference_in_float64(variant):
    model, idx = reference_model(variant)
    with torch.no_grad():
        assert rel_err(model(idx, idx)[0], REFERENCES[variant](model, idx)) < 1e-10


def test_postnorm_is_not_standard_at_init():
    # Post-LN normalises the skip at every sublayer: no init makes it the pre-norm model
    with torch.no_grad():
        assert rel_err(make("postnorm")(tokens(), tokens())[0], make("standard")(tokens(), tokens())[0]) > 1e-2
