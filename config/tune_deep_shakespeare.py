# The tuned protocol at 4x the default run's depth and the same parameters: 16 layers x 64 (4 heads; 0.79M
# non-embedding parameters, as 4 x 128), where Block AttnRes (S=4) reads 8 blocks instead of 2 - the papers' claim
# is that depth routing matters more as depth grows. Otherwise as config/tune_shakespeare.py: 250 steps of 1,024
# byte tokens on the bundled Shakespeare corpus, each arm's rate chosen from 1e-3 to 3e-2 (a factor of about 3
# apart; a narrower model may want a higher rate) on tuning seeds 1000-1002 at 125 steps, then paired over seeds
# 0-4. Cost: 5 arms x (4 rates x 3 seeds x 125 steps + 5 seeds x 250 steps) = 13,750 steps of 16 layers: 85 cells,
# about 110 minutes wall for two workers sharing the grid beside other grids on the 2-core CPU (2026-12-02, one
# thread per process; a 250-step cell 110-216 s for the AttnRes family, 65-132 s for the baselines).
# Measured under this protocol (2026-12-02, --eval_tokens=16384; docs/comparisons.md): every arm chose 3e-3 (DAR's
# lowest mean, 1e-2, is worse on one tuning seed); every AttnRes-family arm ahead of standard on 5/5 seeds by
# 0.07-0.08 nats and of scaled_residual on 4/5 by 0.03-0.04 (n.s.); RD-AttnRes and DAR tie Block AttnRes. At this
# budget a seed's ranking at step 50 nearly fixes its final one (a plateau near 3.0 nats): config/calibrate.py
# checks the depth claim at 1,000 steps, outside that regime.
# $ python train.py config/tune_deep_shakespeare.py      # then out/tune_deep_shakespeare/report.md
import os

exec(open(os.path.join(os.path.dirname(__file__), "tune_shakespeare.py")).read())  # its arms, seeds and tuning seeds
out_dir = "out/tune_deep_shakespeare"
n_layer = 16
n_head = 4
n_embd = 64
tune_learning_rates = [1e-3, 3e-3, 1e-2, 3e-2]
