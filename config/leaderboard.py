# The leaderboard (issue #50), laptop shape: every registered scheme (model.RESIDUALS at its defaults: the
# AttnRes family, HC, mHC, DenseFormer, Post-LN, the LAuReL family, Frac-Connections, MUDDFormer) paired against
# both `standard` and `scaled_residual` (the report pairs every arm with each), under the tuned protocol, once per
# bundled corpus, then side by side. 12 layers x 64 (4 heads), where Block AttnRes (S=4) reads 6 blocks; 600 steps
# of 1,024 byte tokens. Each arm's rate is chosen from 3e-3 and 1e-2 on tuning seeds 1000-1002 at 150 steps
# (every arm chose 3e-3 at 16 x 64 and at 4 x 128 from 1e-3 .. 3e-2: docs/comparisons.md; 1e-3 never won).
# Seeds, from the power analysis of config/calibrate.py's grid (s.d. of the per-seed deltas at 16 x 64, 1,000
# steps; paired t-test, two-sided 0.05, power 0.8): 6 seeds detect 0.004-0.008 nats on Shakespeare and
# 0.011-0.051 on the Python docs, so 0.03 is reached where a delta's s.d. is at most 0.021 (every Shakespeare pair,
# scaled_residual - standard on the docs) and not for Block AttnRes on the docs (0.049-0.051; 13-14 seeds would
# reach 0.03, beyond this budget). On the third corpus of issue #50, 6, 18 and 11 seeds would be needed.
# Traded for the two-hour budget: 12 layers rather than calibrate's 16, 600 steps rather than 1,000, two rates.
# Measured on Shakespeare (docs/comparisons.md, 'The leaderboard's shape'): 600 steps at 12 x 64 is NOT outside the
# plateau-escape regime there (seed 4 of 6 still at 3.14 nats at step 60 and last at the end by 0.04-0.09 nats,
# although the ranking at 10-20% is uncorrelated with the final one), so the grid was not run; raise max_iters first.
# Run the first two
# commands first: `standard` over seeds 0-5 at
# train.py's 3e-3 (min_lr 3e-4); outside the regime its seeds are all well below the ~3.0-nat plateau by step 60
# (10%) and their ranking there does not fix the final one (docs/comparisons.md's table); if not, raise max_iters.
# $ python train.py config/leaderboard.py --arms=standard --tune_learning_rates=[] --out_dir=out/regime_shakespeare
# $ python train.py config/leaderboard.py --arms=standard --tune_learning_rates=[] --out_dir=out/regime_pydoc \
#       --data_dir=data/pydoc_bytes
# $ python launch.py --cluster=local --workers=2 --gpus_per_node=0 config/leaderboard.py  # out/leaderboard_shakespeare
# $ python launch.py --cluster=local --workers=2 --gpus_per_node=0 config/leaderboard.py \
#       --data_dir=data/pydoc_bytes --out_dir=out/leaderboard_pydoc
# $ python report.py out/leaderboard_pydoc --beside=out/leaderboard_shakespeare
# Cost per corpus (estimated, not run): 14 arms x (2 rates x 3 tuning seeds x 150 steps + 6 seeds x 600 steps) =
# 63,000 steps in 168 cells; at 0.14-0.18 s per `standard` step (calibrate's 3-4 minutes per 1,000 steps at 16
# layers beside one other job, x 12/16) and a mean step-time ratio of about 1.35 over the arms (bench.py at 4 x
# 128: 1.20 Block AttnRes, 1.53 DAR), about 1.7-2.1 hours per corpus with two workers on the 2-core CPU, one
# thread each. bench.py at this shape gives each arm's step-time ratio to `standard` for the table.

out_dir = "out/leaderboard_shakespeare"
arms = {
    name: {"residual": name}
    for name in (  # every scheme in model.RESIDUALS (tests/test_configs.py checks it)
        "standard",
        "attnres",
        "rd_attnres",
        "dar",
        "hc",
        "mhc",
        "denseformer",
        "postnorm",
        "laurel_rw",
        "laurel_lr",
        "laurel",
        "frac",
        "muddformer",
        "scaled_residual",
    )
}
seeds = [0, 1, 2, 3, 4, 5]
tune_learning_rates = [3e-3, 1e-2]
tune_seeds = [1000, 1001]
tune_iters = 150
n_layer = 12
n_head = 4
n_embd = 64
max_iters = 600
eval_interval = 60
eval_tokens = 16384  # 127 sequences spread over the validation shard: every held-out document of both corpora
