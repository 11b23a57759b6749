# The calibration on two corpora (issue #40): one grid, run once on the bundled Shakespeare corpus and once on the
# second bundled corpus, the CPython documentation this interpreter ships (pydoc_data.topics: the language
# reference, another genre; data/pydoc_bytes, prepared on first use), then reported side by side. The grid is the
# reviewer's check of docs/comparisons.md's depth claims: 16 layers x 64 (4 heads; 0.79M non-embedding parameters),
# 250 steps of 1,024 byte tokens, one rate (3e-3) for every arm, 5 seeds, and a validation set of 127 sequences
# (16,384 tokens, twice the default: the text's share of the uncertainty wants 100 or more, report.py says so below
# that). Both corpora's validation shards hold it (Shakespeare 3 plays; Python's docs 54,072 bytes on 3.11.7).
# $ python train.py config/calibrate.py                                                   # -> out/calibrate_shakespeare
# $ python train.py config/calibrate.py --data_dir=data/pydoc_bytes --out_dir=out/calibrate_pydoc
# $ python report.py out/calibrate_pydoc --beside=out/calibrate_shakespeare    # the two grids side by side
# Cost: 2 x 25 cells of 16 layers; a 250-step cell of this shape took 70-190 s on the busy 2-core CPU (2026-12-01,
# config/tune_deep_shakespeare.py), so about an hour of one core per corpus there. Not yet run in full. At this shape
# and budget the seeds sit on a plateau near 3.0 nats and leave it at seed-dependent times (docs/comparisons.md);
# --n_layer=4 --n_embd=128 gives the default shape, which is outside that regime.
out_dir = "out/calibrate_shakespeare"
arms = {
    "standard": {"residual": "standard"},
    "scaled_residual": {"residual": "scaled_residual"},  # the strong baseline: learned residual scalars, embedding skip
    "attnres": {"residual": "attnres"},
    "rd_attnres": {"residual": "rd_attnres"},
    "dar": {"residual": "dar"},
}
reference_arm = "standard,scaled_residual"  # each arm against both baselines
seeds = [0, 1, 2, 3, 4]
n_layer = 16
n_head = 4
n_embd = 64
eval_tokens = 16_384
