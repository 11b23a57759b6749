"""
The tuned protocol: each arm's learning rate chosen on tuning seeds at an early budget, then the
paired grid with every arm at its own chosen rate. Depth-routing reads change the scale of hidden
states, so one rate for every arm can favour one of them (on the default run, Block AttnRes "beats"
standard by 0.22 nats at a shared 1e-2, loses by 0.027 at 3e-3 and ties at 1e-3).

$ python train.py config/tune_shakespeare.py                       # tuning grid, choice, paired grid: one command
$ python train.py --tune_learning_rates=1e-3,3e-3,1e-2 --tune_seeds=1000,1001,1002 --tune_iters=125

train.py calls, with tune_learning_rates set: tuning_config (the tuning grid: one arm <arm>-lr<rate>
per arm and rate, in out_dir/tune, on tune_seeds for tune_iters steps), trains it on tuning_text
(the validation tokens after the reported ones), then choose (each arm's rate by stable_choice from
the tuning cells' final validation losses, printed and written to out_dir/tune/choice.json with
its reason) and tuned_arms (the arms at their chosen rates) for the paired grid. The compared
seeds never choose a rate (tune_seeds and seeds may not overlap), nor does the compared text. An
empty tune_learning_rates is the frozen protocol (one setting for every arm), the default.

tune_routing_lr_scales (e.g. [0.1, 1]) also chooses each routed arm's routing rate: its routing parameters train at
routing_lr_scale x its rate (model.py's optimizer groups), and a scheme's routing may want a rate of its own
(MUDDFormer's depth weights blow up at the shared 1e-2; its authors route at 3e-4). The tuning grid then has, for
each arm with routing parameters, a cell <arm>-rs<scale>-lr<rate> per scale other than 1 and rate. At each scale the
rate is chosen as without it, from that scale's cells; then the scale, each at its own rate, by the same rule over the
routing rates (rate x scale): the smallest that no larger one beats. The arm trains at that scale and its rate (on the
Python docs MUDDFormer was unstable at 1e-2 with its routing at 1x, and best of all its tunings at 1e-2 with it at
0.1x: choosing the rate at 1x first would have missed that). choice.json records both.
"""

import json
import os
import sys

import records
from common import ConfigError, write_json
from grid_files import (
    TUNE_DIR,
    rate_name,
    recorded_choice,
    routing_choice,
    scaled_arm,
    stable_choice,
    tuning_arm,
    tuning_iters,
    tuning_row,
)
from model import RESIDUALS

TUNED_KEYS = ("learning_rate", "min_lr")  # what tuning sets in each arm (routing_lr_scale too, with scales)


def scales(cfg):
    """The routing scales tried besides 1 (today's): tune_routing_lr_scales without 1, sorted."""
    return sorted(float(s) for s in cfg["tune_routing_lr_scales"] if s != 1)


def routed(cfg, settings):
    """Whether an arm has routing parameters for a routing scale to act on. (vocab_size is None before the data is
    read, in launch.py; no scheme's parameter count depends on it.)"""
    config = records.model_config(dict(cfg, vocab_size=cfg["vocab_size"] or 1), settings)
    return RESIDUALS[config.residual].extra_params(config) > 0


def iters(cfg):
    """The tuning cells' steps: tune_iters, or by default a quarter of max_iters (rounded up). Each tuning cell
    runs the whole schedule in them (warmup, decay to min_lr at its end), as a run of that length would."""
    return tuning_iters(cfg["tune_iters"], cfg["max_iters"])


def min_lr_at(cfg, rate):
    """min_lr for a tuned rate: the run's ratio min_lr / learning_rate kept, to 12 digits (1e-4, not
    9.999999999999999e-05, in every record), never above the rate."""
    return min(rate, float(f"{rate * cfg['min_lr'] / cfg['learning_rate']:.12g}"))


