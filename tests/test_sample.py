"""sample.py: text from a cell's checkpoint, its settings, and the one-line errors."""

import dataclasses
import json
import os

import pytest
import torch

import records
import sample
from common import DataError
from data.prepare import prepare
from helpers import write_checkpoint
from model import GPT, GPTConfig


def save_cell(cell_dir, data_dir, **model):
    """A cell as train.py leaves it: ckpt.pt and config.json, with an untrained tiny model."""
    config = GPTConfig(**dict(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=320) | model)
    torch.manual_seed(0)
    gpt = GPT(config)
    record = dict(arm="attnres", seed=0, data_dir=str(data_dir), model=dataclasses.asdict(config))
    write_checkpoint(cell_dir, gpt, record, step=1)
    with open(os.path.join(cell_dir, "config.json"), "w") as f:
        json.dump(record, f)
    return gpt


@pytest.fixture
def cell(tmp_path):
    (tmp_path / "play.txt").write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 40)
    prepare(
        str(tmp_path / "data"),
        input=str(tmp_path / "play.txt"),
        tokenizer="bytes",
        val_tokens=500,
        workers=1,
        quiet=True,
    )
    return tmp_path / "out" / "attnres" / "seed0", save_cell(tmp_path / "out" / "attnres" / "seed0", tmp_path / "data")


def byte_text(ids):
    """The bytes tokenizer's text, written out here: UTF-8 bytes, 256 = <|endoftext|>, a padding id unreadable."""
    return b"".join(bytes([i]) if i < 256 else b"<|endoftext|>" if i == 256 else "\ufffd".encode() for i in ids).decode(
        "utf-8", errors="replace"
    )


def samples(capsys, *argv):
    sample.main([str(a) for a in argv])
    printed = capsys.readouterr().out
    assert printed.endswith("---------------\n")
    return printed.split("\n---------------\n")[:-1]


