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
"""

import json
import os
import sys

import records
from common import ConfigError, write_json
from grid_files import TUNE_DIR, rate_name, recorded_choice, stable_choice, tuning_arm, tuning_row

TUNED_KEYS = ("learning_rate", "min_lr")  # what tuning sets in each arm


def iters(cfg):
    """The tuning cells' steps: tune_iters, or by default a quarter of max_iters (rounded up). Each tuning cell
    runs the whole schedule in them (warmup, decay to min_lr at its end), as a run of that length would."""
    return cfg["tune_iters"] or -(-cfg["max_iters"] // 4)


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
        name = tuning_arm(arm, max(rates, key=lambda r: len(rate_name(r))))
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
    return records.ValidationText(val.shard, val.tokenizer, part="tune")


def tuning_record(cfg):
    """Where choice.json says the tuning text lay: 'first', from token eval_tokens on; 'spread', the odd slots."""
    n = cfg["eval_tokens"]
    if cfg["eval_layout"] == "first":
        return dict(first_token=n, tokens=n)
    return dict(layout="spread", sequences="odd", tokens=n)


def choose(cfg, tune_dir, master=True):
    """{arm: learning rate}: per arm, stable_choice over the tuning seeds' final validation losses (on tuning_text).
    The master process prints each arm's choice and reason and writes tune_dir/choice.json: every arm's
    per-seed losses, mean and s.d. per rate, the choice and its reason, and the text it was made on."""
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
        recorded = recorded_choice(tune_dir)
        record = with_recorded_arms(recorded, record)
        check_recorded(os.path.join(tune_dir, "choice.json"), recorded, record)
        # an unchanged choice keeps its file: a newer choice.json would make every rerun write the report again
        if recorded != json.loads(json.dumps(record)):
            write_json(os.path.join(tune_dir, "choice.json"), record)
        for arm in choice:
            print(f"tuned: {arm} at learning_rate {rate_name(choice[arm])} ({reason[arm]})")
    return choice


CHOICE_SETTINGS = (
    "tune_seeds",
    "tune_iters",
    "max_iters",
    "seeds",
    "learning_rates",
    "min_lr_ratio",
    "tuning_text",
    "test_tokens",
)  # what a choice.json was made under; the rest follows from its tuning cells


def with_recorded_arms(recorded, record):
    """record, keeping the arms a choice.json of the same tuning has and this run does not train (a rerun of some
    arms, or one that adds arms, extends the record rather than losing the others' choices)."""
    if not recorded or any(recorded.get(k) != json.loads(json.dumps(record[k])) for k in CHOICE_SETTINGS):
        return record
    if not all(isinstance(recorded.get(k), dict) for k in ("table", "choice", "reason")):
        return record
    return dict(
        record,
        **{
            k: {a: v for a, v in recorded[k].items() if a not in record[k]} | record[k]
            for k in ("table", "choice", "reason")
        },
    )


def check_recorded(path, recorded, record):
    """A choice.json written before is replaced only by what it would be anyway, or by another tuning's (its
    settings changed, --allow_changes; or reasons worded by another version: said in one line); one of the same
    tuning whose table or choice differs was edited or copied, and is refused rather than silently rewritten."""
    if recorded is None or recorded == json.loads(json.dumps(record)):
        return
    if changed := [k for k in CHOICE_SETTINGS if recorded.get(k) != record[k]]:
        print(f"note: {path} rewritten: this tuning's {', '.join(changed)} differ from the recorded one's")
        return
    differ = [
        k for k in sorted(set(recorded) | set(record)) if recorded.get(k) != json.loads(json.dumps(record.get(k)))
    ]
    if differ == ["reason"]:  # the same choice from the same losses, said in another version's words
        print(f"note: {path} rewritten: its reasons in this version's words")
        return
    new = json.loads(json.dumps(record))
    if set(differ) <= {"table", "choice", "reason"} and all(
        isinstance(recorded[k], dict) and all(new[k].get(arm) == value for arm, value in recorded[k].items())
        for k in ("table", "choice", "reason")
    ):  # every recorded arm as it was: arms were added
        added = sorted(set(new["choice"]) - set(recorded["choice"]))
        print(f"note: {path} rewritten: arms {', '.join(added)} added, the recorded arms' choices as they were")
        return
    raise ConfigError(
        f"{path} differs from the choice its tuning cells give (in {', '.join(differ)}): edited by "
        f"hand or copied from another tuning; delete it and rerun the same command to write it again"
    )


def tuned_arms(cfg, choice):
    """The arms of the paired grid: each arm's settings at its chosen learning_rate (and min_lr at the run's ratio)."""
    return {
        arm: dict(settings, learning_rate=choice[arm], min_lr=min_lr_at(cfg, choice[arm]))
        for arm, settings in cfg["arms"].items()
    }
