"""
The tuned protocol: each arm's learning rate chosen on tuning seeds at an early budget, then the
paired grid with every arm at its own chosen rate. Depth-routing reads change the scale of hidden
states, so one rate for every arm can favour one of them (on the default run, Block AttnRes "beats"
standard by 0.22 nats at a shared 1e-2, loses by 0.027 at 3e-3 and ties at 1e-3).

$ python train.py config/tune_shakespeare.py                       # tuning grid, choice, paired grid: one command
$ python train.py --tune_learning_rates=1e-3,3e-3,1e-2 --tune_seeds=1000 --tune_iters=125

train.py calls, with tune_learning_rates set: tuning_config (the tuning grid: one arm <arm>-lr<rate>
per arm and rate, in out_dir/tune, on tune_seeds for tune_iters steps), trains it, then choose (each
arm's rate from the tuning cells' final validation loss, written to out_dir/tune/choice.json) and
tuned_arms (the arms at their chosen rates) for the paired grid. The compared seeds never choose a
rate: tune_seeds and seeds may not overlap. An empty tune_learning_rates is the frozen protocol
(one setting for every arm), the default.
"""

import math
import os
import sys

import records
from common import ConfigError, write_json

TUNE_DIR = "tune"  # the tuning grid's folder inside out_dir (so no arm may be named so)
TUNED_KEYS = ("learning_rate", "min_lr")  # what tuning sets in each arm


