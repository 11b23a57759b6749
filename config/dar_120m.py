# DAR (two-stream reciprocal depth routing, block form) against standard, scaled_residual (learned
# residual scalars and an embedding skip) and Block AttnRes at the 120m size proxy; the paired protocol
# of config/rd_120m.py (5 seeds, 2.0B tokens, 2^19 tokens/step).
# DAR per sublayer (the abstract's form), own keys, and HC/mHC with 2 streams: config/dar_ablations_120m.py.
# $ torchrun --standalone --nproc_per_node=8 train.py config/dar_120m.py
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m.py")).read())
out_dir = "out/dar_120m"
arms = {
    "standard": {"residual": "standard"},
    "scaled_residual": {"residual": "scaled_residual"},  # the strong baseline: learned residual scalars, embedding skip
    "attnres": {"residual": "attnres"},
    "dar": {"residual": "dar"},
}
