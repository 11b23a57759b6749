# Standard, Block AttnRes and DAR (blocks of 4), all under a sparse mixture-of-experts MLP, on the
# bundled corpus at the default CPU size (4 layers, d=128, 250 steps of 1,024 byte tokens), 2 seeds.
# Every layer's MLP: 8 experts, each token reaches its top 2, no shared expert; experts of width 256
# (4d / 2: the dense MLP's active FLOPs). 2.37M non-embedding parameters, 0.79M active (dense: 0.79M).
# `standard` is the reference arm: each scheme's paired delta is under MoE, as at the paper's 7B.
# $ python train.py config/moe_shakespeare.py
out_dir = "out/moe_shakespeare"
arms = {"standard": {"residual": "standard"}, "attnres": {"residual": "attnres"}, "dar": {"residual": "dar"}}
n_experts = 8
moe_top_k = 2
# a short run: at DeepSeek-V3's 1e-3 the last layer's experts still took 0.00-0.76 of the tokens at step 250
# (standard, seed 0); at 1e-2, 0.12-0.47 (validation 2.188 against 2.177 nats/byte: one seed, noise)
moe_bias_rate = 0.01
