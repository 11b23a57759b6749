"""
The paired statistics of a grid (report.py), and what a grid of n seeds can detect.

Of per-seed deltas (arm - reference): n, wins, mean, sample s.d., 95% CI (t), the two-sided
paired t-test and exact sign-test p-values, and the perplexity change exp(mean delta) - 1. Their
power, sized from the s.d. of the deltas: the smallest true mean delta the paired t-test detects
(two-sided, ALPHA, power POWER) at n seeds, the seeds it needs for a given delta (the noncentral t),
and the smallest p the sign test can reach at n (from 6 seeds it can go below 0.05). Identical deltas have no
p and no interval (t would be x/0). The validation text as a second source of uncertainty: from per-sequence
deltas, the mean's interval over seeds and sequences together (a two-way bootstrap) and each source's share of
its variance.
"""

import itertools
import math
import sys

import numpy as np
from scipy import optimize, stats

ALPHA, POWER = 0.05, 0.8  # the paired tests' two-sided level, and the power a grid is sized for
MAX_SEEDS = 2**30  # the seeds needed to detect an effect are searched no further
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 10_000, 0  # the two-way bootstrap of text_uncertainty
FEW_SEQUENCES = 100  # below this many validation sequences the text's share is estimated from little text
# the fewest seeds at which the two-way bootstrap's 95% interval covers the true mean about 95% of the time, as
# simulated (300 grids of 63 sequences, seeds carrying most of the variance as in the grids measured here: it
# covers 61% at 2 seeds, 75% at 3, 80% at 5, 87% at 8, 89% at 12, 93% at 20; the t interval over seeds and text
# 93-98% at each): below it the report quotes the t interval (tests/test_paired_stats.py re-simulates two sizes)
BOOTSTRAP_CALIBRATED_SEEDS = 20


def paired_statistics(deltas, higher_is_better=False):
    """Statistics of per-seed deltas (arm - reference): a win is a delta below 0 (a loss), or above 0 when
    higher_is_better (an accuracy). Computed on the deltas scaled by a power of two (exact), so a diverging arm's
    deltas near the float limit give finite statistics wherever the true value is a float."""
    d = np.asarray(deltas, dtype=np.float64)
    n = len(d)
    exponent = math.frexp(float(np.abs(d).max()))[1] if n and np.isfinite(d).all() else 0
    u = np.ldexp(d, -exponent)  # |u| < 1: no sum of n of them overflows
    identical = n > 1 and bool(np.all(d == d[0]))
    with np.errstate(over="ignore", invalid="ignore"):  # an infinite delta (a float's limit passed) gives inf or nan
        mean = float(np.ldexp(u.mean(), exponent)) if n else float("nan")
        std = float(np.ldexp(u.std(ddof=1), exponent)) if n > 1 else float("nan")
        if n > 1 and not identical:
            half = stats.t.ppf(0.975, n - 1) * u.std(ddof=1) / math.sqrt(n)
            ci95 = [float(np.ldexp(u.mean() - half, exponent)), float(np.ldexp(u.mean() + half, exponent))]
            p_ttest = float(stats.ttest_1samp(u, 0.0).pvalue)  # t is the same for any scale
        else:  # one seed, or identical deltas (t is x/0 or 0/0): neither a p nor an interval; the report says why
            ci95, p_ttest = [float("nan")] * 2, float("nan")
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    if not higher_is_better:
        wins, losses = losses, wins
    if wins + losses:  # ties dropped
        p_sign = float(stats.binomtest(wins, wins + losses, 0.5).pvalue)
    else:  # all ties: no evidence either way; no seeds: nothing to test
        p_sign = 1.0 if n else float("nan")
    return dict(
        deltas=d.tolist(),
        n=n,
        wins=wins,
        mean=mean,
        std=std,
        ci95=ci95,
        p_ttest=p_ttest,
        p_sign=p_sign,
        identical=identical,
    )


def draw_counts(rng, resamples, k):
    """(resamples, k): how often each of k items is drawn in each of resamples draws of k with replacement (a
    multinomial, counted from uniform draws: 3x faster than numpy's multinomial over many items)."""
    draws = rng.integers(0, k, size=(resamples, k)) + k * np.arange(resamples)[:, None]
    return np.bincount(draws.ravel(), minlength=resamples * k).reshape(resamples, k)


