"""The report's PNG plots, with matplotlib when it is installed (the tables never need it): validation loss (with the
second half of training zoomed in), the paired delta during training, the QK/V divergence of arms with a value route,
and one cell's depth weights (--cell). Plot names of long arm names are shortened with a hash."""

import os

import numpy as np

from common import write_atomic
from reporting.paired import loss_curves
from reporting.text import file_stem, md, plot_text

jsd_name = lambda arm: f"jsd_{file_stem(arm)}.png"
routing_name = lambda cell: f"routing_{file_stem(f'{cell[0]}_seed{cell[1]}')}.png"


def plots(out_dir, arms, comparisons, logs, cell):
    """PNG figures, or [] without matplotlib. Returns (title, file name) pairs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    figures = []

    def save(fig, name, title):
        fig.tight_layout()
        try:
            write_atomic(os.path.join(out_dir, name), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
        finally:
            plt.close(fig)
        figures.append((title, name))

    # validation loss against tokens over each arm's paired seeds: all of training, and its second half zoomed in
    # (the early drop from ln(vocab) would otherwise squash the arms into one line)
    paired_seeds = next(iter(comparisons.values()))["paired_seeds"]  # each arm's seeds paired with the first reference
    val = {arm: loss_curves(logs, arm, paired_seeds[arm]) for arm in arms}
    val = {arm: (t, v) for arm, (t, v) in val.items() if len(t)}
    if val:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        half = max(t[-1] for t, _ in val.values()) / 2
        for ax, title in zip(axes, ("validation loss", "second half of training")):
            for arm, (tokens, values) in val.items():
                (line,) = ax.plot(tokens, values.mean(0), label=f"{plot_text(arm)} (n={len(values)})")
                ax.fill_between(tokens, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
            ax.set(xlabel="training tokens", ylabel="validation NLL (nats/token)", title=title)
        late = np.concatenate([v[:, t >= half].ravel() for t, v in val.values()])
        late = late[np.isfinite(late)]  # a non-finite evaluation would make the limits NaN
        axes[1].set(xlim=(half, None))
        if len(late):
            pad = 0.05 * (late.max() - late.min()) or 0.01
            axes[1].set(ylim=(late.min() - pad, late.max() + pad))
        axes[0].legend()
        save(fig, "val_loss.png", "Validation loss against tokens (mean, min-max band over each arm's paired seeds)")
    # paired delta against each reference at every evaluation: a row per reference, a panel per arm
    shown = {ref: {a: c for a, c in comp["curves"].items() if len(c["tokens"])} for ref, comp in comparisons.items()}
    shown = {ref: curves for ref, curves in shown.items() if curves}
    if shown:
        width = max(len(curves) for curves in shown.values())
        fig, axes = plt.subplots(len(shown), width, figsize=(5 * width, 3.5 * len(shown)), squeeze=False)
        for row, (reference, curves) in zip(axes, shown.items()):
            for ax, (arm, c) in zip(row, curves.items()):
                ax.plot(c["tokens"], c["mean"], marker=".")
                ax.fill_between(c["tokens"], c["ci95_low"], c["ci95_high"], alpha=0.25)
                ax.axhline(0, color="black", linewidth=0.8)
                title = f"{plot_text(arm)} - {plot_text(reference)} (n={c['n']})"
                ax.set(xlabel="training tokens", ylabel="delta NLL (nats/token)", title=title)
            for ax in row[len(curves) :]:
                ax.axis("off")
        against = next(iter(shown)) if len(shown) == 1 else f"reference), a row per reference ({', '.join(shown)}"
        save(fig, "delta_curve.png", f"Paired delta NLL(arm) - NLL({against}) during training (mean, 95% t-interval)")
    # QK/V Jensen-Shannon divergence per layer over training, for arms with a value route
    arm, seed = cell
    for jsd_arm in arms:
        log = logs.get((jsd_arm, seed), [])
        records = [r for r in log if (r.get("routing") or {}).get("qk_v_jsd") and r.get("tokens") is not None]
        if not records:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer in records[0]["routing"]["qk_v_jsd"]:  # a layer a later record lacks is a gap, not an error
            jsd = [r["routing"]["qk_v_jsd"].get(layer, np.nan) for r in records]
            ax.plot([r["tokens"] for r in records], jsd, label=f"layer {plot_text(layer)}")
        title = f"{plot_text(jsd_arm)} seed{seed}: QK vs V depth routes"
        ax.set(xlabel="training tokens", ylabel="JSD (nats)", title=title)
        ax.legend(fontsize=7, ncol=2)
        save(fig, jsd_name(jsd_arm), f"{jsd_arm}: QK/V Jensen-Shannon divergence per layer over training")
    # depth-weight heatmaps of one cell's final evaluation, one panel per route (a read's name without its layer)
    final = [r for r in logs.get((arm, seed), []) if (r.get("routing") or {}).get("weights")]
    if final:
        routes = {}
        for name, w in final[-1]["routing"]["weights"].items():
            routes.setdefault(".".join(p for p in name.split(".") if not p.isdigit()), []).append((name, w))
        fig, axes = plt.subplots(1, len(routes), figsize=(4 * len(routes), 3.5), squeeze=False)
        for ax, (route, rows) in zip(axes[0], routes.items()):
            width = max(len(w) for _, w in rows)
            grid = np.full((len(rows), width), np.nan)
            for i, (_, w) in enumerate(rows):
                grid[i, : len(w)] = w
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set(title=plot_text(route), xlabel="source (embedding first)", ylabel="read")
            ax.set_yticks(range(len(rows)), [plot_text(n) for n, _ in rows], fontsize=6)
            ax.set_xticks(range(width))
            fig.colorbar(image, ax=ax)
        save(fig, routing_name(cell), f"Depth weights of {arm} seed{seed} at the end")
    return figures


def cell_note(cell, arms, seeds, logs):
    """One line where --cell names a cell whose log records no depth weights (the plot it asks for is not drawn)."""
    weighed = lambda a, s: any((r.get("routing") or {}).get("weights") for r in logs.get((a, s), []))
    if weighed(*cell):
        return []
    schemes = [a for a in arms if any(weighed(a, s) for s in seeds)]
    return [
        f"--cell={md(cell[0])}/seed{cell[1]}: no depth-weight plot: it draws a cell's depth weights (the softmax over "
        f"earlier sources, per read) at its last evaluation, which only the AttnRes family's schemes log; here "
        + (f"the arms {', '.join(map(md, schemes))}." if schemes else "no arm of this grid logs them."),
        "",
    ]
