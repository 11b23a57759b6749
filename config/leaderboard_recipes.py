# The leaderboard at each scheme's paper recipe (issue #65): config/leaderboard.py's shape, seeds, rates and
# tuning, with every scheme that has a registered paper recipe at it (model.RESIDUALS' *_paper: MUDDFormer's
# PrePostDANorm, LAuReL's bounded weights and column-orthogonal A, mHC's random projections and read-out head,
# Delta AttnRes's zero queries; docs/variants.md, "Paper recipes") and each routed arm's routing rate tuned too:
# routing_lr_scale 0.1 or 1 at its chosen rate (tune.py). The other schemes as in config/leaderboard.py.
# Run compiled (--compile=True), MUDDFormer at its default beside its recipe: every arm on both corpora
# (docs/leaderboard.md, "Compiled, the routing rate tuned"). Its "Paper recipes" rows are config/leaderboard.py
# with the recipes added, eager, at routing rate 1x (out/leaderboard_recipes_shakespeare).
# $ python launch.py --cluster=local --workers=2 --gpus_per_node=0 config/leaderboard_recipes.py
# $ python dev/leaderboard.py --add=muddformer_paper out/leaderboard_shakespeare   # one scheme beside a stored grid
import os

exec(open(os.path.join(os.path.dirname(__file__), "leaderboard.py")).read())

out_dir = "out/leaderboard_recipes_routing_shakespeare"
_recipes = ("muddformer", "laurel_rw", "laurel_lr", "laurel", "mhc", "delta_attnres")  # those with a *_paper
arms = {(f"{n}_paper" if n in _recipes else n): {"residual": f"{n}_paper" if n in _recipes else n} for n in arms}  # noqa: F821 (arms: config/leaderboard.py's)
tune_routing_lr_scales = [0.1, 1.0]