def check(cfg):
    """One line for each tuning setting that cannot run, before anything trains: the rates, the tuning seeds
    (never a compared seed), the budget, arms that set their own rate, and the tuning arms' names."""
    rates, seeds = cfg["tune_learning_rates"], cfg["tune_seeds"]
    if not all(type(r) in (int, float) and 0 < r <= sys.float_info.max for r in rates):  # not a bool, nan, inf
        raise ConfigError(
            f"tune_learning_rates={rates!r}: give positive numbers, e.g. --tune_learning_rates=1e-3,3e-3,1e-2"
        )
    names = [rate_name(r) for r in rates]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"tune_learning_rates={rates!r} repeats a rate (to 6 significant digits, as arm names "
            f"show them); give distinct rates"
        )
    if not seeds or any(type(s) is not int or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(
            f"tune_seeds={seeds!r}: give distinct non-negative integers, e.g. --tune_seeds=1000,1001,1002"
        )
    if len(seeds) < 2:  # a rate wins only beyond the spread of its seeds' losses
        raise ConfigError(
            f"tune_seeds={seeds!r}: one tuning seed cannot show the seeds' noise a rate must beat; give "
            f"at least 2, e.g. --tune_seeds=1000,1001,1002"
        )
    if shared := sorted(set(seeds) & set(cfg["seeds"])):
        raise ConfigError(
            f"tune_seeds and seeds share {', '.join(map(str, shared))}: a rate chosen on a compared "
            f"seed favours its arm on that seed; give tuning seeds apart, e.g. --tune_seeds=1000,1001,1002"
        )
    given = cfg["tune_routing_lr_scales"]
    if not all(type(s) in (int, float) and 0 < s <= sys.float_info.max for s in given) or len(
        set(map(rate_name, given))
    ) != len(given):
        raise ConfigError(
            f"tune_routing_lr_scales={given!r}: give distinct positive numbers, e.g. --tune_routing_lr_scales=0.1,1"
        )
    if type(cfg["tune_iters"]) is not int or cfg["tune_iters"] < 0:
        raise ConfigError(f"tune_iters={cfg['tune_iters']!r}: give a number of steps (0 = a quarter of max_iters)")
    if not cfg["warmup_iters"] < iters(cfg) <= cfg["max_iters"]:
        raise ConfigError(
            f"tune_iters is {iters(cfg)}: the tuning budget must be above warmup_iters="
            f"{cfg['warmup_iters']} (a rate is judged after its warmup) and at most max_iters="
            f"{cfg['max_iters']}; set --tune_iters"
        )
    for arm, settings in cfg["arms"].items():
        if arm == TUNE_DIR:
            raise ConfigError(f"arm {arm!r} would share out_dir/{TUNE_DIR} with the tuning grid; rename the arm")
        if own := [k for k in TUNED_KEYS if k in settings]:
            raise ConfigError(
                f"arm {arm!r} sets {' and '.join(own)}, which tune_learning_rates chooses for every arm; "
                f"remove it from the arm, or set --tune_learning_rates=[] for the arms' own rates"
            )
        if scales(cfg) and "routing_lr_scale" in settings:
            raise ConfigError(
                f"arm {arm!r} sets routing_lr_scale, which tune_routing_lr_scales chooses for every routed arm; "
                f"remove it from the arm, or set --tune_routing_lr_scales=[] for the arms' own scales"
            )
        longest = max(scales(cfg), key=lambda s: len(rate_name(s)), default=None)
        name = tuning_arm(
            arm if longest is None else scaled_arm(arm, longest), max(rates, key=lambda r: len(rate_name(r)))
        )
        if len(name) > records.ARM_NAME_MAX:
            raise ConfigError(
                f"tuning arm {name} is {len(name)} characters, at most {records.ARM_NAME_MAX} (a folder "
                f"name); shorten arm {arm!r}"
            )


def tuning_config(cfg):
    """The tuning grid's config: out_dir/tune, arm <arm>-lr<rate> for each arm and rate (the arm's settings at
    that learning_rate, min_lr at the run's ratio to it), seeds tune_seeds, max_iters the tuning budget, its
    own report's reference the first arm, no downstream tasks (the choice reads validation loss only). It keeps
    the tune_* keys, so its config.json records them: a tuning killed and rerun with another rate list is a
    change, refused or recorded (--allow_changes) like any other, and the dropped rates' cells stay named."""
    check(cfg)
    arms = {
        tuning_arm(arm, rate): dict(settings, learning_rate=float(rate), min_lr=min_lr_at(cfg, float(rate)))
        for arm, settings in cfg["arms"].items()
        for rate in cfg["tune_learning_rates"]
    }
    arms |= {
        tuning_arm(scaled_arm(arm, scale), rate): dict(
            settings, learning_rate=float(rate), min_lr=min_lr_at(cfg, float(rate)), routing_lr_scale=scale
        )
        for arm, settings in cfg["arms"].items()
        for scale in scales(cfg)
        if routed(cfg, settings)
        for rate in cfg["tune_learning_rates"]
    }
    return dict(
        cfg,
        out_dir=os.path.join(cfg["out_dir"], TUNE_DIR),
        arms=arms,
        seeds=list(cfg["tune_seeds"]),
        max_iters=iters(cfg),
        reference_arm="",
        downstream_bundle="",
    )


def tuning_text(cfg, val):
    """The tuning cells' validation text (records.ValidationText, part 'tune'): sequences that share no token with
    the ones the paired comparison reports, so a rate is never chosen on the text it is judged on. 'spread': the
    slots between the reported ones; 'first': the eval_tokens tokens right after the reported first eval_tokens."""
    n = cfg["eval_tokens"]
    if cfg["eval_layout"] == "first" and len(val.shard) < 2 * n:
        raise ConfigError(
            f"the tuned protocol chooses rates on the {n:,} validation tokens after the {n:,} it reports "
            f"(eval_tokens), but the validation shard holds {len(val.shard):,}, fewer than {2 * n:,}; set "
            f"--eval_tokens={len(val.shard) // 2} or less, or give a longer validation shard"
        )
    text = records.ValidationText(val.shard, val.tokenizer, part="tune")
    for settings in cfg["arms"].values():  # a shard too short for the tuning sequences: one line, before any cell
        text.starts(n, records.model_config(cfg, settings).block_size, cfg["eval_layout"])
    return text


def tuning_record(cfg):
    """Where choice.json says the tuning text lay: 'first', from token eval_tokens on; 'spread', the odd slots."""
    n = cfg["eval_tokens"]
    if cfg["eval_layout"] == "first":
        return dict(first_token=n, tokens=n)
    return dict(layout="spread", sequences="odd", tokens=n)


def choose(cfg, tune_dir, master=True):
    """{arm: the settings the tuning chose for it}: its learning_rate by stable_choice over the tuning seeds' final
    validation losses (on tuning_text); with tune_routing_lr_scales, a routed arm's routing scale the same way
    (grid_files.routing_choice) and the rate at it, and its routing_lr_scale where that is not 1. The master process
    prints each arm's choice and reason and writes tune_dir/choice.json: every arm's per-seed losses, mean and s.d.
    per rate, the choice and its reason, and the text it was made on (routing_table, routing_choice and
    routing_reason with scales)."""
    check(cfg)
    rates, seeds, budget = sorted(float(r) for r in cfg["tune_learning_rates"]), cfg["tune_seeds"], iters(cfg)
    table = {
        arm: {rate_name(rate): tuning_row(tune_dir, arm, rate, seeds, budget) for rate in rates} for arm in cfg["arms"]
    }
    choice, reason = {}, {}
    for arm, rows in table.items():
        choice[arm], reason[arm] = stable_choice(list(rows.values()))
        if choice[arm] is None:
            raise ConfigError(f"arm {arm!r}: {reason[arm]}; add smaller rates to tune_learning_rates")
    own = dict(choice)  # each arm's rate with its routing at 1x, which its reason is about
    routing_table, routing_scale, routing_reason = {}, {}, {}
    for arm, settings in cfg["arms"].items():
        if scales(cfg) and routed(cfg, settings):  # a routed arm trains at its chosen routing scale's own rate
            found = routing_choice(tune_dir, arm, table[arm], scales(cfg), seeds, budget)
            routing_table[arm], routing_scale[arm], routing_reason[arm], choice[arm] = found
    if master:
        n = cfg["eval_tokens"]
        record = dict(
            tune_seeds=list(seeds),
            tune_iters=budget,
            max_iters=cfg["max_iters"],
            seeds=list(cfg["seeds"]),
            learning_rates=rates,
            min_lr_ratio=float(f"{cfg['min_lr'] / cfg['learning_rate']:.12g}"),
            tuning_text=tuning_record(cfg),
            test_tokens=n,
            table=table,
            choice=choice,
            reason=reason,
        )
        if scales(cfg):
            record |= dict(
                routing_scales=scales(cfg),
                routing_table=routing_table,
                routing_choice=routing_scale,
                routing_reason=routing_reason,
            )
        recorded = recorded_choice(tune_dir)
        record = with_recorded_arms(recorded, record)
        check_recorded(os.path.join(tune_dir, "choice.json"), recorded, record)
        # an unchanged choice keeps its file: a newer choice.json would make every rerun write the report again
        if recorded != json.loads(json.dumps(record)):
            write_json(os.path.join(tune_dir, "choice.json"), record)
        for arm in choice:
            scale = routing_scale.get(arm)
            also = f", routing_lr_scale {rate_name(scale)} ({routing_reason[arm]})" if scale else ""
            why = reason[arm] if own[arm] == choice[arm] else f"at routing x1 {rate_name(own[arm])}: {reason[arm]}"
            print(f"tuned: {arm} at learning_rate {rate_name(choice[arm])} ({why}){also}")
    return {
        arm: dict(learning_rate=rate)
        | ({"routing_lr_scale": routing_scale[arm]} if routing_scale.get(arm, 1) != 1 else {})
        for arm, rate in choice.items()
    }


CHOICE_SETTINGS = (
    "tune_seeds",
    "tune_iters",
    "max_iters",
    "seeds",
    "learning_rates",
    "min_lr_ratio",
    "tuning_text",
    "test_tokens",
    "routing_scales",
)  # what a choice.json was made under; the rest follows from its tuning cells
PER_ARM = ("table", "choice", "reason", "routing_table", "routing_choice", "routing_reason")


def with_recorded_arms(recorded, record):
    """record, keeping the arms and compared seeds a choice.json of the same tuning has and this run does not train
    (a rerun of some arms or seeds, or one that adds arms, extends the record rather than losing the others'
    choices). The compared seeds never choose anything: a run of fewer is the same tuning."""
    same = [k for k in CHOICE_SETTINGS if k != "seeds"]
    if not recorded or any(recorded.get(k) != json.loads(json.dumps(record.get(k))) for k in same):
        return record
    if not all(isinstance(recorded.get(k), dict) for k in PER_ARM if k in record) or not isinstance(
        recorded.get("seeds"), list
    ):
        return record
    return dict(
        record,
        seeds=recorded["seeds"] + [s for s in record["seeds"] if s not in recorded["seeds"]],
        **{k: {a: v for a, v in recorded[k].items() if a not in record[k]} | record[k] for k in PER_ARM if k in record},
    )


def check_recorded(path, recorded, record):
    """A choice.json written before is replaced only by what it would be anyway, or by another tuning's (its
    settings changed, --allow_changes; or reasons worded by another version: said in one line); one of the same
    tuning whose table or choice differs was edited or copied, and is refused rather than silently rewritten."""
    new = json.loads(json.dumps(record))
    if recorded is None or recorded == new:
        return
    if changed := [k for k in CHOICE_SETTINGS if k != "seeds" and recorded.get(k) != new.get(k)]:
        print(f"note: {path} rewritten: this tuning's {', '.join(changed)} differ from the recorded one's")
        return
    differ = [k for k in sorted(set(recorded) | set(new)) if recorded.get(k) != new.get(k)]
    if set(differ) <= {"reason", "routing_reason"}:  # the same choice from the same losses, in another version's words
        print(f"note: {path} rewritten: its reasons in this version's words")
        return
    per_arm = [k for k in PER_ARM if k in new]
    if set(differ) <= set(per_arm) | {"seeds"} and all(
        isinstance(recorded.get(k), dict) and all(new[k].get(arm) == value for arm, value in recorded[k].items())
        for k in per_arm
    ):  # every recorded arm as it was: arms or compared seeds were added
        added = sorted(set(new["choice"]) - set(recorded["choice"]))
        seeds = [s for s in new["seeds"] if s not in recorded["seeds"]]
        what = [f"arms {', '.join(added)}"] * bool(added) + [f"seeds {', '.join(map(str, seeds))}"] * bool(seeds)
        print(f"note: {path} rewritten: {' and '.join(what)} added, the recorded arms' choices as they were")
        return
    raise ConfigError(
        f"{path} differs from the choice its tuning cells give (in {', '.join(differ)}): edited by "
        f"hand or copied from another tuning; delete it and rerun the same command to write it again"
    )


def tuned_arms(cfg, chosen):
    """The arms of the paired grid: each arm's settings with what choose chose for it over them (its learning_rate,
    and its routing_lr_scale where one other than 1 was chosen), and min_lr at the run's ratio to that rate."""
    arms = {}
    for arm, settings in cfg["arms"].items():
        rate = chosen[arm]["learning_rate"]
        arms[arm] = dict(settings, learning_rate=rate, min_lr=min_lr_at(cfg, rate)) | chosen[arm]
    return arms
