# RD-AttnRes's early-budget controls at the 120m proxy: is the gain from decoupling the value
# route, or from extra compute (dup), extra parameters (param), a second route with fixed weights
# (fixed_v), or any second learned route not split by role (mix: Q, K and V read both routes' average)?
# 0.5B tokens per run (a quarter of the full budget), 3 paired seeds; otherwise config/rd_120m.py.
# $ torchrun --standalone --nproc_per_node=8 train.py config/rd_controls_120m.py
import os

exec(open(os.path.join(os.path.dirname(__file__), "rd_120m.py")).read())
out_dir = "out/rd_controls_120m"
arms = {
    "attnres": {"residual": "attnres"},
    "rd_attnres": {"residual": "rd_attnres"},
    "rd_dup": {"residual": "rd_attnres", "rd_control": "dup"},
    "rd_param": {"residual": "rd_attnres", "rd_control": "param"},
    "rd_fixed_v": {"residual": "rd_attnres", "rd_control": "fixed_v"},
    "rd_mix": {"residual": "rd_attnres", "rd_control": "mix"},
}
seeds = [0, 1, 2]
max_iters = 954  # x 2^19 = 0.5B tokens
warmup_iters = 100
