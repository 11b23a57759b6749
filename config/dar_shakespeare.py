# DAR against standard and Block AttnRes on the bundled corpus: the default CPU-sized run
# (4 layers, d=128, 200 steps of 1,024 tokens), 2 seeds.
# $ python train.py config/dar_shakespeare.py
out_dir = "out/dar_shakespeare"
arms = {
    "standard": {"residual": "standard"},
    "attnres": {"residual": "attnres"},
    "dar": {"residual": "dar"},
}