def text_uncertainty(deltas, resamples=BOOTSTRAP_RESAMPLES):
    """The mean delta over seeds and validation text together, from per-sequence deltas (seeds x sequences, arm -
    reference): the variance of the mean split among seeds, text and their interaction by the two-way random-effects
    ANOVA (method of moments: var(mean) = s2_seed / n + s2_text / m + s2_seed_x_text / (n m), a component below 0
    taken as 0), with its 95% interval mean +- t(n - 1) sqrt(var(mean)) (ci95_t: the seeds' degrees of freedom);
    and the 95% interval of a two-way bootstrap that draws seeds and sequences independently, with replacement
    (ci95; the generator seeded with BOOTSTRAP_SEED: the same on every run). The bootstrap draws only from the n
    seeds seen, so at few seeds it is narrower than ci95_t, and than the seeds-only t interval. n, m >= 2. Identical
    deltas everywhere (identical) have neither interval (NaN), nor shares."""
    d = np.asarray(deltas, dtype=np.float64)
    n, m = d.shape
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = np.empty(resamples)
    chunk = max(1, (1 << 22) // m)  # resamples at a time: a (chunk, m) array of at most 4M floats
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        seed_counts, sequence_counts = (draw_counts(rng, b, k) for k in (n, m))  # how often each is drawn
        means[start : start + b] = ((seed_counts @ d) * sequence_counts).sum(1) / (n * m)
    seed_means, sequence_means, mean = d.mean(1), d.mean(0), d.mean()
    interaction = d - seed_means[:, None] - sequence_means[None, :] + mean
    mean_square_seed = m * ((seed_means - mean) ** 2).sum() / (n - 1)
    mean_square_text = n * ((sequence_means - mean) ** 2).sum() / (m - 1)
    mean_square_interaction = (interaction**2).sum() / ((n - 1) * (m - 1))
    variance = dict(
        seeds=max(0.0, mean_square_seed - mean_square_interaction) / m / n,  # each over the mean's n, m
        text=max(0.0, mean_square_text - mean_square_interaction) / n / m,
        seed_x_text=mean_square_interaction / (n * m),
    )
    total = sum(variance.values())
    half = stats.t.ppf(0.975, n - 1) * math.sqrt(total)
    # every delta the same (an arm that computes what the reference does): no variance, and so no interval, rather
    # than one of zero width that would claim the mean exactly
    identical = bool((d == d.flat[0]).all())
    undefined = [float("nan")] * 2
    return dict(
        n=n,
        sequences=m,
        mean=float(mean),
        identical=identical,
        ci95_t=undefined if identical else [float(mean - half), float(mean + half)],
        ci95=undefined if identical else [float(q) for q in np.quantile(means, [0.025, 0.975])],
        bootstrap_sd=float(means.std()),
        resamples=resamples,
        variance={k: float(v) for k, v in variance.items()},
        share={k: float(v / total) if total > 0 else float("nan") for k, v in variance.items()},
    )


def perplexity_change(mean):
    """exp(mean delta) - 1, or inf where that is past a float (a mean delta above ~709 nats: a diverging arm)."""
    return math.expm1(mean) if not mean > math.log(sys.float_info.max) else math.inf


def t_test_power(effect_in_sd, n):
    """Power of the two-sided paired t-test (level ALPHA) over n seeds when the true mean delta is effect_in_sd
    standard deviations of the deltas: P(|T| > critical t) for T noncentral t with n - 1 degrees of freedom."""
    df, critical = n - 1, stats.t.ppf(1 - ALPHA / 2, n - 1)
    noncentrality = min(effect_in_sd * math.sqrt(n), 1e3)  # power is 1.0 past it; scipy's nct turns nan far out
    # the lower tail by symmetry: nct.cdf(-critical) turns nan where it is below 1e-18
    return float(stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality))


def detectable_effect_in_sd(n):
    """The smallest true mean delta, in s.d. of the deltas, that the paired t-test over n seeds detects with power
    POWER."""
    high = 1.0
    while t_test_power(high, n) < POWER:
        high *= 2
    return optimize.brentq(lambda e: t_test_power(e, n) - POWER, 0.0, high)


def seeds_needed(effect_in_sd):
    """The fewest seeds with which the paired t-test detects a true mean delta of effect_in_sd s.d. with power
    POWER, or None past MAX_SEEDS."""
    if t_test_power(effect_in_sd, MAX_SEEDS) < POWER:
        return None
    low, high = 1, MAX_SEEDS  # power grows with n: too few at low (no test at one seed), enough at high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if t_test_power(effect_in_sd, middle) >= POWER else (middle, high)
    return high


