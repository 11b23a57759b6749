"""paired_stats.py: the paired statistics against textbook values, the power against numeric
integration, Monte Carlo and G*Power's tables, the sign test's floor by enumeration, and finite
statistics near the float limit."""

import itertools
import math

import numpy as np
import pytest

import paired_stats

DELTAS = [-0.03, -0.02, -0.04, 0.01, -0.025]


def t_cdf_df4(t):
    # closed form of Student's t CDF for 4 degrees of freedom (independent of scipy)
    x2 = t * t / (1 + t * t / 4)
    return 0.5 + 3 / 8 * (t / math.sqrt(1 + t * t / 4)) * (1 - x2 / 12)


def test_paired_statistics_against_textbook_values():
    st = paired_stats.paired_statistics(DELTAS)
    mean = -0.021
    std = math.sqrt((0.009**2 + 0.001**2 + 0.019**2 + 0.031**2 + 0.004**2) / 4)
    se = std / math.sqrt(5)
    assert st["n"] == 5 and st["wins"] == 4
    assert st["mean"] == pytest.approx(mean) and st["std"] == pytest.approx(std)
    t = mean / se
    assert st["p_ttest"] == pytest.approx(2 * t_cdf_df4(t), rel=1e-9)
    assert st["ci95"][1] == pytest.approx(mean + 2.776445 * se, rel=1e-6)  # t(0.975, 4) from the tables
    assert st["ci95"][0] == pytest.approx(mean - 2.776445 * se, rel=1e-6)
    assert st["p_sign"] == pytest.approx(2 * (5 + 1) / 32)  # two-sided: P(X >= 4) + P(X <= 1), n = 5
    assert paired_stats.perplexity_change(st["mean"]) == pytest.approx(math.exp(mean) - 1)


def test_sign_test_like_the_paper_and_ties():
    assert paired_stats.paired_statistics([-0.03] * 10)["p_sign"] == pytest.approx(2 / 1024)  # 10/10 wins
    st = paired_stats.paired_statistics([-0.01, 0.0, -0.02])  # a tie counts for neither side
    assert st["wins"] == 2 and st["p_sign"] == pytest.approx(0.5)
    single = paired_stats.paired_statistics([-0.01])
    assert single["n"] == 1 and math.isnan(single["std"]) and math.isnan(single["p_ttest"])
    assert paired_stats.paired_statistics([0.0, 0.0])["p_sign"] == 1.0  # all ties: no evidence either way
    none = paired_stats.paired_statistics([])
    assert none["n"] == 0 and all(math.isnan(none[k]) for k in ("mean", "std", "p_ttest", "p_sign"))
    assert math.isnan(paired_stats.perplexity_change(none["mean"]))


def power_by_integration(effect_in_sd, n):
    """Power of the two-sided paired t-test at level 0.05 from its definition, without the noncentral t: with
    Z normal and V chi-square(df), T = (Z + effect sqrt(n)) / sqrt(V / df), and P(|T| > c) is the mean over V of
    P(Z > c s - nc) + P(Z < -c s - nc), s = sqrt(V / df), integrated against V's density."""
    from scipy import integrate, stats

    df, nc = n - 1, effect_in_sd * math.sqrt(n)
    c = stats.t.ppf(0.975, df)  # the central t's critical value

    def phi(x):  # the standard normal CDF
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def integrand(v):
        density = math.exp((df / 2 - 1) * math.log(v) - v / 2 - df / 2 * math.log(2) - math.lgamma(df / 2))
        s = math.sqrt(v / df)
        return density * (1 - phi(c * s - nc) + phi(-c * s - nc))

    return sum(integrate.quad(integrand, a, b, limit=200)[0] for a, b in ((0, df), (df, math.inf)))


@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
def test_detectable_effect_has_the_power_by_integration(n):
    effect = paired_stats.detectable_effect_in_sd(n)
    assert power_by_integration(effect, n) == pytest.approx(0.8, abs=1e-6)
    assert power_by_integration(0.95 * effect, n) < 0.79  # the smallest such effect, not any


