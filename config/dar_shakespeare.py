# DAR against standard, scaled_residual and Block AttnRes on the bundled corpus at the default CPU
# size (4 layers, d=128, 250 steps of 1,024 byte tokens), 2 seeds: DAR per sublayer (the abstract's form) and in
# blocks of 4 (its "variant to control overhead"). Then `python analyze.py out/dar_shakespeare/dar/seed0`.
# $ python train.py config/dar_shakespeare.py
out_dir = "out/dar_shakespeare"
arms = {
    "standard": {"residual": "standard"},
    "scaled_residual": {"residual": "scaled_residual"},  # the strong baseline: learned residual scalars, embedding skip
    "attnres": {"residual": "attnres"},
    "dar_full": {"residual": "dar", "attnres_block_size": 1},
    "dar": {"residual": "dar"},
}
