"""
Interventions and representation diagnostics of one trained cell (docs/analyses.md says how to
read them).

$ python analyze.py out/rd_attnres/seed0                   # the cell's whole fixed validation set
$ python analyze.py out/dar/seed0 --max_tokens=65536 --device=cuda

Loads the cell's ckpt.pt and config.json (written by train.py) and evaluates on the cell's own
fixed validation set (its eval_layout sequences of its validation shard, as train.py reads them;
--max_tokens takes fewer, recorded). Writes into the cell folder analysis.json, analysis.md and,
when matplotlib is installed, analysis_interventions.png and analysis_cosine.png:

- interventions: every change GPT.interventions() lists (uniform weights for one depth read, RD's
  value route tied to its QK route per layer and everywhere, DAR by its own keys or from one
  stream, HC/mHC identity mixing, DenseFormer's averages replaced by the standard residual),
  each as the validation NLL with the change minus the NLL without it, on the same tokens;
- representations, averaged over the same tokens: per read the mean weights over its sources and
  the effective number of sources, exp(entropy) per token averaged over tokens; at the output
  read, the cosine-similarity matrix of the depth sources per stream; DAR's cross-stream cosine per
  block and HC/mHC's per pair of streams; RD's QK/V divergence per layer; MHAR's weights and
  entropy per head;
- for DAR, a summary of what its claims need: the own_keys and one_stream deltas, the cross-stream
  cosine per block, and per stream the mean off-diagonal source cosine and effective sources at out.

Every input is checked before the evaluation (bad input: one line, nothing written).
"""

import os
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import machine
import records
import train
from common import ConfigError, Parser, check_writable, run, write_atomic, write_json, write_text
from data.shards import find_shards, open_shard, resolve_data_dir
from model import GPTConfig


# what analyze.py reads from a cell's config.json (train.py writes them all), and their types
RECORD_KEYS = dict(
    model=dict, data_dir=str, dtype=str, eval_tokens=int, eval_batch_size=int, val_hash=str, arm=str, seed=int
)


def not_a_record(path, why):
    return ConfigError(f"{path} is not a cell record of this code ({why}); rerun train.py for the cell")


def open_cell(cell_dir):
    """(the cell as checkpoint.open_trained opens it, on the CPU; its config.json record), the record the
    analysis reads checked too."""
    give = "give OUT_DIR/<arm>/seed<k> of a train.py run"
    if not os.path.exists(cell_dir):
        raise ConfigError(f"{cell_dir} does not exist; {give}")
    if not os.path.isdir(cell_dir):
        raise ConfigError(f"{cell_dir} is a file, not a cell folder; {give}")
    config_path, ckpt_path = os.path.join(cell_dir, "config.json"), os.path.join(cell_dir, "ckpt.pt")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{cell_dir} is not a cell folder (no config.json); {give}")
    cfg = records.read_record(config_path, "restore it, or rerun train.py for the cell")
    for key, kind in RECORD_KEYS.items():  # bool is an int to Python, never to a record
        if key not in cfg:
            raise not_a_record(config_path, f"no {key}")
        if not isinstance(cfg[key], kind) or isinstance(cfg[key], bool):
            raise not_a_record(config_path, f"{key}={cfg[key]!r} is not of type {kind.__name__}")
    for key in ("eval_tokens", "eval_batch_size"):
        if cfg[key] < 1:
            raise not_a_record(config_path, f"{key}={cfg[key]} is not positive")
    missing = [f.name for f in fields(GPTConfig) if f.name not in cfg["model"]]
    if missing:  # a default filled in here would be a model other than the one trained
        raise not_a_record(config_path, f"model has no {', '.join(missing)}")
    try:
        GPTConfig(**cfg["model"])  # its own checks, one line each
    except (ValueError, TypeError) as e:
        raise not_a_record(config_path, f"model: {e}") from None
    if not os.path.isfile(ckpt_path):
        raise ConfigError(
            f"{ckpt_path} is missing: the cell saves it at its first evaluation after step 0; "
            f"train the cell (train.py) first"
        )
    cell = checkpoint.open_trained(cell_dir, "cpu")
    model = cell.model
    if cell.record["model"] != cfg["model"]:  # the evaluation settings below are config.json's
        raise ConfigError(
            f"{ckpt_path} holds another model than {config_path} (a file copied from another cell?); "
            f"restore the cell's own files, or rerun train.py for the cell"
        )
    if not all(v.isfinite().all() for v in model.state_dict().values() if v.is_floating_point()):
        raise ConfigError(
            f"{ckpt_path} has non-finite weights (a diverged cell): there is nothing to analyse; "
            f"retrain the cell, e.g. with a lower learning_rate"
        )
    return cell, cfg