@pytest.mark.parametrize("effect, textbook", [(1.0, 10), (0.5, 34), (2.0, 5), (0.2, 199)])
def test_seeds_needed_against_the_textbook_and_by_integration(effect, textbook):
    # Cohen's d of 1, 0.5, 0.2 needs 10, 34, 199 pairs at alpha 0.05 two-sided, power 0.8 (G*Power's tables)
    n = paired_stats.seeds_needed(effect)
    assert n == textbook
    assert power_by_integration(effect, n) >= 0.8 > power_by_integration(effect, n - 1)


@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
def test_power_at_no_effect_is_the_level_and_either_sign_alike(n):
    # a two-sided test rejects a true null at its level: both tails count (issue #41: one lost gave alpha / 2)
    assert paired_stats.t_test_power(0.0, n) == pytest.approx(paired_stats.ALPHA, rel=1e-9)
    for effect in (0.3, 1.0):
        assert paired_stats.t_test_power(-effect, n) == pytest.approx(paired_stats.t_test_power(effect, n), rel=1e-9)


def test_detectable_effect_by_monte_carlo():
    # 40000 simulated grids of 5 seeds whose true mean delta is the detectable effect: 80% reject at 0.05
    rng = np.random.default_rng(0)
    effect = paired_stats.detectable_effect_in_sd(5)
    d = rng.normal(effect, 1.0, size=(40000, 5))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(5))
    assert np.mean(np.abs(t) > 2.776445) == pytest.approx(0.8, abs=0.01)  # t(0.975, 4) from the tables
    assert paired_stats.seeds_needed(1e-6) is None  # past 2^30 seeds: not searched further


def sign_test_floor_by_enumeration(n):
    """The smallest two-sided sign-test p over every win/loss sequence of n untied seeds, counted outcome by outcome."""
    outcomes = [sum(signs) for signs in itertools.product((0, 1), repeat=n)]  # wins of each of the 2^n sequences
    p = [sum(abs(w - n / 2) >= abs(wins - n / 2) for w in outcomes) / 2**n for wins in outcomes]
    return min(p)


def test_sign_test_floor_by_enumeration():
    for n in range(1, 10):
        assert paired_stats.sign_test_min_p(n) == pytest.approx(sign_test_floor_by_enumeration(n))
        assert paired_stats.paired_statistics([-0.01] * n)["p_sign"] == pytest.approx(paired_stats.sign_test_min_p(n))
    assert paired_stats.SIGN_TEST_SEEDS == 6
    assert sign_test_floor_by_enumeration(5) >= 0.05 > sign_test_floor_by_enumeration(6)


def test_statistics_near_the_float_limit_are_finite_where_the_true_value_is():
    st = paired_stats.paired_statistics([1e308, 1.5e308, 1.7e308])
    scaled = paired_stats.paired_statistics([1.0, 1.5, 1.7])  # every statistic but the ci scales with the deltas
    assert st["mean"] == pytest.approx(1.4e308) and st["std"] == pytest.approx(scaled["std"] * 1e308)
    assert st["p_ttest"] == pytest.approx(scaled["p_ttest"]) and st["ci95"][0] == pytest.approx(
        scaled["ci95"][0] * 1e308
    )
    assert st["ci95"][1] == math.inf  # the true bound, 2.3e308, is no float: null in paired.json
    assert paired_stats.perplexity_change(st["mean"]) == math.inf


def test_identical_deltas_have_no_p_and_no_interval():
    # issue #46: two seeds with the same delta once gave p = 0 and a zero-width interval
    for deltas in ([-0.02, -0.02], [0.0, 0.0, 0.0], [800.0] * 3):
        st = paired_stats.paired_statistics(deltas)
        assert st["identical"] and math.isnan(st["p_ttest"]) and all(math.isnan(c) for c in st["ci95"])
        assert st["mean"] == deltas[0] and st["std"] == 0
    assert paired_stats.paired_statistics([-0.02, -0.02])["p_sign"] == pytest.approx(0.5)  # the sign test still counts
    assert not paired_stats.paired_statistics([-0.02, -0.0200001])["identical"]
    assert not paired_stats.paired_statistics([-0.02])["identical"]  # one seed: no spread to speak of


