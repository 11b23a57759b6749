# The depth claim, checked on two corpora outside the plateau-escape regime (issue #40): one grid, run once on the
# bundled Shakespeare corpus and once on the second bundled corpus, the CPython documentation this interpreter ships
# (pydoc_data.topics: the language reference, another genre; data/pydoc_bytes, prepared on first use), then
# reported side by side. The shape is config/tune_deep_shakespeare.py's, 16 layers x 64 (4 heads; 0.79M
# non-embedding parameters), where Block AttnRes (S=4) reads 8 blocks, but at 1,000 steps of 1,024 byte tokens
# instead of 250: at 250 steps the seeds sit near 3.0 nats for the first fifth of the budget and a grid there
# measures when each escapes; at 1,000 `standard`'s seeds on Shakespeare are all below 2.67 by step 100 and their
# ranking at step 200 does not fix the final one (Spearman +0.7, -0.2 at step 250; docs/comparisons.md). One rate
# (3e-3, the rate every arm chose at this shape at 250 steps and at 4 x 128) for the three arms of the claim: plain
# pre-norm, the strong learned-scalar baseline, Block AttnRes.
# $ python train.py config/calibrate.py                                                   # -> out/calibrate_shakespeare
# $ python train.py config/calibrate.py --data_dir=data/pydoc_bytes --out_dir=out/calibrate_pydoc
# $ python report.py out/calibrate_pydoc --beside=out/calibrate_shakespeare    # the two grids side by side
# Cost: 2 x 15 cells of 1,000 steps, 3-4 minutes a `standard` cell beside one other job; 7-14 minutes a cell
# beside three (Block AttnRes 10-14) (2026-12-02, one thread per process). Measured on seeds 0-2 of both corpora
# (--seeds=0,1,2): docs/comparisons.md.
out_dir = "out/calibrate_shakespeare"
arms = {
    "standard": {"residual": "standard"},
    "scaled_residual": {"residual": "scaled_residual"},  # the strong baseline: learned residual scalars, embedding skip
    "attnres": {"residual": "attnres"},
}
seeds = [0, 1, 2, 3, 4]
n_layer = 16
n_head = 4
n_embd = 64
max_iters = 1000
eval_interval = 50