def recorded_val_loss(cell_dir):
    """The cell's recorded val_loss from result.json (None when it has none: unfinished or diverged)."""
    path = os.path.join(cell_dir, "result.json")
    if not os.path.exists(path):
        return None
    result = records.read_record(path, records.RESULT_REMEDY)
    loss = result.get("val_loss")
    if loss is not None and (not isinstance(loss, (int, float)) or isinstance(loss, bool)):
        raise ConfigError(f"{path} is not a result of train.py (val_loss={loss!r}); {records.RESULT_REMEDY}")
    return loss


def accumulate(total, value, weight):
    """total + weight * value, leaf by leaf (numbers and tensors in nested dicts)."""
    if isinstance(value, dict):
        return {k: accumulate(None if total is None else total[k], v, weight) for k, v in value.items()}
    return weight * value if total is None else total + weight * value


@torch.no_grad()
def representations(model, val_rows, evaluation, runtime):
    """GPT.routing_diagnostics averaged over the tokens of the fixed validation set (val_rows, its sequences;
    evaluation: its block_size and eval_batch_size, as train.evaluate takes them)."""
    B, n_seq = evaluation.eval_batch_size, len(val_rows)
    model.eval()
    total = None
    for i in tqdm(range(0, n_seq, B), desc="representations", leave=False):
        x, _ = train.validation_batch(val_rows, range(i, min(i + B, n_seq)), runtime.device)
        with runtime.autocast:
            total = accumulate(
                total, model.routing_diagnostics(x), len(x) / n_seq
            )  # every batch: T tokens per sequence
    return total


def interventions(model, val, evaluation, runtime):
    """(base NLL, [(change, NLL with the change)]) on the fixed validation set, each through GPT.intervene."""
    base = train.evaluate(model, val, evaluation, runtime)
    rows = []
    try:
        for change in tqdm(model.interventions(), desc="interventions"):
            model.intervene(change)
            rows.append((change, train.evaluate(model, val, evaluation, runtime)))
    finally:
        model.intervene()
    return base, rows


def off_diagonal_mean(matrix):
    n = len(matrix)
    return sum(matrix[i][j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1))


def dar_summary(a):
    """What DAR's claims need, per stream s where it has one: the own_keys delta (None under
    dar_keys='self'), the one_stream s deltas, the cross-stream cosine per block, and at the output
    read (where every block exists) each stream's mean off-diagonal source cosine and effective
    number of sources, out of `sources`."""
    delta = {tuple(r["change"]): r["delta"] for r in a["interventions"]}
    rep = a["representations"]
    return dict(
        own_keys=delta.get(("own_keys",)),
        one_stream=[delta[("one_stream", s)] for s in (0, 1)],
        block_cosine=rep["block_cosine"]["out"],
        source_cosine_off_diagonal=[off_diagonal_mean(rep["source_cosine"][f"out.s{s}"]) for s in (0, 1)],
        effective_sources=[rep["effective_sources"][f"out.s{s}"] for s in (0, 1)],
        sources=len(rep["weights"]["out.s0"]),
    )


def describe(change):
    kind, *arg = change
    return f"{kind} {arg[0]}" if arg else f"{kind} (all)" if kind in ("tie_value", "identity_dwa") else kind