def exact_bootstrap(d):
    """Every two-way bootstrap resample of d (seeds x sequences), equally likely: the n^n x m^m means."""
    n, m = d.shape
    return np.array(
        [
            d[np.ix_(s, j)].mean()
            for s in itertools.product(range(n), repeat=n)
            for j in itertools.product(range(m), repeat=m)
        ]
    )


def test_text_interval_against_the_enumerated_bootstrap():
    d = np.array([[-0.05, 0.02, -0.01, -0.08], [0.01, -0.03, -0.02, 0.04], [-0.04, -0.06, 0.03, -0.01]])
    exact = exact_bootstrap(d)  # 27 x 256 resamples
    tu = paired_stats.text_uncertainty(d, resamples=20000)
    assert tu["n"] == 3 and tu["sequences"] == 4 and tu["mean"] == pytest.approx(d.mean())
    low, high = tu["ci95"]
    assert 0.015 < np.mean(exact <= low) < 0.035 and 0.015 < np.mean(exact >= high) < 0.035  # the 2.5% tails
    assert tu["bootstrap_sd"] == pytest.approx(exact.std(), rel=0.03)
    assert paired_stats.text_uncertainty(d, resamples=20000) == tu  # a fixed generator: the same interval each run
    # with one sequence's worth of text per seed (every sequence alike), only seeds vary: the seeds-only bootstrap
    seeds_only = paired_stats.text_uncertainty(np.repeat(d[:, :1], 4, axis=1), resamples=20000)
    assert seeds_only["bootstrap_sd"] == pytest.approx(exact_bootstrap(d[:, :1]).std(), rel=0.03)
    assert seeds_only["share"] == dict(seeds=1.0, text=0.0, seed_x_text=0.0)


def test_variance_shares_in_closed_form():
    # additive deltas (seed effect + sequence effect, no interaction): the components are the effects' variances
    seed, text = np.array([0.03, -0.01, 0.05]), np.array([0.2, -0.1, 0.0, 0.4, -0.3])
    tu = paired_stats.text_uncertainty(seed[:, None] + text[None, :], resamples=100)
    parts = dict(seeds=seed.var(ddof=1) / 3, text=text.var(ddof=1) / 5, seed_x_text=0.0)
    assert tu["variance"] == pytest.approx(parts, abs=1e-15)
    assert tu["share"]["text"] == pytest.approx(parts["text"] / (parts["seeds"] + parts["text"]))
    half = 4.302653 * math.sqrt(parts["seeds"] + parts["text"])  # t(0.975, 2) from the tables
    assert tu["ci95_t"] == pytest.approx([tu["mean"] - half, tu["mean"] + half], rel=1e-6)
    # the same seeds with no text effect: the seeds-only t interval of the per-seed deltas
    seeds_only = paired_stats.text_uncertainty(np.repeat(seed[:, None], 5, axis=1), resamples=100)
    assert seeds_only["ci95_t"] == pytest.approx(paired_stats.paired_statistics(seed)["ci95"], rel=1e-12)


@pytest.mark.parametrize("value", [0.0, -0.03])
def test_identical_sequence_deltas_draw_no_zero_width_interval(value):
    # issue #52: every seed and sequence the same delta gave "[+0.0000, +0.0000]" over seeds and text: no variance
    # is no interval, not certainty
    tu = paired_stats.text_uncertainty(np.full((3, 4), value), resamples=10)
    assert tu["identical"] and tu["mean"] == pytest.approx(value)
    assert all(math.isnan(x) for x in tu["ci95"] + tu["ci95_t"]), f"an interval of zero width was drawn: {tu}"
    varied = paired_stats.text_uncertainty(np.array([[0.0, 0.0], [0.0, 0.1]]), resamples=10)
    assert not varied["identical"] and varied["ci95_t"][0] < varied["ci95_t"][1], "one delta apart is variance"


