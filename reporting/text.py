"""The report's words: numbers, text from files as inert markdown or plot text, file names, and its tables."""

import hashlib
import json
import math
import os
import re
import unicodedata

undefined = lambda x: x is None or isinstance(x, float) and math.isnan(x)
plural = lambda word, n: word + "s" * (n != 1)
seed_list = lambda seeds: ", ".join(map(str, seeds))
rate_list = lambda rates: ", ".join(f"{rate:g}" for rate in rates)
cell_name = lambda arm, seed: f"{arm}/seed{seed}"  # as the report names a cell and paired.json keys it: its folder
# values, each once (once as JSON: a dict in any key order), in order of first appearance
distinct = lambda values: list({json.dumps(v, sort_keys=True): v for v in values}.values())


def fmt(x, spec="+.4f"):
    """x by spec, a fixed-point one as exponent past 1e6 (a diverging loss: 300 digits); None, NaN: "undefined"."""
    if undefined(x):
        return "undefined"
    return format(x, spec[:-1] + "e" if spec.endswith("f") and abs(x) >= 1e6 else spec)


MARKUP = re.compile(r"[\\`*\[\]<>|#&~$]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")  # an inner_word's _ is no markup
BLOCK_START = re.compile(r"^([0-9]{0,9})([-+=.)])")  # a list marker ("-", "1.") where text begins a list item


def visible(text):
    """text with control characters and lone surrogates (a non-UTF-8 folder name) escaped: one line any font takes."""
    return "".join(
        c.encode("unicode_escape").decode() if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") else c
        for c in str(text)
    )


def md(text):
    """Text from a file or a folder name as inert markdown: markup escaped, control characters visible (a reason or
    a folder name would otherwise forge lines, table cells or links)."""
    return visible(BLOCK_START.sub(r"\1\\\2", MARKUP.sub(lambda m: "\\" + m[0], str(text))))


# text from a file or a folder name for a plot: visible, and its $ literal (matplotlib reads $...$ as math)
plot_text = lambda text: visible(text).replace("$", r"\$")


def file_stem(name):
    """A file name part for an arm or a cell: the name itself when short and plain, else its plain first characters
    and a hash of the whole (a 250-character arm name would make a file name past the file system's limit)."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        return name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name[:40]) + "-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:12]


def strict(x):
    """x with every non-finite float as None: paired.json is strict JSON (an arm with one seed has no std)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    return x


# head (unless None) and lines, each followed by a blank line; [] without lines; bullets: the items as a list
block = lambda head, lines: ([head, ""] if head else []) + lines + [""] if lines else []
bullets = lambda head, items: block(head, [f"- {item}" for item in items])
# a 95% interval as a table cell: [low, high], or undefined where either end is (no seeds to draw it from)
interval = lambda ci: "undefined" if any(map(undefined, ci)) else f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def arm_notes(head, by_arm, notes):
    """bullets() of 'arm: note' for each note(c) of each arm's c in by_arm (notes already markdown)."""
    return bullets(head, [f"{md(arm)}: {note}" for arm, c in by_arm.items() for note in notes(c)])


def left_out_lines(head, by_arm):
    """bullets() of the seeds each arm's comparison in by_arm left out (its left_out: seed and reason)."""
    left_out = [(arm, d) for arm, c in by_arm.items() for d in c["left_out"]]
    return bullets(head, [f"{md(arm)}, seed {d['seed']}: {md(d['reason'])}" for arm, d in left_out])


def table(head, rows):
    """A markdown table: head, then rows of markdown cells but each row's first (an arm, a task: file text), escaped."""
    line = lambda cells: "| " + " | ".join(cells) + " |"
    return [line(head), "|---" * len(head) + "|", *(line([md(name), *cells]) for name, *cells in rows)]


def cell_table(arms, seeds, value, after=()):
    """A table of one value per cell (value(arm, seed), already text), then the (header, cell(arm)) columns after."""
    head = ["arm", *(f"seed {s}" for s in seeds), *(h for h, _ in after)]
    return table(head, ([arm, *(value(arm, s) for s in seeds), *(cell(arm) for _, cell in after)] for arm in arms))


def why_undefined(st):
    """Why some of paired_statistics' st is undefined (no paired seed, one, or every seed the same delta), or None."""
    if st["n"] == 0:
        return "no paired seed: its mean, s.d., interval and p-values are undefined (see the seeds left out)"
    if st["n"] == 1:
        return (
            "1 paired seed: no s.d., so the t-test's p and interval are undefined; a sign test of one seed "
            "cannot go below p = 1"
        )
    if st["identical"]:
        return (
            f"every seed has the same delta ({fmt(st['mean'])}): the t-test's p and interval are undefined "
            f"(s.d. 0), not p = 0; the sign test still counts"
        )


def statistics_table(first, mean, rows, name=lambda row: row, before=(), after=()):
    """A table of paired_statistics ({row: st}), the mean's column named mean, between the (header, cell(st)) columns
    before and after; then why what is undefined is (the t-test's interval and p where there is none: NaN)."""
    columns = [
        *before,
        ("n", lambda st: str(st["n"])),
        ("wins", lambda st: f"{st['wins']}/{st['n']}"),
        (mean, lambda st: fmt(st["mean"])),
        ("std", lambda st: fmt(st["std"], ".4f")),
        ("95% CI", lambda st: interval(st["ci95"])),
        ("p (t-test)", lambda st: fmt(st["p_ttest"], ".3g")),
        ("p (sign)", lambda st: fmt(st["p_sign"], ".3g")),
        *after,
    ]
    cells = [[row, *(cell(st) for _, cell in columns)] for row, st in rows.items()]
    why = [f"{md(name(row))}: {reason}" for row, st in rows.items() if (reason := why_undefined(st))]
    return table([first, *(h for h, _ in columns)], cells) + [""] + bullets(None, why)


def seed_groups(seeds, value, said=str):
    """The seeds grouped by value(seed) as 'seeds 0, 1: said(value); seed 2: ...', or None where one value is all's."""
    groups = {}
    for s in seeds:
        groups.setdefault(value(s), []).append(s)
    if len(groups) > 1:
        return "; ".join(f"{plural('seed', len(g))} {seed_list(g)}: {said(v)}" for v, g in groups.items())


def per_seed(label, seeds, deltas):
    """label: seed s: delta, ... (or none)"""
    return f"{label}: " + (", ".join(f"seed {s}: {fmt(d)}" for s, d in zip(seeds, deltas)) or "none")