def sign_test_min_p(untied):
    """The smallest two-sided p the sign test can give with this many untied seeds (all of them wins)."""
    return min(1.0, 2 * 0.5**untied) if untied else float("nan")


SIGN_TEST_SEEDS = next(k for k in itertools.count(1) if sign_test_min_p(k) < ALPHA)  # 6 at ALPHA = 0.05


def power_analysis(st, effect):
    """What a comparison's n can detect, sized from the s.d. of its deltas (itself an estimate from n seeds): the
    smallest true mean delta the paired t-test detects with power POWER, the seeds it needs to detect a delta of
    size effect, and the smallest p the sign test can reach; notes say what cannot be computed and why."""
    n, std = st["n"], st["std"]
    untied = sum(d != 0 for d in st["deltas"])
    power = dict(
        effect=effect,
        alpha=ALPHA,
        power=POWER,
        std=std,
        detectable_effect=None,
        seeds_needed=None,
        sign_test_min_p=sign_test_min_p(untied),
        notes=[],
    )
    if n < 2:
        power["notes"].append(f"n = {n}: no s.d. of the deltas to size the t-test from")
    elif std == 0:
        power["notes"].append("every seed has the same delta (s.d. 0): power cannot be estimated from it")
    elif not math.isfinite(std):
        power["notes"].append("the deltas' s.d. is past a float: power cannot be estimated from it")
    else:
        power["detectable_effect"] = detectable_effect_in_sd(n) * std
        power["seeds_needed"] = seeds_needed(effect / std)
        if power["seeds_needed"] is None:
            power["notes"].append(f"a delta of {effect:g} nats needs more than {MAX_SEEDS} seeds at this s.d.")
    if untied and untied < SIGN_TEST_SEEDS:
        power["notes"].append(
            f"the sign test cannot reach p < {ALPHA:g} at {untied} seed{'s' * (untied > 1)}"
            f"{' (ties left out)' if untied < n else ''}: its smallest p is "
            f"{power['sign_test_min_p']:.3g}; it needs {SIGN_TEST_SEEDS}"
        )
    return power


def quoted_interval(st):
    """The one 95% interval of an arm's mean delta the report quotes, as (interval, what it is), or (None, why there
    is none): the two-way bootstrap only from BOOTSTRAP_CALIBRATED_SEEDS seeds (below, it draws from too few seeds
    and under-covers), else the t interval over seeds and text, else the seeds-only t interval. st: paired_statistics
    with its text_uncertainty under "text" (or {"unavailable": why})."""
    text = st.get("text") or {}
    if st["n"] < 2:
        return None, f"{st['n']} paired seed{'s' * (st['n'] != 1)}: no interval"
    if st["identical"] or text.get("identical"):
        return None, "every seed has the same delta: no interval"
    if "ci95" in text and text["n"] >= BOOTSTRAP_CALIBRATED_SEEDS:
        return text[
            "ci95"
        ], f"two-way bootstrap over seeds and text, calibrated from {BOOTSTRAP_CALIBRATED_SEEDS} seeds"
    if "ci95_t" in text:
        return text["ci95_t"], "t over seeds and text"
    return st["ci95"], "t over seeds"


def verdict(st):
    """ahead, behind (the quoted interval below or above 0), not detectable at this size, or no paired seed; and the
    interval. The interval alone decides: the seeds' t-test p leaves the text's variance out and may disagree."""
    ci, what = quoted_interval(st)
    if st["n"] == 0:
        return "no paired seed", ci, what
    if ci is None or not ci[1] < 0 and not ci[0] > 0:
        return "not detectable at this size", ci, what
    return ("ahead" if ci[1] < 0 else "behind"), ci, what


def interval_detects(ci, n):
    """The smallest true mean delta whose quoted 95% interval over n seeds excludes 0 with power POWER: the interval's
    standard error (half its width over t's 97.5% point, n - 1 degrees of freedom) times detectable_effect_in_sd(n)
    x sqrt(n), which is power_analysis's detectable_effect for the seeds' t interval; None without an interval."""
    if ci is None or n < 2:
        return None
    return detectable_effect_in_sd(n) * math.sqrt(n) * (ci[1] - ci[0]) / 2 / stats.t.ppf(0.975, n - 1)