def test_variance_components_by_simulation():
    # deltas drawn from the two-way random-effects model with known components: the estimated variance of the mean
    # is unbiased for the mean's true variance across 2000 simulated grids, and the shares match
    rng = np.random.default_rng(1)
    n, m, sd = 4, 60, dict(seeds=0.02, text=0.1, seed_x_text=0.05)
    grids = (
        rng.normal(0, sd["seeds"], (2000, n, 1))
        + rng.normal(0, sd["text"], (2000, 1, m))
        + rng.normal(0, sd["seed_x_text"], (2000, n, m))
    )
    true = dict(seeds=sd["seeds"] ** 2 / n, text=sd["text"] ** 2 / m, seed_x_text=sd["seed_x_text"] ** 2 / (n * m))
    assert grids.mean((1, 2)).var() == pytest.approx(sum(true.values()), rel=0.08)
    estimated = [paired_stats.text_uncertainty(g, resamples=1)["variance"] for g in grids]
    for k in true:
        assert np.mean([e[k] for e in estimated]) == pytest.approx(true[k], rel=0.1)


def coverage(n, reps, rng, m=63):
    """How often the two-way bootstrap's and the t interval over seeds and text cover a true mean delta of 0, over
    reps simulated grids of n seeds whose variance is mostly the seeds' (as measured on the grids here)."""
    hits = np.zeros(2)
    for _ in range(reps):
        d = rng.normal(0, 0.02, n)[:, None] + rng.normal(0, 0.004, m)[None, :] + rng.normal(0, 0.01, (n, m))
        tu = paired_stats.text_uncertainty(d, resamples=1000)
        hits += [tu["ci95"][0] <= 0 <= tu["ci95"][1], tu["ci95_t"][0] <= 0 <= tu["ci95_t"][1]]
    return hits / reps


def test_the_bootstrap_is_quoted_only_where_it_is_calibrated():
    # issue #50: at 3 seeds the bootstrap covers about 3 times in 4 (it draws from the 3 seeds seen), the t interval
    # about 95%; from BOOTSTRAP_CALIBRATED_SEEDS the bootstrap covers about 95% too
    rng = np.random.default_rng(1)
    bootstrap, t = coverage(3, 200, rng)
    assert bootstrap < 0.85 and t > 0.9, (bootstrap, t)
    bootstrap, t = coverage(paired_stats.BOOTSTRAP_CALIBRATED_SEEDS, 200, rng)
    assert bootstrap > 0.9 and t > 0.9, (bootstrap, t)


def test_the_verdict_reads_the_one_interval_quoted():
    st = dict(
        paired_stats.paired_statistics([-0.03, -0.02, -0.04]),
        text=dict(n=3, ci95_t=[-0.05, -0.01], ci95=[-0.04, -0.02]),
    )
    assert paired_stats.verdict(st) == ("ahead", [-0.05, -0.01], "t over seeds and text")
    st["text"]["ci95_t"] = [-0.05, 0.01]  # the bootstrap still excludes 0, but is not calibrated at 3 seeds
    assert paired_stats.verdict(st)[0] == "not detectable at this size"
    many = dict(
        paired_stats.paired_statistics([0.02] * 19 + [0.03]), text=dict(n=20, ci95_t=[-0.01, 0.05], ci95=[0.01, 0.04])
    )
    assert paired_stats.verdict(many) == (
        "behind",
        [0.01, 0.04],
        "two-way bootstrap over seeds and text, calibrated from 20 seeds",
    )
    assert paired_stats.verdict(dict(paired_stats.paired_statistics([0.1]), text={})) == (
        "not detectable at this size",
        None,
        "1 paired seed: no interval",
    )
    assert (
        paired_stats.verdict(dict(paired_stats.paired_statistics([-0.1, -0.2]), text=dict(unavailable="x")))[2]
        == "t over seeds"
    ), "no per-sequence losses: the seeds' t interval"