def matrix_table(name, matrix):
    n = len(matrix)
    lines = [f"**{name}**", "", "| | " + " | ".join(map(str, range(n))) + " |", "|---" * (n + 1) + "|"]
    lines += [f"| {i} | " + " | ".join(f"{v:.2f}" for v in row) + " |" for i, row in enumerate(matrix)]
    return lines + [""]


def markdown(a):
    lines = [
        f"# Analysis of {a['arm']}/seed{a['seed']} (residual={a['residual']}, step {a['step']})",
        "",
        f"Validation: the first {a['tokens']:,} tokens of the cell's fixed validation set"
        + (f" (capped by --max_tokens; the cell evaluates {a['cell_tokens']:,})" if a["capped"] else "")
        + f"; device {a['device']}. NLL of the unmodified model: {a['base_nll']:.4f} nats/token"
        + (f" (the cell recorded {a['recorded_val_loss']:.4f})" if a["recorded_val_loss"] is not None else "")
        + ".",
        "",
    ]
    rep = a["representations"] or {}
    if "expert_load" in rep:  # an MoE model, under any scheme: how each layer's router spreads the tokens
        lines += [
            "## Experts",
            "",
            "Fraction of tokens that reach each expert (k/E each when balanced; they sum to k) "
            "and the entropy of the router's normalised scores (log E when uniform).",
            "",
            "| layer | load per expert | router entropy |",
            "|---|---|---|",
        ]
        lines += [
            f"| {name} | {' '.join(f'{v:.2f}' for v in load)} | {rep['router_entropy'][name]:.3f} |"
            for name, load in rep["expert_load"].items()
        ] + [""]
    if not a["interventions"] and not any(v for g, v in rep.items() if g not in ("expert_load", "router_entropy")):
        return "\n".join(
            lines
            + [
                f"residual={a['residual']!r} lists no interventions and records no routing "
                f"diagnostics: nothing more to show.",
                "",
            ]
        )
    if a["interventions"]:
        lines += [
            "## Interventions",
            "",
            "NLL with the change minus NLL without it, on the same tokens "
            "(positive: the learned routing that the change removes was helping).",
            "",
            "| change | NLL | delta NLL |",
            "|---|---|---|",
        ]
        lines += [f"| {describe(r['change'])} | {r['nll']:.4f} | {r['delta']:+.3g} |" for r in a["interventions"]]
    if rep["weights"]:
        lines += [
            "",
            "## Depth reads",
            "",
            "Effective number of sources: exp(entropy of the read's weights) per token, "
            "averaged over tokens (1: one source; S: all S equally).",
            "",
            "| read | sources | effective | mean weights (embedding first) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {len(w)} | {rep['effective_sources'][name]:.2f} | {' '.join(f'{v:.2f}' for v in w)} |"
            for name, w in rep["weights"].items()
        ]
    if "heads" in rep:  # MHAR: the table above is the heads' mean; a head can be sharp where their mean is flat
        lines += [
            "",
            "## Depth heads",
            "",
            "Each head's own read: the entropy of its weights (nats, averaged over tokens: 0 when it takes "
            "one source, log S when it weighs its S sources equally) and its mean weights.",
            "",
            "| read | head | entropy | mean weights (embedding first) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {h} | {rep['head_entropy'][name][h]:.3f} | {' '.join(f'{v:.2f}' for v in w)} |"
            for name, heads in rep["heads"].items()
            for h, w in enumerate(heads)
        ]
    for group, title in (
        ("dwa", "DenseFormer's depth-weighted averages (per layer, embedding first)"),
        ("fusion", "DAR's fusion of the two streams' reads (stream 0, stream 1)"),
    ):
        if group in rep:
            lines += ["", f"## {title}", "", "| after / read | weights |", "|---|---|"]
            lines += [f"| {name} | {' '.join(f'{v:.2f}' for v in w)} |" for name, w in rep[group].items()]
    if rep["qk_v_jsd"]:
        lines += [
            "",
            "## QK vs V route",
            "",
            "Jensen-Shannon divergence (nats) between the two routes' weights, "
            "per token, averaged: 0 when the routes agree.",
            "",
            "| layer | JSD |",
            "|---|---|",
        ]
        lines += [f"| {layer} | {v:.4f} |" for layer, v in rep["qk_v_jsd"].items()]
    if "source_cosine" in rep:
        lines += [
            "",
            "## Depth-wise diversity",
            "",
            "Cosine similarity of the sources the output read sees "
            "(0: the embedding, then one per block or layer), per token, averaged.",
            "",
        ]
        for name, m in rep["source_cosine"].items():
            lines += matrix_table(name, m)
    if "dar" in a:
        d = a["dar"]
        lines += [
            "",
            "## DAR",
            "",
            "The numbers DAR's claims rest on (docs/analyses.md says how to read them): the "
            "interventions' deltas (NLL with the change minus without), the cosine of the two streams' versions "
            "of each block (the embedding is shared), and at the output read, where all "
            f"{d['sources']} sources exist, each stream's depth-wise diversity.",
            "",
            "| | stream 0 | stream 1 |",
            "|---|---|---|",
            f"| one_stream delta NLL | {d['one_stream'][0]:+.3g} | {d['one_stream'][1]:+.3g} |",
            "| mean off-diagonal source cosine at out | "
            + " | ".join(f"{v:.3f}" for v in d["source_cosine_off_diagonal"])
            + " |",
            f"| effective sources at out (of {d['sources']}) | "
            + " | ".join(f"{v:.2f}" for v in d["effective_sources"])
            + " |",
            "",
            "own_keys delta NLL: "
            + ("none (dar_keys='self' reads by its own keys)" if d["own_keys"] is None else f"{d['own_keys']:+.3g}")
            + ".",
            "",
            "| block | " + " | ".join(str(b + 1) for b in range(len(d["block_cosine"]))) + " |",
            "|---" * (len(d["block_cosine"]) + 1) + "|",
            "| cross-stream cosine | " + " | ".join(f"{v:.6g}" for v in d["block_cosine"]) + " |",
            "",
        ]
    if "stream_cosine" in rep and "out" in rep["stream_cosine"] and isinstance(rep["stream_cosine"]["out"], list):
        lines += [
            "",
            "## Cross-stream similarity",
            "",
            "Cosine similarity of the residual streams before the output.",
            "",
        ]
        lines += matrix_table("streams", rep["stream_cosine"]["out"])
    return "\n".join(lines) + "\n"