def test_samples_are_the_models_and_start_with_the_prompt(cell, capsys):
    cell_dir, gpt = cell
    got = samples(
        capsys, cell_dir, "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=30", "--seed=7", "--device=cpu"
    )
    torch.manual_seed(7)  # the same draws, decoded here without prepare.py
    prompt = torch.tensor([list(b"ROMEO:")])
    expected = [gpt.eval().generate(prompt, 30, temperature=0.8)[0].tolist() for _ in range(2)]
    assert got == [byte_text(ids) for ids in expected]
    assert all(s.startswith("ROMEO:") for s in got) and got[0] != got[1]
    assert (
        samples(capsys, cell_dir / "ckpt.pt", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=30", "--seed=7")
        == got
    )  # the checkpoint itself, device auto: the same
    assert samples(capsys, cell_dir, "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=30", "--seed=8") != got


def greedy_text(gpt, steps):
    """The likeliest token after each prefix, from end-of-text on, decoded."""
    ids = [256]
    with torch.no_grad():
        for _ in range(steps):
            ids.append(gpt.eval()(torch.tensor([ids[-16:]]))[0][0, -1].argmax().item())
    return byte_text(ids[1:])


def test_an_empty_start_begins_a_document_and_top_k_narrows(cell, capsys):
    cell_dir, gpt = cell
    got = samples(capsys, cell_dir, "--max_new_tokens=20", "--top_k=1", "--num_samples=2")
    assert got == [greedy_text(gpt, 20)] * 2  # top_k=1 is greedy


@pytest.mark.parametrize("temperature", ["1e-30", "1e-300", "5e-324"])
def test_a_tiny_temperature_is_greedy_without_overflow(cell, capsys, temperature):
    # logits / 1e-300 overflows float32 (a NaN draw); the limit of sampling as the temperature goes to 0 is greedy
    cell_dir, gpt = cell
    got = samples(capsys, cell_dir, "--max_new_tokens=20", f"--temperature={temperature}", "--num_samples=2")
    assert got == [greedy_text(gpt, 20)] * 2
    torch.manual_seed(1337)  # above the threshold the model's own draw at that temperature: greedy too, here
    above = gpt.eval().generate(torch.tensor([[256]]), 20, temperature=1e-19)[0, 1:].tolist()
    assert samples(capsys, cell_dir, "--max_new_tokens=20", "--temperature=1e-19", "--num_samples=1") == [
        byte_text(above)
    ]


def test_bad_cells_and_prompts_are_one_line(cell, tmp_path):
    cell_dir, gpt = cell

    def fails(match, *argv):
        with pytest.raises(DataError, match=match) as err:
            sample.main([str(a) for a in argv])
        assert "\n" not in str(err.value)

    fails(r"nothing does not exist; give a cell folder", tmp_path / "nothing")
    fails(r"out/ckpt.pt does not exist; give a cell folder", tmp_path / "out")
    torch.save(gpt.state_dict(), tmp_path / "weights.pt")  # a bare state_dict: no cell config
    fails(r"weights.pt is not a train.py checkpoint", tmp_path / "weights.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    fails(r"junk.pt cannot be read as a checkpoint", tmp_path / "junk.pt")
    save_cell(tmp_path / "gone", tmp_path / "no_data")
    fails(r"the tokenizer of .*gone's data_dir is unknown: data_dir .*no_data does not exist", tmp_path / "gone")
    fails(
        r"--start is not text the tokenizer can encode \(character 2: surrogates not allowed\)",
        cell_dir,
        "--start=ab\ud800",
    )
    fails(r"--start=FILE:.*cannot read .*missing.txt", cell_dir, f"--start=FILE:{tmp_path / 'missing.txt'}")
    save_cell(tmp_path / "small", tmp_path / "data", vocab_size=64)
    fails(r"--start encodes to token id 82, beyond the model's vocab_size 64", tmp_path / "small", "--start=ROMEO")
    ckpt = torch.load(cell_dir / "ckpt.pt", weights_only=True)
    ckpt["config"]["model"]["n_embd"] = 32
    torch.save(ckpt, tmp_path / "other.pt")
    fails(r"other.pt: its model does not fit this model.py \(Error\(s\) in loading state_dict", tmp_path / "other.pt")


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--temperature=0", "--temperature=0.0 must be > 0"),
        ("--temperature=nan", "--temperature=nan must be > 0"),
        ("--num_samples=0", "--num_samples=0 must be >= 1"),
        ("--top_k=0", "--top_k=0 must be >= 1"),
        ("--max_new_tokens=x", "argument --max_new_tokens: invalid int value: 'x'"),
        ("--tempreature=1", "unrecognized arguments: --tempreature=1"),
        ("--device=gpu7", "--device=gpu7: "),
        ("--device=meta", "--device=meta: a meta device holds no values; use cpu or cuda"),
    ],
)
def test_bad_flags_are_one_line(cell, flag, message):
    with pytest.raises(SystemExit) as exit:
        sample.main([str(cell[0]), flag])
    assert exit.value.code.startswith(f"error: {message}") and "\n" not in exit.value.code
    assert exit.value.code.endswith("; see python sample.py --help")


def test_a_note_names_the_code_changed_since_the_cell_trained(cell, capsys):
    cell_dir, _ = cell  # a `standard` model
    code = records.code_record()

    def sample_under(definition):
        ckpt = torch.load(cell_dir / "ckpt.pt", weights_only=True)
        ckpt["config"]["code"] = dict(code, definitions=dict(code["definitions"], **{definition: "0" * 16}))
        torch.save(ckpt, cell_dir / "ckpt.pt")
        sample.main([str(cell_dir), "--num_samples=1", "--max_new_tokens=2", "--device=cpu"])
        return capsys.readouterr().err

    assert "code differs" not in sample_under("HyperConnections")  # a scheme the cell does not compute with
    assert "note: the code differs from the one the cell was trained with (GPT)" in sample_under("GPT")
