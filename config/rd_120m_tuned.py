# The tuned protocol at the 120m size proxy: standard, scaled_residual (learned residual scalars and an
# embedding skip), Block AttnRes and RD-AttnRes (S=4), each at its own learning rate, chosen from 3e-4, 6e-4 and
# 1.2e-3 (min_lr at 0.1 x the rate) on tuning seeds 1000-1002 at 954 steps (0.5B tokens, the whole schedule in
# them), then paired over seeds 0-4 at 2.0B tokens as in config/rd_120m.py. The tuning seeds are never compared
# seeds, and the rates of one arm share its init and data order per seed, so each arm's rates are compared paired
# (a larger rate wins only on every tuning seed and beyond their spread: docs/protocol.md). 0.5B rather
# than 0.25B tokens: the 250 warmup steps would be half of a 0.25B run (477 steps).
# Cost, model.flops_per_token(1024) x tokens at an assumed 40% MFU of an H100 (989e12 bf16 FLOP/s):
#   FLOP/token: standard 8.5477e8, scaled_residual 8.5477e8, attnres 8.5500e8, rd_attnres 8.5506e8; sum 3.4196e9
#   tuning:   3.4196e9 x 3 rates x 3 seeds x 954 x 2^19 tokens = 1.539e19 FLOP / (0.4 x 989e12) / 3600 = 10.8 H100-hours
#   compared: 3.4196e9 x 5 seeds          x 3815 x 2^19 tokens = 3.420e19 FLOP / (0.4 x 989e12) / 3600 = 24.0 H100-hours
#   56 runs (36 tuning, 20 compared): about 35 H100-hours (the tuning 31% of the grid)
# $ python data/prepare.py --max_tokens=2.1e9
# $ torchrun --standalone --nproc_per_node=8 train.py config/rd_120m_tuned.py   # then out/rd_120m_tuned/report.md
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m.py")).read())
out_dir = "out/rd_120m_tuned"
arms = {
    "standard": {"residual": "standard"},
    "scaled_residual": {"residual": "scaled_residual"},  # the strong baseline: learned residual scalars, embedding skip
    "attnres": {"residual": "attnres"},
    "rd_attnres": {"residual": "rd_attnres"},
}
tune_learning_rates = [3e-4, 6e-4, 1.2e-3]  # a factor of 2 either side of config/rd_120m.py's shared 6e-4
tune_seeds = [1000, 1001, 1002]  # three: a rate must beat the seeds' noise, which one seed cannot show
tune_iters = 954  # x 2^19 = 0.5B tokens
