"""
The validation text (records.ValidationText): where its sequences lie in the validation shard, that the tuning's
never share a token with the reported ones, what the report says of them, and that the layout of grids made before
eval_layout ('first') is read exactly as those grids read it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_validation.py -q -p no:cacheprovider
"""

import hashlib

import numpy as np
import pytest

import records
from common import ConfigError
from train import DEFAULTS

EOT = 256  # the bytes tokenizer's end-of-text: each document begins with it (docs/shards.md)


def documents(lengths, seed=0):
    """A bytes-tokenized validation shard of documents of these lengths (each with its leading end-of-text)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.r_[EOT, rng.integers(0, 256, n - 1)] for n in lengths]).astype(np.uint16)


def positions(starts, T):
    return {int(s) + t for s in starts for t in range(T + 1)}


def test_first_is_the_layout_of_grids_made_before_eval_layout():
    val, T, E = (np.arange(5000) % 251).astype(np.uint16), 16, 1000
    n = (E - 1) // T
    test, tune = records.ValidationText(val, "bytes"), records.ValidationText(val, "bytes", part="tune")
    np.testing.assert_array_equal(test.rows(E, T, "first"), np.stack([val[j * T : j * T + T + 1] for j in range(n)]))
    np.testing.assert_array_equal(
        tune.rows(E, T, "first"), np.stack([val[E + j * T : E + j * T + T + 1] for j in range(n)])
    )
    # val_hash as those grids recorded it: the contiguous stretch evaluated, so their cells still pair and resume
    assert test.hash(E, T, "first") == hashlib.sha256(val[: n * T + 1]).hexdigest()
    assert tune.hash(E, T, "first") == hashlib.sha256(val[E : E + n * T + 1]).hexdigest()
    assert test.hash(E, T, "spread") != test.hash(E, T, "first")


@pytest.mark.parametrize("E, T", [(1000, 16), (8192, 128), (129, 128), (3000, 7)])
def test_spread_puts_one_sequence_in_each_of_2n_equal_stretches_and_tuning_never_reads_a_test_token(E, T):
    val = documents([4000, 300, 9000, 50, 2500, 7000])
    n, slots = (E - 1) // T, len(val) // (T + 1)
    test, tune = records.ValidationText(val, "bytes"), records.ValidationText(val, "bytes", part="tune")
    starts = {part: text.starts(E, T, "spread") for part, text in (("test", test), ("tune", tune))}
    assert len(starts["test"]) == len(starts["tune"]) == n
    assert not positions(starts["test"], T) & positions(starts["tune"], T)
    every = np.sort(np.concatenate(list(starts.values())))
    assert np.all(every % (T + 1) == 0) and every[-1] + T + 1 <= len(val)  # whole slots inside the shard
    middles = (np.arange(2 * n) + 0.5) * slots / (2 * n)  # the middle slot of each of 2n equal stretches
    assert np.all(np.abs(every // (T + 1) - middles) < 1) and len(set(every)) == 2 * n  # one start at each
    np.testing.assert_array_equal(np.sort(np.r_[starts["test"], starts["tune"]])[::2], starts["test"])  # alternate
    rows = test.rows(E, T, "spread")
    np.testing.assert_array_equal(rows, np.stack([val[s : s + T + 1] for s in starts["test"]]))


def read_per_document(begins, starts, T, is_byte):
    """{document: [bytes, sequences]} of the sequences at starts, counted token by token."""
    read = {}
    for s in starts:
        for doc in {int(np.searchsorted(begins, p, side="right") - 1) for p in range(s, s + T + 1)}:
            read.setdefault(doc, [0, 0])[1] += 1
        for p in range(s, s + T + 1):
            read[int(np.searchsorted(begins, p, side="right") - 1)][0] += int(is_byte[p])
    return read


def test_described_counts_the_documents_and_bytes_read():
    lengths, T, E = [4000, 300, 9000, 50, 2500, 7000], 16, 2000
    val = documents(lengths)
    text = records.ValidationText(val, "bytes")
    d = text.described(E, T, "spread")
    starts = text.starts(E, T, "spread")
    begins = np.cumsum([0] + lengths[:-1])
    read = read_per_document(begins, starts, T, val != EOT)
    assert d == dict(
        layout="spread",
        part="test",
        sequences=(E - 1) // T,
        tokens=(E - 1) // T * T,
        documents=len(read),
        held_out_documents=len(lengths),
        bytes=int(np.concatenate([val[s : s + T + 1] for s in starts]).__ne__(EOT).sum()),
        # an array in memory has no manifest beside it: its documents are counted, not named
        documents_read=[dict(name=None, bytes=b, sequences=n) for _, (b, n) in sorted(read.items())],
    )
    assert d["documents"] == 6  # the 50-token document too, at this density
    first = text.described(E, T, "first")
    assert first["documents"] == 1 and first["held_out_documents"] == 6  # the old layout: the first document only
    assert first["documents_read"] == [dict(name=None, bytes=first["bytes"], sequences=(E - 1) // T)]


@pytest.mark.parametrize("layout", ["spread", "first"])
def test_a_prepared_shard_names_each_document_read_with_its_bytes_and_sequences(tmp_path, layout):
    from data import prepare
    from data.shards import open_shard

    src, sizes = tmp_path / "src", {"b.txt": 2600, "c.txt": 400, "a.txt": 1000, "d.txt": 5000}
    src.mkdir()
    for name, size in sizes.items():
        (src / name).write_text(name[0] * size)
    prepare.prepare(
        str(tmp_path / "data"), input=str(src / "*.txt"), tokenizer="bytes", val_docs=3, workers=1, quiet=True
    )
    shard = open_shard(str(tmp_path / "data" / "val_000000.bin"))
    T, E = 64, 1500
    text = records.ValidationText(shard, "bytes")
    d = text.described(E, T, layout)
    held_out = ["a.txt", "b.txt", "c.txt"]  # the first three in sorted order
    begins = np.cumsum([0] + [sizes[n] + 1 for n in held_out[:-1]])
    read = read_per_document(begins, text.starts(E, T, layout), T, np.asarray(shard) != EOT)
    assert d["documents_read"] == [
        dict(name=held_out[doc], bytes=b, sequences=n) for doc, (b, n) in sorted(read.items())
    ]
    assert sum(r["bytes"] for r in d["documents_read"]) == d["bytes"] and d["held_out_documents"] == 3
    # spread reads all three; first reads a.txt and the start of b.txt
    assert [r["name"] for r in d["documents_read"]] == (held_out if layout == "spread" else held_out[:2])


def test_a_shard_too_short_for_both_sets_is_one_line():
    val = documents([1000])
    with pytest.raises(ConfigError, match=r"set --eval_tokens=465 or less, or give a longer validation shard$"):
        records.ValidationText(val, "bytes", part="tune").starts(1000, 16, "spread")  # 58 slots of 17: 29 each
    records.ValidationText(val, "bytes", part="tune").starts(465, 16, "spread")  # a frozen grid: tests/test_records.py


def test_a_grid_recorded_before_eval_layout_reads_as_first_and_refuses_spread(tmp_path):
    cfg = dict(DEFAULTS, out_dir=str(tmp_path), arms={"standard": {}}, seeds=[0])
    old = {k: v for k, v in cfg.items() if k != "eval_layout"}  # what train.py recorded before the key
    assert records.check_rerun("config.json", old, dict(cfg, eval_layout="first"), False) == {}
    with pytest.raises(ConfigError, match=r"other settings: eval_layout \('first' -> 'spread'\); rerun with"):
        records.check_rerun("config.json", old, dict(cfg, eval_layout="spread"), False)
    with pytest.raises(ConfigError, match=r"eval_layout='middle': choose spread .* or first"):
        records.check_config(dict(cfg, eval_layout="middle", data_dir="d"), 1)