def plots(a, cell_dir):
    """The deltas as bars and the cosine matrices as heatmaps, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    save = lambda fig, name: write_atomic(
        os.path.join(cell_dir, name), lambda tmp: fig.savefig(tmp, format="png", dpi=120)
    )
    rows = a["interventions"]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 0.25 * len(rows) + 1))
        ax.barh([describe(r["change"]) for r in rows][::-1], [r["delta"] for r in rows][::-1])
        ax.set_xlabel("delta validation NLL (nats/token)")
        ax.set_title(f"{a['arm']}/seed{a['seed']}: interventions", fontsize=9)
        fig.tight_layout()
        save(fig, "analysis_interventions.png")
        plt.close(fig)
    matrices = [(f"sources {k}", m) for k, m in a["representations"].get("source_cosine", {}).items()]
    if isinstance(a["representations"].get("stream_cosine", {}).get("out"), list):
        matrices.append(("streams", a["representations"]["stream_cosine"]["out"]))
    if matrices:
        fig, axes = plt.subplots(1, len(matrices), figsize=(3.2 * len(matrices), 3), squeeze=False)
        for ax, (name, m) in zip(axes[0], matrices):
            image = ax.imshow(m, vmin=-1, vmax=1, cmap="RdBu_r")
            ax.set_title(f"cosine: {name}", fontsize=9)
        fig.colorbar(image, ax=axes[0].tolist())
        save(fig, "analysis_cosine.png")
        plt.close(fig)


def main(argv):
    parser = Parser("analyze.py", __doc__)
    parser.add_argument("cell", help="a cell folder, OUT_DIR/<arm>/seed<k>")
    parser.add_argument(
        "--max_tokens", type=int, default=0, help="evaluate at most this many tokens (0: the cell's eval_tokens)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="", help="auto, bfloat16 or float32 (default: the cell's)")
    args = parser.parse_args(argv)
    cell, cfg = open_cell(args.cell)
    model, step = cell.model, cell.step
    runtime = machine.setup(
        dict(device=args.device, dtype=args.dtype or cfg["dtype"], fsdp=False)
    )  # one process, whole model
    data_dir = resolve_data_dir(cfg["data_dir"])  # as train.py resolved it (recorded absolute since)
    text = records.ValidationText(open_shard(find_shards(data_dir)[0], model.config.vocab_size), cfg.get("tokenizer"))
    T, layout = model.config.block_size, cfg.get("eval_layout", "first")  # cells made before eval_layout: 'first'
    try:
        val_hash = text.hash(cfg["eval_tokens"], T, layout)
    except ConfigError:  # a shorter shard
        val_hash = None
    if val_hash != cfg["val_hash"]:
        raise ConfigError(
            f"the validation sequences ({cfg['eval_tokens']:,} eval_tokens, eval_layout {layout!r}) of the validation "
            f"shard in {data_dir} are not the ones the cell was evaluated on (val_hash differs): restore the cell's "
            f"data there"
        )
    eval_tokens = min(args.max_tokens or cfg["eval_tokens"], cfg["eval_tokens"])
    if eval_tokens < T + 1:
        raise ConfigError(f"--max_tokens={args.max_tokens} is less than one sequence of block_size+1 = {T + 1} tokens")
    capped = eval_tokens < cfg["eval_tokens"]
    recorded = None if capped else recorded_val_loss(args.cell)  # on other tokens it would not compare
    # every input is checked: now minutes of evaluation, then the writes
    check_writable(
        args.cell,
        "analyze.py writes its results there; make it writable, or copy the cell folder somewhere "
        "writable and analyse the copy",
    )
    code = cell.code  # the analysis is of this code's model: recorded, and said when it is not the cell's
    if cell.code_changes:
        print(
            f"note: the code differs from the one {args.cell} was trained with ({cell.changed()}); these numbers "
            f"are of the current code"
        )
    model.to(runtime.device)
    evaluation = SimpleNamespace(block_size=T, eval_batch_size=cfg["eval_batch_size"])
    every = text.rows(cfg["eval_tokens"], T, layout)
    n_seq = (eval_tokens - 1) // T
    val = every[np.arange(n_seq) * len(every) // n_seq]  # --max_tokens: an even subset, spread as the whole
    base, rows = interventions(model, val, evaluation, runtime)
    tokens = (eval_tokens - 1) // T * T
    a = dict(
        cell=os.path.abspath(args.cell),
        arm=cfg["arm"],
        seed=cfg["seed"],
        residual=model.config.residual,
        step=step,
        device=runtime.device,
        tokens=tokens,
        cell_tokens=(cfg["eval_tokens"] - 1) // T * T,
        capped=capped,
        base_nll=base,
        recorded_val_loss=recorded,
        code=code,
        trained_code=cell.trained_code.get("fingerprint"),
        interventions=[dict(change=list(c), nll=nll, delta=nll - base, tokens=tokens) for c, nll in rows],
        representations=records.rounded(representations(model, val, evaluation, runtime)),
    )
    if model.config.residual == "dar":
        a["dar"] = dar_summary(a)
    write_json(os.path.join(args.cell, "analysis.json"), a)
    write_text(os.path.join(args.cell, "analysis.md"), markdown(a))
    plots(a, args.cell)
    print(markdown(a))


if __name__ == "__main__":
    run(main)
