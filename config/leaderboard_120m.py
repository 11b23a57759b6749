# The leaderboard (issue #50) at the 120m size proxy (12 layers, d=768, 12 heads, context 1024, FineWeb-Edu GPT-2
# tokens; config/rd_120m.py's shape, data and schedule) for one node of 8 GPUs: every registered scheme
# (model.RESIDUALS at its defaults) paired against both `standard` and `scaled_residual`, under the tuned protocol
# of config/rd_120m_tuned.py: each arm's rate chosen from 3e-4, 6e-4 and 1.2e-3 on tuning seeds 1000-1002 at 954
# steps (0.5B tokens), then 6 compared seeds at 3,815 steps (2.0B tokens, 2^19 tokens per step). 6 seeds as the
# laptop leaderboard (config/leaderboard.py); the seeds' noise at this size is not measured yet, so the report's
# detectable effect, not this comment, says what the grid can separate.
# Cost, model.flops_per_token(1024) x tokens at an assumed 40% MFU of an H100 (989e12 bf16 FLOP/s):
#   FLOP/token: 8.548e8 (standard, scaled_residual, laurel_rw, denseformer) to 8.654e8 (mhc, 4 streams);
#               laurel_lr, laurel 8.583e8; muddformer 8.563e8; delta_attnres, mhar 8.550e8; the 16 arms sum to
#               1.3698e10
#   tuning:   1.3698e10 x 3 rates x 3 seeds x 954 x 2^19 tokens = 6.17e19 FLOP / (0.4 x 989e12) / 3600 = 43 H100-hours
#   compared: 1.3698e10 x 6 seeds          x 3815 x 2^19 tokens = 1.64e20 FLOP / (0.4 x 989e12) / 3600 = 115 H100-hours
#   240 runs (144 tuning, 96 compared): about 159 H100-hours, 19.8 hours on one node of 8. FLOPs only: the schemes'
#   memory-bound mixing is not in them (the peer measured throughput vs pre-norm of 0.78x for Frac, 0.74x
#   MUDDFormer, 0.49x mHC), so expect 20-40% more wall time; bench.py at this shape measures each arm's ratio.
# $ python data/prepare.py --max_tokens=2.1e9
# $ torchrun --standalone --nproc_per_node=8 train.py config/leaderboard_120m.py   # then out/leaderboard_120m/report.md
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m_tuned.py")).read())  # shape, data, schedule, tuning

out_dir = "out/leaderboard_120m"
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
        "delta_attnres",
        "mhar",
        "scaled_residual",
    )
}
seeds = [0, 1, 2, 3, 4, 5]
