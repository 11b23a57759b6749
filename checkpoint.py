"""
A cell's checkpoint, ckpt.pt: where its training stands (CellState), its model and optimizer state
and every rank's RNG, saved so that a kill or a full disk never loses the last good one, and resumed
so that the cell goes on line for line as if never stopped; a trained cell opened for a tool
(open_trained: sample.py, export.py, downstream.py, analyze.py); and init_from, another grid's
checkpoint as every cell's starting weights (the warm start). docs/protocol.md says what is checked before a
checkpoint is resumed or warm-started from.
"""

import dataclasses
import functools
import hashlib
import json
import os
import pickle
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import records
from common import ConfigError, DataError, write_atomic, write_text
from data.shards import get_tokenizer, tokenizer_of
from model import GPT, GPTConfig, is_routing

REMEDY = "delete it to train the cell from scratch"


@dataclasses.dataclass
class CellState:
    """Where a cell's training stands: what ckpt.pt holds beside the weights, and what resume returns."""

    step: int = 0
    data_hash: str = ""  # sha256 chained over every batch trained on (TrainData.batch)
    loss_sum: float = 0.0  # the log interval's summed loss so far (rank 0 holds all of it in a checkpoint)
    step_last: int = 0  # the step that interval began at
    wall_time_s: float = 0.0  # training and evaluation, over every run of the cell
    wandb_id: str | None = None  # the cell's wandb run, continued on resume
    changes: list = dataclasses.field(default_factory=list)  # accepted changes: [{step, changed}] (allow_changes)


# -----------------------------------------------------------------------------
# saving


def save_atomically(path, obj, writer=torch.save):
    """writer(obj, tmp) through write_atomic: a failed write (a full disk) leaves the last good file
    in place and no temporary behind. torch.save reports a full disk as a RuntimeError."""
    try:
        write_atomic(path, lambda tmp: writer(obj, tmp))
    except RuntimeError as e:
        full = shutil.disk_usage(os.path.dirname(path) or ".").free < 1 << 26
        why = "no space left on device" if full else str(e).splitlines()[0]
        raise DataError(
            f"could not write {path} ({why}); the last good copy is kept: free disk space and rerun to resume"
        ) from None


def save_checkpoint(path, model, optimizer, state, record, runtime):
    """ckpt.pt at path: state, the weights and optimizer state in the one-process format, every
    rank's RNG and the cell's record. Every rank calls it (FSDP gathers its shards, the RNG states are
    gathered); rank 0 writes."""
    rng = gather_rng(runtime)
    weights, moments = training_state(model, optimizer, runtime)
    if runtime.master:
        ckpt = dict(model=weights, optimizer=moments, rng=rng, config=record, **dataclasses.asdict(state))
        save_atomically(path, ckpt)


def optimizer_parts(optimizer):
    """The torch optimizers behind configure_optimizers' one object (AdamW, or Muon and AdamW)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def training_state(model, optimizer, runtime):
    """(model state, optimizer state) for ckpt.pt, in one format however the model is spread: the
    full model state_dict and the optimizer state keyed by parameter name. Under FSDP every rank
    must call it (it gathers the shards) and rank 0 gets them."""
    if runtime.fsdp:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (
            get_model_state_dict(model, options=full),
            get_optimizer_state_dict(model, optimizer_parts(optimizer), options=full),
        )
    return model.state_dict(), get_optimizer_state_dict(model, optimizer_parts(optimizer))


def gather_rng(runtime):
    """Every rank's RNG state (dropout masks), for the checkpoint."""
    state = dict(
        torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state() if runtime.device.startswith("cuda") else None
    )
    if runtime.world == 1:
        return [state]
    states = [None] * runtime.world
    dist.all_gather_object(states, state)
    return states


# -----------------------------------------------------------------------------
# loading