def iters(cfg):
    """The tuning cells' steps: tune_iters, or by default a quarter of max_iters (rounded up). Each tuning cell
    runs the whole schedule in them (warmup, decay to min_lr at its end), as a run of that length would."""
    return cfg["tune_iters"] or -(-cfg["max_iters"] // 4)


def rate_name(rate):
    """A rate as it appears in a tuning arm's name and in choice.json: 6 significant digits, no '+' (not in
    an arm name)."""
    return f"{rate:g}".replace("+", "")


def tuning_arm(arm, rate):
    """The tuning grid's arm for an arm at a rate: <arm>-lr<rate> (a rate name holds no 'l', so it splits back)."""
    return f"{arm}-lr{rate_name(rate)}"


def min_lr_at(cfg, rate):
    """min_lr for a tuned rate: the run's ratio min_lr / learning_rate kept, to 12 digits (1e-4, not
    9.999999999999999e-05, in every record), never above the rate."""
    return min(rate, float(f"{rate * cfg['min_lr'] / cfg['learning_rate']:.12g}"))


def check(cfg):
    """One line for each tuning setting that cannot run, before anything trains: the rates, the tuning seeds
    (never a compared seed), the budget, arms that set their own rate, and the tuning arms' names."""
    rates, seeds = cfg["tune_learning_rates"], cfg["tune_seeds"]
    if not all(type(r) in (int, float) and 0 < r <= sys.float_info.max for r in rates):  # not a bool, nan, inf
        raise ConfigError(f"tune_learning_rates={rates!r}: give positive numbers, e.g. --tune_learning_rates=1e-3,3e-3,1e-2")
    names = [rate_name(r) for r in rates]
    if len(set(names)) != len(names):
        raise ConfigError(f"tune_learning_rates={rates!r} repeats a rate (to 6 significant digits, as arm names "
                          f"show them); give distinct rates")
    if not seeds or any(type(s) is not int or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"tune_seeds={seeds!r}: give distinct non-negative integers, e.g. --tune_seeds=1000,1001")
    if shared := sorted(set(seeds) & set(cfg["seeds"])):
        raise ConfigError(f"tune_seeds and seeds share {', '.join(map(str, shared))}: a rate chosen on a compared "
                          f"seed favours its arm on that seed; give tuning seeds apart, e.g. --tune_seeds=1000,1001")
    if type(cfg["tune_iters"]) is not int or cfg["tune_iters"] < 0:
        raise ConfigError(f"tune_iters={cfg['tune_iters']!r}: give a number of steps (0 = a quarter of max_iters)")
    if not cfg["warmup_iters"] < iters(cfg) <= cfg["max_iters"]:
        raise ConfigError(f"tune_iters is {iters(cfg)}: the tuning budget must be above warmup_iters="
                          f"{cfg['warmup_iters']} (a rate is judged after its warmup) and at most max_iters="
                          f"{cfg['max_iters']}; set --tune_iters")
    for arm, settings in cfg["arms"].items():
        if arm == TUNE_DIR:
            raise ConfigError(f"arm {arm!r} would share out_dir/{TUNE_DIR} with the tuning grid; rename the arm")
        if own := [k for k in TUNED_KEYS if k in settings]:
            raise ConfigError(f"arm {arm!r} sets {' and '.join(own)}, which tune_learning_rates chooses for every arm; "
                              f"remove it from the arm, or set --tune_learning_rates=[] for the arms' own rates")
        name = tuning_arm(arm, max(rates, key=lambda r: len(rate_name(r))))
        if len(name) > records.ARM_NAME_MAX:
            raise ConfigError(f"tuning arm {name} is {len(name)} characters, at most {records.ARM_NAME_MAX} (a folder "
                              f"name); shorten arm {arm!r}")


def tuning_config(cfg):
    """The tuning grid's config: out_dir/tune, arm <arm>-lr<rate> for each arm and rate (the arm's settings at
    that learning_rate, min_lr at the run's ratio to it), seeds tune_seeds, max_iters the tuning budget, its
    own report's reference the first arm, no downstream tasks (the choice reads validation loss only) and no
    tuning of its own."""
    check(cfg)
    arms = {tuning_arm(arm, rate): dict(settings, learning_rate=float(rate), min_lr=min_lr_at(cfg, float(rate)))
            for arm, settings in cfg["arms"].items() for rate in cfg["tune_learning_rates"]}
    return dict(cfg, out_dir=os.path.join(cfg["out_dir"], TUNE_DIR), arms=arms, seeds=list(cfg["tune_seeds"]),
                max_iters=iters(cfg), reference_arm="", downstream_bundle="", tune_learning_rates=[], tune_seeds=[],
                tune_iters=0)


def tuning_loss(tune_dir, name, seed, rate, budget):
    """A tuning cell's final validation loss, or None when it diverged; one line when it has no result or
    one of other settings (a copy, a rate or budget not this tuning's)."""
    path = os.path.join(records.cell_dir(tune_dir, name, seed), "result.json")
    if not os.path.exists(path):
        raise ConfigError(f"tuning cell {name}/seed{seed} has no result ({path} missing); run the same command "
                          f"to train it")
    result = records.check_result(records.read_record(path, records.RESULT_REMEDY), path)
    records.check_owner(path, result, name, seed)
    pairing = result.get("pairing") if isinstance(result.get("pairing"), dict) else {}
    own = pairing.get("arm_settings") if isinstance(pairing.get("arm_settings"), dict) else {}  # damaged: not this tuning's
    if own.get("learning_rate") != rate or result["status"] == "finished" and result.get("steps") != budget:
        raise ConfigError(f"{path} is not of this tuning (learning_rate {own.get('learning_rate')!r}, "
                          f"{result.get('steps')!r} steps; this tuning: {rate:g}, {budget} steps); delete "
                          f"{os.path.dirname(path)} to retrain it")
    return result["val_loss"] if result["status"] == "finished" else None


def choose(cfg, tune_dir, master=True):
    """{arm: learning rate}: per arm, the rate with the lowest mean final validation loss over the tuning seeds
    (a rate with a diverged seed never wins; an exact tie goes to the smaller rate, the safer one). The master
    process writes tune_dir/choice.json: every arm's per-seed losses and mean per rate, and the choice."""
    check(cfg)
    rates, seeds, budget = [float(r) for r in cfg["tune_learning_rates"]], cfg["tune_seeds"], iters(cfg)
    table, choice = {}, {}
    for arm in cfg["arms"]:
        table[arm] = {}
        for rate in rates:
            losses = {str(s): tuning_loss(tune_dir, tuning_arm(arm, rate), s, rate, budget) for s in seeds}
            finite = None not in losses.values()
            table[arm][rate_name(rate)] = dict(learning_rate=rate, val_loss=losses,
                                               mean=math.fsum(losses.values()) / len(seeds) if finite else None)
        ranked = sorted((row["mean"], row["learning_rate"]) for row in table[arm].values() if row["mean"] is not None)
        if not ranked:
            raise ConfigError(f"arm {arm!r} diverged at every tuning rate ({', '.join(map(rate_name, rates))}); "
                              f"add smaller rates to tune_learning_rates")
        choice[arm] = ranked[0][1]
    if master:
        write_json(os.path.join(tune_dir, "choice.json"), dict(
            tune_seeds=list(seeds), tune_iters=budget, max_iters=cfg["max_iters"], seeds=list(cfg["seeds"]),
            learning_rates=rates, min_lr_ratio=float(f"{cfg['min_lr'] / cfg['learning_rate']:.12g}"), table=table,
            choice=choice))
    return choice


def tuned_arms(cfg, choice):
    """The arms of the paired grid: each arm's settings at its chosen learning_rate (and min_lr at the run's ratio)."""
    return {arm: dict(settings, learning_rate=choice[arm], min_lr=min_lr_at(cfg, choice[arm]))
            for arm, settings in cfg["arms"].items()}
