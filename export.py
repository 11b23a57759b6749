"""
A trained cell as a Hugging Face model folder: the weights (model.safetensors), config.json, the
modeling code (modeling_nanodepth.py and a copy of model.py) and the cell's tokenizer (bytes or
GPT-2, as tokenizer.json), which transformers loads for every scheme, dense or MoE, and
lm-evaluation-harness evaluates (docs/downstream.md):

$ python export.py out/rd_attnres/seed0 --out=hf/rd_attnres_seed0
$ python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/rd_attnres_seed0', \
      trust_remote_code=True)"
$ lm_eval --model hf --model_args pretrained=hf/rd_attnres_seed0,trust_remote_code=True --tasks lambada_openai

transformers, safetensors and lm-eval are extras: pip install -r requirements-extras.txt.
"""

import json
import os
import shutil

from checkpoint import open_trained
from common import (
    ConfigError,
    DataError,
    Parser,
    UserError,
    check_writable,
    dying_cleanly,
    run,
    stale_temporaries,
    temporary_name,
)
from data.shards import GPT2, GPT2_PATTERN, TOKENIZER_FILE, get_tokenizer
import model

HERE = os.path.dirname(os.path.abspath(__file__))
CODE = ("modeling_nanodepth.py", "model.py")  # the modeling code, which the folder carries
EOT = "<|endoftext|>"


def hf_tokenizer(name, block_size):
    """The cell's tokenizer as a transformers PreTrainedTokenizerFast with its ids: bytes (ids 0-255
    the byte values, 256 end-of-text) or GPT-2 (from the bundled tiktoken file). Like a training
    document, every text it encodes starts with the end-of-text token (add_special_tokens=False: not)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    eot = get_tokenizer(name).eot
    if name == "gpt2":
        tokenizer = TikTokenConverter(
            vocab_file=TOKENIZER_FILE, pattern=GPT2_PATTERN, extra_special_tokens={EOT: GPT2.eot}
        ).converted()
    else:  # one token per byte: a byte-level BPE without merges, each byte's character mapped to its value
        tokenizer = Tokenizer(BPE({char: byte for byte, char in bytes_to_unicode().items()}, []))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([EOT])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot)]
    )
    if tokenizer.token_to_id(EOT) != eot:
        raise AssertionError(f"{EOT} is id {tokenizer.token_to_id(EOT)}, not {eot}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=block_size,
        padding_side="right",
    )


def in_model_py(scheme):
    """Whether a scheme class is one model.py defines (not one registered in RESIDUALS at run time)."""
    return getattr(model, scheme.__name__, None) is scheme


def remove_stale_exports(out):
    """The temporary folders of out that killed exports left on this host (a SIGKILL runs no finally;
    common.remove_stale_temporaries removes files only)."""
    for name in stale_temporaries(out):
        shutil.rmtree(name, ignore_errors=True)  # a symlink: left alone


def export(cell_dir, out, allow_changes=False):
    """The folder out (written under a temporary name, then renamed): a cell's last checkpoint for transformers.
    allow_changes: export even where model.py's definitions the cell computes with changed since it trained
    (its logits then are not the cell's), recorded in config.json."""
    if not out.strip():  # "" is the working directory to abspath, and its parent to dirname: never a folder to write
        raise UserError(
            f"--out={out!r} is empty (an unset variable?); give the folder to write, e.g. --out=hf/<arm>_seed<k>"
        )
    if os.path.exists(out):
        raise UserError(f"{out} exists; remove it or choose another --out")
    check_writable(os.path.dirname(os.path.abspath(out)), "choose another --out")
    cell = open_trained(cell_dir, "cpu")
    gpt, record, step, tokenizer = cell.model, cell.record, cell.step, cell.tokenizer_name
    if cell.tokenizer.vocab_size > gpt.config.vocab_size:
        raise DataError(
            f"{cell_dir}: vocab_size {gpt.config.vocab_size} is below its {tokenizer} tokenizer's "
            f"{cell.tokenizer.vocab_size} ids; it reads no text, so there is nothing to export"
        )
    if not in_model_py(type(gpt.residual)):  # the folder carries model.py, and only what it defines
        raise UserError(
            f"{cell_dir}: its scheme {gpt.config.residual!r} is not defined in model.py (it was "
            f"registered in RESIDUALS from elsewhere); add it to model.py to export the cell"
        )
    # the folder carries today's model.py with the cell's weights: its logits are the cell's only under its code
    if cell.code_changes and not allow_changes:
        commit = cell.trained_code.get("git_commit")
        at = f" (git commit {commit[:12]})" if isinstance(commit, str) else ""
        raise ConfigError(
            f"{cell_dir}: the code differs from the one the cell was trained with "
            f"({cell.changed()}), so the export's "
            f"logits would not be the cell's; export with the code it was trained with{at}, or add "
            f"--allow_changes=True to export anyway (recorded in its config.json)"
        )
    eot = cell.tokenizer.eot
    config = dict(
        model_type="nanodepth",
        architectures=["NanodepthForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_nanodepth.NanodepthConfig",
            "AutoModelForCausalLM": "modeling_nanodepth.NanodepthForCausalLM",
        },
        gpt=record["model"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        torch_dtype="float32",
        nanodepth=dict(
            arm=record.get("arm"),
            seed=record.get("seed"),
            step=step,
            tokenizer=tokenizer,
            code_changes=cell.code_changes if allow_changes else [],
        ),
    )
    out = os.path.abspath(out)
    remove_stale_exports(out)
    tmp = temporary_name(out)
    with dying_cleanly():  # a SIGTERM or SIGHUP meanwhile removes the temporary folder before the process dies
        write_folder(tmp, out, gpt, config, tokenizer)
    print(f"{cell_dir} step {step} -> {out} ({gpt.config.residual}, {tokenizer} tokens)")


def write_folder(tmp, out, gpt, config, tokenizer):
    """The folder written as tmp, then renamed to out; tmp removed whatever happens."""
    from safetensors.torch import save_file

    os.makedirs(tmp)
    try:
        # each tensor its own copy: the tied embedding and head are saved under both names (safetensors
        # shares no storage), and GPT ties them again when it is built
        save_file(
            {f"gpt.{k}": v.detach().clone().contiguous() for k, v in gpt.state_dict().items()},
            os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"},
        )
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        for name in CODE:
            shutil.copyfile(os.path.join(HERE, name), os.path.join(tmp, name))
        hf_tokenizer(tokenizer, gpt.config.block_size).save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise DataError(f"cannot write {out} ({e.strerror or e}); free disk space or choose another --out") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    parser = Parser("export.py", __doc__)
    parser.add_argument("cell", help="a cell folder (out_dir/<arm>/seed<k>) or its ckpt.pt")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist)")
    parser.add_argument(
        "--allow_changes",
        choices=("True", "False"),
        default="False",
        help="export even where the code the cell computes with changed since it trained (recorded)",
    )
    args = parser.parse_args(argv)
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401  (the extras, before any work)
    except ImportError as e:
        raise UserError(f"export needs {e.name}: pip install -r requirements-extras.txt") from None
    export(args.cell, args.out, args.allow_changes == "True")


if __name__ == "__main__":
    run(main)