def load_tensors(path, device):
    """torch.load of tensors and plain data only (weights_only: a planted file cannot run code); a
    file it cannot read is a ValueError whose message is the reason, in one line."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        why = (
            "not a checkpoint torch can read safely"
            if isinstance(e, pickle.UnpicklingError)
            else str(e).splitlines()[0]
            if str(e)
            else type(e).__name__
        )
        raise ValueError(why) from None


@dataclasses.dataclass
class TrainedCell:
    """A trained cell as a tool opens it (open_trained). code_changes: the definitions it computes with
    that changed since it trained (records.code_changes), so its numbers under today's code are not its
    own: each tool says so (sample.py, downstream.py, analyze.py) or refuses (export.py)."""

    path: str  # the cell folder or ckpt.pt given
    model: GPT  # uncompiled, in eval mode, on the device asked for
    record: dict  # the checkpoint's record (the cell's config.json as it trained)
    step: int
    trained_code: dict  # records.code_record() when it trained ({} in a record without one)
    code: dict  # records.code_record() now
    code_changes: list

    @functools.cached_property
    def tokenizer_name(self):
        """The tokenizer of the cell's data: its record's, or asked of its data_dir (older cells)."""
        try:
            return self.record.get("tokenizer") or tokenizer_of(self.record["data_dir"])
        except DataError as e:
            raise DataError(f"the tokenizer of {self.path}'s data_dir is unknown: {e}") from None

    @property
    def tokenizer(self):
        return get_tokenizer(self.tokenizer_name)

    def changed(self):
        """The code changes as a phrase for one line ('GPT, Block'), '' when there are none."""
        return (
            records.described_changes(self.trained_code, self.code, {self.model.config.residual})
            if self.code_changes
            else ""
        )


def open_trained(path, device="cpu"):
    """A trained cell's ckpt.pt as a TrainedCell (nanochat's load_model): its model, record, step,
    tokenizer and the code changed since it trained; path is the cell folder or the checkpoint itself."""
    ckpt_path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    give = "give a cell folder of train.py's out_dir (out/<arm>/seed<k>) or its ckpt.pt"
    if not os.path.isfile(ckpt_path):
        raise DataError(f"{ckpt_path} does not exist; {give}")
    try:
        ckpt = load_tensors(ckpt_path, "cpu")
    except ValueError as e:
        raise DataError(f"{ckpt_path} cannot be read as a checkpoint ({e}); {give}") from None
    record = ckpt.get("config") if isinstance(ckpt, dict) else None
    if not (
        isinstance(record, dict)
        and isinstance(ckpt.get("model"), dict)
        and isinstance(record.get("model"), dict)
        and isinstance(record.get("data_dir"), str)
        and isinstance(ckpt.get("step"), int)
    ):
        raise DataError(f"{ckpt_path} is not a train.py checkpoint (no model weights, step and cell config); {give}")
    try:
        model = GPT(GPTConfig(**record["model"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise DataError(
            f"{ckpt_path}: its model does not fit this model.py ({str(e).splitlines()[0]}); "
            f"use the code that trained it"
        ) from None
    # the weights are the cell's, the code today's: the changes it computes with are the provenance rule's
    trained = record.get("code") if isinstance(record.get("code"), dict) else {}
    code = records.code_record()
    return TrainedCell(
        path,
        model.to(device).eval(),
        record,
        ckpt["step"],
        trained,
        code,
        records.code_changes(trained, code, {model.config.residual}),
    )


def load_checkpoint(path, device):
    """A ckpt.pt as train.py writes it, its fields checked against CellState's, or one line."""
    try:
        ckpt = load_tensors(path, device)
    except ValueError as e:
        raise DataError(f"{path} is unreadable, truncated or empty ({e}); {REMEDY}") from None
    if isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict):  # older checkpoints: no wandb run, and
        ckpt.setdefault("wandb_id", None)  # their accepted changes in their record only
        ckpt.setdefault("changes", ckpt["config"].get("changes", []))
    kinds = dict(model=dict, optimizer=dict, rng=list, config=dict) | {
        f.name: (int, float) if f.type is float else f.type for f in dataclasses.fields(CellState)
    }
    missing = [k for k in kinds if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise DataError(f"{path} was written by an older train.py (no {', '.join(missing)}); {REMEDY}")
    wrong = [k for k, kind in kinds.items() if not isinstance(ckpt[k], kind) or isinstance(ckpt[k], bool)]
    if "rng" not in wrong and not all(
        isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in ckpt["rng"]
    ):
        wrong.append("rng")
    if wrong or ckpt["step"] < 0 or not 0 <= ckpt["step_last"] <= ckpt["step"]:
        raise DataError(
            f"{path} is not a checkpoint train.py wrote ({', '.join(wrong) or 'step'} of the wrong "
            f"type or value); {REMEDY}"
        )
    return ckpt


def resume(cell_dir, record, allow, model, optimizer, runtime):
    """Load the cell's checkpoint into model and optimizer, cut its log back to it, restore its RNG;
    returns its CellState. The checkpoint's record is checked as config.json is (records.check_rerun):
    it must be this cell's and made with the same settings and code unless allow (then the change joins
    state.changes); its step must be within max_iters."""
    path = os.path.join(cell_dir, "ckpt.pt")
    if not os.path.exists(os.path.join(cell_dir, "config.json")):
        raise DataError(
            f"{cell_dir} has ckpt.pt but no config.json to check it against; restore config.json, "
            f"or delete ckpt.pt to train the cell from scratch"
        )
    ckpt = load_checkpoint(path, runtime.device)
    saved = ckpt["config"]
    change = records.check_rerun(path, saved, record, allow)  # this cell's, and made as this run (or allow)
    if ckpt["step"] > record["max_iters"]:
        raise ConfigError(
            f"{path} is at step {ckpt['step']}, past max_iters={record['max_iters']}; set "
            f"--max_iters={saved.get('max_iters', ckpt['step'])} to finish it, or delete it to retrain"
        )
    if saved.get("optimizer", "adamw") != record["optimizer"]:
        raise ConfigError(
            f"{path} was trained with optimizer={saved.get('optimizer', 'adamw')!r}, whose state "
            f"{record['optimizer']!r} cannot take over; {REMEDY}"
        )
    kept_log = log_until(os.path.join(cell_dir, "log.jsonl"), ckpt["step"])
    try:
        load_training_state(path, ckpt, model, optimizer, runtime)
    except RuntimeError as e:  # a state_dict of another model
        raise ConfigError(f"{path} does not fit this cell's model ({str(e).splitlines()[0]}); {REMEDY}") from None
    restore_rng(ckpt["rng"], runtime)
    if runtime.master:
        write_text(os.path.join(cell_dir, "log.jsonl"), kept_log)
    state = CellState(**{f.name: ckpt[f.name] for f in dataclasses.fields(CellState)})
    if runtime.rank != 0:
        state.loss_sum = 0.0  # rank 0 carries the interval's loss: the ranks' sum is the saved one
    state.changes = state.changes + ([dict(step=ckpt["step"], changed=change)] if change else [])
    return state


def load_training_state(path, ckpt, model, optimizer, runtime):
    """ckpt's model and optimizer state into model and optimizer (each rank takes its shards under FSDP)."""
    full = StateDictOptions(full_state_dict=True) if runtime.fsdp else None
    if runtime.fsdp:
        set_model_state_dict(model, ckpt["model"], options=full)
    else:
        model.load_state_dict(ckpt["model"])
    try:
        set_optimizer_state_dict(model, optimizer_parts(optimizer), ckpt["optimizer"], options=full)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(
            f"{path} holds an optimizer state that does not fit this optimizer ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else '-'}): written with another optimizer or by an "
            f"older train.py; {REMEDY}"
        ) from None


def restore_rng(states, runtime):
    if len(states) != runtime.world:
        return  # another world size: a recorded change (world_size), whose dropout streams start afresh
    state = states[runtime.rank]
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None and runtime.device.startswith("cuda"):
        torch.cuda.set_rng_state(state["cuda"].cpu())


def log_until(log_path, step):
    """The cell's log records before a checkpoint at step (its own evaluation is redone); a
    half-written last line (a kill or a full disk mid-write) is dropped."""
    if not os.path.isfile(log_path):
        raise DataError(
            f"{log_path} is missing beside its ckpt.pt; restore it, or delete ckpt.pt to train the cell from scratch"
        )
    try:
        with open(log_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise DataError(
            f"{log_path} is not text; restore it, or delete ckpt.pt to train the cell from scratch"
        ) from None
    kept = []
    for i, line in enumerate(lines):
        try:
            r = json.loads(line)
            if not isinstance(r, dict) or not isinstance(r.get("step"), int):
                raise ValueError
        except ValueError:
            if i == len(lines) - 1:
                break
            raise DataError(
                f"{log_path} line {i + 1} is not a log record; repair it, or delete ckpt.pt to train "
                f"the cell from scratch"
            ) from None
        if r["step"] < step or (r["step"] == step and "loss" in r):
            kept.append(line + "\n")
    return "".join(kept)


# -----------------------------------------------------------------------------
# warm start

# the model keys that give the shared weights their meaning (n_head: not visible in the shapes)
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size")


@dataclasses.dataclass
class WarmStart:
    """The weights every cell starts from (None: the seed's init), the sha256 of their file, the tokenizer of
    the data they were trained on and their model settings (None and {} for a plain state_dict, which cannot say)."""

    path: str = ""
    weights: dict | None = None
    sha256: str | None = None
    tokenizer: str | None = None
    model: dict = dataclasses.field(default_factory=dict)


def load_init_from(path):
    """
    The WarmStart of init_from=path ("" for none): a train.py ckpt.pt of a residual='standard' arm, or
    a file holding a state_dict of one. check_init_fits checks it against every arm before anything
    runs; each cell then copies the weights by name over its seed's init, leaving its routing
    parameters (residual.*) at their init, which is the standard residual.
    """
    if not path:
        return WarmStart()
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        ckpt = load_tensors(path, "cpu")
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"init_from={path} is missing or unreadable ({why}); give a train.py ckpt.pt of a residual='standard' arm"
        ) from None
    weights = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else None
    if (
        not isinstance(weights, dict)
        or not weights
        or not all(isinstance(v, torch.Tensor) for v in weights.values())
        or not all(isinstance(k, str) for k in weights)
    ):
        raise ConfigError(f"init_from={path} holds neither a train.py ckpt.pt nor a state_dict")
    record = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}  # a train.py checkpoint says what it is
    source = record.get("model") if isinstance(record.get("model"), dict) else {}
    routing = [k for k in weights if is_routing(k)]
    if routing:
        raise ConfigError(
            f"init_from={path} is not a standard checkpoint (residual={source.get('residual', '?')!r}, "
            f"routing parameters {routing[0]}, ...); warm starts begin from a residual='standard' model"
        )
    broken = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:  # every cell would diverge at its first step
        raise ConfigError(
            f"init_from={path} holds non-finite values (NaN or inf) in {broken[0]}"
            f"{f' and {len(broken) - 1} more' if len(broken) > 1 else ''}; warm-start from a checkpoint "
            f"saved before its run diverged"
        )
    embedding, head = weights.get("transformer.wte.weight"), weights.get("lm_head.weight")
    if embedding is not None and head is not None and not torch.equal(embedding, head):  # one tensor here
        raise ConfigError(
            f"init_from={path} has an embedding (transformer.wte.weight) and a head (lm_head.weight) "
            f"that differ; this model ties them, so one would be lost: give a tied checkpoint"
        )
    return WarmStart(path, weights, h.hexdigest(), record.get("tokenizer"), source)


def check_init_fits(init, cfg):
    """One line for an arm of cfg whose model the warm start's weights do not fit."""
    if init.weights is None:
        return
    path, weights, source = init.path, init.weights, init.model
    for arm, settings in cfg["arms"].items():
        config = records.model_config(cfg, settings)
        for key in ARCHITECTURE_KEYS:
            if key in source and source[key] != getattr(config, key):
                raise ConfigError(
                    f"init_from={path} has {key}={source[key]}, arm {arm!r} has {key}="
                    f"{getattr(config, key)}; set --{key}={source[key]} or use another checkpoint"
                )
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in GPT(config).state_dict().items() if not is_routing(k)}
        for name in sorted(set(shapes) | set(weights)):
            have = tuple(weights[name].shape) if name in weights else "absent"
            want = tuple(shapes[name]) if name in shapes else "absent"
            if have != want:
                raise ConfigError(
                    f"init_from={path} does not fit arm {arm!r}: {name} is {have} there, {want} in "
                    f"the arm (n_layer, n_embd, vocab_size must be the checkpoint's)"
                )
