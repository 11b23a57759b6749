"""data/prepare.py: shards from the bundled corpus, local files and a (local) FineWeb-Edu download,
their manifest, tokenizer throughput, locks, temporaries and the one-line errors."""

import hashlib
import json
import os
import platform
import resource
import socket
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import DataError
from data import prepare as P
from data import shards as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def enc():
    return S.gpt2_tokenizer()


def test_known_token_ids(enc):
    # PROVENANCE.md's ids, the same as tiktoken.get_encoding("gpt2")
    assert enc.encode_ordinary("hello world") == [31373, 995]
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.encode_ordinary("First Citizen:\nBefore we proceed any further, hear me speak.") == [
        5962,
        22307,
        25,
        198,
        8421,
        356,
        5120,
        597,
        2252,
        11,
        3285,
        502,
        2740,
        13,
    ]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [S.GPT2.eot]


def test_tokenizers_encode_and_decode():
    text = "ROMEO: caf\u00e9 \u2014 <|endoftext|> as text\n"
    b = S.get_tokenizer("bytes")
    assert list(b.encode(text)) == list(text.encode("utf-8")) and b.vocab_size == 257 and b.eot == 256
    assert b.decode(list(b.encode(text))) == text
    assert b.decode([256, 104, 105]) == "<|endoftext|>hi"
    assert b.decode([0xC3, 104]) == "\ufffdh"  # half a UTF-8 character
    assert b.decode([104, 300, 105]) == "h\ufffdi"  # a padding id of a 320-row model
    g = S.get_tokenizer("gpt2")
    assert g.vocab_size == 50257 and g.eot == 50256
    assert g.decode(g.encode(text)) == text and g.decode([31373, 995, 50256, 50300]) == "hello world<|endoftext|>\ufffd"
    with pytest.raises(DataError, match="unknown tokenizer 'bpe'; choose one of bytes, gpt2"):
        S.get_tokenizer("bpe")


def make_corpus(tmp_path):
    """Documents in three formats; returns the glob and the documents in input order."""
    src = tmp_path / "src"
    src.mkdir()
    words = "the quick brown fox jumps over a lazy dog while Shakespeare writes sonnets".split()
    rng = np.random.default_rng(0)
    doc = lambda: " ".join(rng.choice(words, size=int(rng.integers(5, 120))))
    a = [doc() for _ in range(37)]
    pq.write_table(pa.table({"text": a, "id": list(range(37))}), src / "a.parquet", row_group_size=5)
    b = [doc() for _ in range(11)]
    # blank lines are not documents (and must not shift a resume position)
    (src / "b.jsonl").write_text(
        "".join(json.dumps({"text": t, "n": 1}) + "\n" + "\n" * (i % 3 == 0) for i, t in enumerate(b))
    )
    # a literal <|endoftext|> in a document is text, not the separator
    c = doc() + "\n\nunicode: caf\u00e9 \u2014 na\u00efve; <|endoftext|> as text"
    (src / "c.txt").write_text(c, encoding="utf-8")
    return str(src / "*"), a + b + [c]


def stream_of(out_dir):
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return manifest, np.concatenate([S.open_shard(str(out_dir / s["name"])) for s in manifest["shards"]])


def expected_stream(enc, docs):
    return np.array([t for d in docs for t in [S.GPT2.eot] + enc.encode_ordinary(d)], dtype=np.uint16)


def byte_stream(docs):
    return np.array([t for d in docs for t in [256] + list(d.encode("utf-8"))], dtype=np.uint16)


BYTES = dict(tokenizer="bytes", workers=1, quiet=True)  # most tests: the tokenizer is not what they test


def test_shards_concatenate_to_the_documents_in_order(tmp_path, enc):
    pattern, docs = make_corpus(tmp_path)
    out = tmp_path / "out"
    P.prepare(str(out), input=pattern, val_tokens=333, shard_tokens=1100, workers=1, quiet=True)
    manifest, stream = stream_of(out)
    assert np.array_equal(stream, expected_stream(enc, docs))
    sizes = [s["tokens"] for s in manifest["shards"]]
    assert sizes[0] == 333 and all(n == 1100 for n in sizes[1:-1]) and 0 < sizes[-1] <= 1100 and len(sizes) > 3
    assert [s["name"] for s in manifest["shards"][:2]] == ["val_000000.bin", "train_000001.bin"]
    assert manifest["total_tokens"] == len(stream) and manifest["tokenizer_sha256"] == S.TOKENIZER_SHA256
    for s in manifest["shards"]:
        assert hashlib.sha256(np.asarray(S.open_shard(str(out / s["name"]))).tobytes()).hexdigest() == s["sha256"]
    assert not (out / "progress.json").exists() and not list(out.glob("*.tmp"))


def test_val_docs_and_max_tokens(tmp_path):
    pattern, docs = make_corpus(tmp_path)
    out = tmp_path / "out"
    P.prepare(str(out), input=pattern, val_docs=4, shard_tokens=3000, max_tokens=15000, **BYTES)
    manifest, stream = stream_of(out)
    assert manifest["val_tokens"] == len(byte_stream(docs[:4]))  # whole documents
    assert np.array_equal(stream, byte_stream(docs)[:15000])


def test_held_out_documents_too_short_for_one_validation_sequence_are_one_line(tmp_path):
    # issue #66: a 10-byte first document held out alone made an 11-token validation shard, and nothing said so
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("ten bytes.")
    (src / "b.txt").write_text("x" * 1013)  # with a's 11 tokens: exactly one sequence of 1,024 and its target
    (src / "c.txt").write_text("y" * 5000)
    out = tmp_path / "out"
    with pytest.raises(DataError) as e:
        P.prepare(str(out), input=str(src / "*.txt"), val_docs=1, shard_tokens=2000, **BYTES)
    assert str(e.value) == (
        "--val_docs=1 holds out 11 tokens, fewer than one validation sequence of the paper configs' 1,024 tokens "
        "and its target (1,025); raise --val_docs, or give --val_tokens instead"
    )
    assert sorted(os.listdir(out)) == []  # no shard, no progress record: the same folder takes other arguments
    manifest = P.prepare(str(out), input=str(src / "*.txt"), val_docs=2, shard_tokens=2000, **BYTES)
    assert manifest["val_tokens"] == 1025  # a short document among the held-out ones is fine: sequences span them


def test_the_held_out_documents_are_named_in_the_validation_shards_order(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name, size in (("x.txt", 800), ("w.txt", 700), ("sub/b.txt", 600), ("z.txt", 3000)):
        (src / name).write_text(name[-5] * size)
    held_out = ["sub/b.txt", "w.txt", "x.txt"]  # the first three paths in sorted order, below the inputs' folder
    by_docs = P.prepare(str(tmp_path / "docs"), input=str(src / "**" / "*.txt"), val_docs=3, shard_tokens=2000, **BYTES)
    assert P.held_out_names(by_docs, str(tmp_path / "docs")) == held_out
    assert P.held_out_names_in(str(tmp_path / "docs")) == held_out
    # --val_tokens cuts x.txt: it is held out too, its rest trained on
    by_tokens = P.prepare(str(tmp_path / "tokens"), input=str(src / "**" / "*.txt"), val_tokens=2000, **BYTES)
    assert by_tokens["shards"][1]["start"] == [2, 0, 2000 - 601 - 701]
    assert P.held_out_names(by_tokens, str(tmp_path / "tokens")) == held_out
    assert P.held_out_names_in(str(tmp_path / "src")) is None, "shards made elsewhere: no manifest, no names"


def test_held_out_rows_are_named_by_file_and_row_where_the_file_counts_them(tmp_path):
    pattern, docs = make_corpus(tmp_path)  # a.parquet (37 rows), b.jsonl (11), c.txt
    out = tmp_path / "out"
    manifest = P.prepare(str(out), input=pattern, val_docs=40, shard_tokens=3000, **BYTES)
    names = [f"a.parquet row {r}" for r in range(37)] + [f"b.jsonl row {r}" for r in range(3)]
    assert P.held_out_names(manifest, str(out)) == names
    (tmp_path / "src" / "b.jsonl").unlink()  # the file the shard ends in: its rows follow from the manifest alone
    assert P.held_out_names(manifest, str(out)) == names
    pq.write_table(pa.table({"text": ["other"] * 37}), tmp_path / "src" / "a.parquet")
    assert P.held_out_names(manifest, str(out)) is None, "a file held out whole, changed: its rows cannot be counted"
    topics = tmp_path / "topics.jsonl"
    topics.write_text("".join(json.dumps(dict(topic=f"t{i}", text="x" * 600)) + "\n" for i in range(4)))
    manifest = P.prepare(str(tmp_path / "topics"), input=str(topics), val_docs=2, shard_tokens=2000, **BYTES)
    assert P.held_out_names(manifest, str(tmp_path / "topics")) == ["t0", "t1"], "a row's topic, the pydoc corpus's"


def test_byte_shards_say_their_tokenizer(tmp_path):
    pattern, docs = make_corpus(tmp_path)
    out = tmp_path / "out"
    P.prepare(str(out), input=pattern, val_tokens=2000, shard_tokens=6000, **BYTES)
    manifest, stream = stream_of(out)
    assert np.array_equal(stream, byte_stream(docs))
    assert manifest["tokenizer"] == "bytes" and manifest["tokenizer_sha256"] is None
    header = np.fromfile(out / "train_000001.bin", dtype="<i4", count=256)
    assert list(header[:4]) == [20240520, 1, 6000, 257] and not header[4:].any()
    assert S.tokenizer_of(str(out)) == "bytes"
    with pytest.raises(DataError, match="other arguments"):
        P.prepare(str(out), input=pattern, val_tokens=2000, shard_tokens=6000, tokenizer="gpt2", workers=1, quiet=True)


def test_workers_do_not_change_the_output(tmp_path):
    pattern, _ = make_corpus(tmp_path)
    P.TASK_CHARS, old = 200, P.TASK_CHARS  # many small tasks, so two workers really interleave
    try:
        for w in (1, 2):
            P.prepare(
                str(tmp_path / f"w{w}"), input=pattern, val_tokens=1800, shard_tokens=4200, **BYTES | dict(workers=w)
            )
    finally:
        P.TASK_CHARS = old
    m1, m2 = (json.loads((tmp_path / f"w{w}" / "manifest.json").read_text()) for w in (1, 2))
    assert m1["shards"] == m2["shards"] and len(m1["shards"]) > 3


@pytest.mark.parametrize("die_at", [4, 6])  # resumes inside the parquet file, then inside the jsonl file
def test_interrupted_run_resumes_byte_identical(tmp_path, monkeypatch, die_at):
    pattern, _ = make_corpus(tmp_path)
    args = dict(input=pattern, val_tokens=2000, shard_tokens=3600, **BYTES)
    P.prepare(str(tmp_path / "whole"), **args)

    out = tmp_path / "killed"
    real_close = P.ShardFile.close
    prepare_dying(monkeypatch, out, args, die_at)
    assert (out / f"train_{die_at - 1:06d}.bin.tmp").exists()

    resumed = []
    monkeypatch.setattr(P.ShardFile, "close", lambda shard: (resumed.append(shard.path), real_close(shard))[1])
    P.prepare(str(out), **args)
    assert os.path.basename(resumed[0]) == f"train_{die_at - 1:06d}.bin"  # earlier shards were not redone
    names = sorted(p.name for p in (tmp_path / "whole").glob("*.bin"))
    assert names == sorted(p.name for p in out.glob("*.bin"))
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (out / name).read_bytes()
    assert not list(out.glob("*.tmp"))
    P.prepare(str(out), **args)  # complete: nothing is redone
    assert len(resumed) == len(names) - (die_at - 1)
    with pytest.raises(DataError, match="other arguments"):
        P.prepare(str(out), **{**args, "shard_tokens": 4200})


def test_bad_shards_name_the_file_and_problem(tmp_path):
    good = tmp_path / "good.bin"
    S.write_shard(str(good), np.arange(100, dtype=np.uint16))
    assert np.array_equal(S.open_shard(str(good)), np.arange(100))
    raw = good.read_bytes()
    cases = {
        "truncated.bin": (raw[:-10], "truncated or corrupt"),
        "short.bin": (raw[:100], "truncated header"),
        "magic.bin": (b"\x00\x00\x00\x01" + raw[4:], "bad magic"),
        "version.bin": (raw[:4] + (7).to_bytes(4, "little") + raw[8:], "unsupported version 7"),
    }
    for name, (content, problem) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=problem) as err:
            S.open_shard(str(tmp_path / name))
        assert name in str(err.value)
    with pytest.raises(DataError, match="no such shard"):
        S.open_shard(str(tmp_path / "missing.bin"))


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="matches no files"):
        P.prepare(str(tmp_path / "o1"), input=str(tmp_path / "nothing*.txt"), **BYTES)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "x.parquet")
    with pytest.raises(DataError, match="no 'text' column"):
        P.prepare(str(tmp_path / "o2"), input=str(tmp_path / "x.parquet"), **BYTES)
    (tmp_path / "y.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="y.jsonl:2"):
        P.prepare(str(tmp_path / "o3"), input=str(tmp_path / "y.jsonl"), **BYTES)
    (tmp_path / "z.txt").write_text("tiny")
    with pytest.raises(DataError, match="too few tokens"):
        P.prepare(str(tmp_path / "o4"), input=str(tmp_path / "z.txt"), **BYTES)
    with pytest.raises(DataError, match="unknown tokenizer 'bpe'"):
        P.prepare(str(tmp_path / "o5"), input=str(tmp_path / "z.txt"), tokenizer="bpe")
    assert not (tmp_path / "o5").exists()


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_fineweb_offline_fails_fast_with_one_line(tmp_path, env):
    # HF_HUB_OFFLINE, or a hub that cannot be reached (a closed local port stands in for no network)
    full_env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | env
    proc = subprocess.run(
        [sys.executable, "data/prepare.py", "--tokenizer=bytes", "--out_dir", str(tmp_path / "fw")],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "--input" in proc.stderr and "shakespeare" in proc.stderr


def test_bundled_corpus_prepares_the_same_from_any_working_directory(tmp_path, monkeypatch, capsys):
    assert S.BUNDLED == {
        os.path.join(ROOT, "data", f"{corpus}_{t}"): t for corpus in ("shakespeare", "pydoc") for t in ("bytes", "gpt2")
    }
    monkeypatch.chdir(tmp_path)
    manifest = P.prepare_bundled(str(tmp_path / "sh"), "bytes", quiet=True)
    plays = [
        open(os.path.join(P.BUNDLED_CORPUS, p), encoding="utf-8").read() for p in sorted(os.listdir(P.BUNDLED_CORPUS))
    ]
    assert manifest["val_tokens"] == len(byte_stream(plays[:3]))  # three whole plays
    assert manifest["total_tokens"] == len(byte_stream(plays)) and manifest["tokenizer"] == "bytes"
    monkeypatch.chdir(ROOT)
    assert P.prepare_bundled(str(tmp_path / "sh"), "bytes") == manifest  # the same arguments and inputs: complete
    assert "complete" in capsys.readouterr().out
    with pytest.raises(DataError, match="not one of the bundled outputs"):
        P.prepare_bundled(str(tmp_path / "elsewhere"))


def test_bundled_outputs_are_prepared_with_their_corpus_and_tokenizer(monkeypatch):
    made = []
    monkeypatch.setattr(
        P, "prepare", lambda out_dir, **kw: made.append((out_dir, kw["input"], kw["tokenizer"], kw["val_docs"]))
    )
    for out_dir, tokenizer in S.BUNDLED.items():
        P.prepare_bundled(out_dir)
    topics = os.path.join(ROOT, "data", "pydoc", f"topics_python{platform.python_version()}.jsonl")
    assert made == [
        (d, topics, t, 20) if "pydoc" in d else (d, os.path.join(P.BUNDLED_CORPUS, "*.txt"), t, 3)
        for d, t in S.BUNDLED.items()
    ]


def test_the_second_bundled_corpus_is_pythons_documentation_named_by_its_version(tmp_path, monkeypatch):
    from pydoc_data.topics import topics

    manifest = P.prepare_bundled(str(tmp_path / "pydoc_bytes"), "bytes", quiet=True, corpus="pydoc")
    texts = [topics[name] for name in sorted(topics)]
    assert manifest["val_tokens"] == len(byte_stream(texts[:20]))  # 20 whole topics
    assert manifest["total_tokens"] == len(byte_stream(texts))
    assert manifest["inputs"][0][0].endswith(f"topics_python{platform.python_version()}.jsonl")  # which Python made it
    assert P.held_out_names(manifest, str(tmp_path / "pydoc_bytes")) == sorted(topics)[:20], "named by topic"
    again = P.prepare_bundled(str(tmp_path / "again"), "bytes", quiet=True, corpus="pydoc")
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]  # deterministic bytes
    monkeypatch.setattr(S, "BUNDLED", {str(tmp_path / "gone" / "pydoc_bytes"): "bytes"})
    with pytest.raises(
        DataError, match="does not exist; create it with: python data/prepare.py pydoc --tokenizer=bytes$"
    ):
        S.find_shards(str(tmp_path / "gone" / "pydoc_bytes"))


def write_llmc_shard(path, tokens):
    """llm.c's / modded-nanogpt's write_datafile, written independently of prepare.py."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def test_foreign_shards_are_found_and_read(tmp_path):
    rng = np.random.default_rng(0)
    shards = {i: rng.integers(0, 50257, size=100 + i).astype(np.uint16) for i in range(3)}
    llmc, nanogpt = tmp_path / "modded", tmp_path / "build"
    llmc.mkdir(), nanogpt.mkdir()
    for i, tokens in shards.items():
        split = "val" if i == 0 else "train"
        write_llmc_shard(llmc / f"fineweb_{split}_{i:06d}.bin", tokens)
        np.save(nanogpt / f"edufineweb_{split}_{i:06d}", tokens)  # build-nanogpt's np.save of a uint16 array
    (nanogpt / "notes.txt").write_text("not a shard")
    for d, ext in ((llmc, ".bin"), (nanogpt, ".npy")):
        val, train = S.find_shards(str(d))
        assert os.path.basename(val) == f"{'fineweb' if ext == '.bin' else 'edufineweb'}_val_000000{ext}"
        assert [os.path.basename(p)[-10:] for p in train] == [f"000001{ext}", f"000002{ext}"]
        for path, i in zip([val] + train, range(3)):
            tokens = S.open_shard(path, vocab_size=50257)
            assert np.array_equal(tokens, shards[i]) and not tokens.flags.writeable
        assert S.verify_manifest(str(d)) is None  # made elsewhere: accepted after the header checks


def test_find_shards_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        S.find_shards(str(tmp_path / "nothing"))
    monkeypatch.setattr(S, "BUNDLED", {str(tmp_path / "bundled"): "bytes"})
    with pytest.raises(
        DataError, match="does not exist; create it with: python data/prepare.py shakespeare --tokenizer=bytes$"
    ):
        S.find_shards(str(tmp_path / "bundled"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is a file"):
        S.find_shards(str(tmp_path / "file"))
    with pytest.raises(DataError, match=r"found 0 \(none\) and 0.*data/prepare.py"):
        S.find_shards(str(tmp_path))
    for name in ("val_000000.bin", "val_000002.bin", "train_000001.bin"):
        S.write_shard(str(tmp_path / name), np.arange(10))
    with pytest.raises(DataError, match=r"found 2 \(val_000000.bin, val_000002.bin\)"):
        S.find_shards(str(tmp_path))


@pytest.mark.parametrize(
    "names, named",
    [
        (
            ["val_000000.bin", "train_000001.bin", "fineweb_train_000001.bin"],
            "fineweb_train_000001.bin, train_000001.bin;",
        ),
        (["val_000000.bin", "fineweb_val_000000.bin", "train_000001.bin"], "fineweb_val_000000.bin, train_000001.bin;"),
        (
            ["edufineweb_val_000000.npy", "edufineweb_train_000001.bin"],
            "edufineweb_train_000001.bin, edufineweb_val_000000.npy;",
        ),
    ],
)
def test_two_naming_schemes_in_one_data_dir_are_refused(tmp_path, names, named):
    # without a manifest nothing says which files belong together: two schemes are likely the same data twice
    for name in names:
        S.write_shard(str(tmp_path / name), np.arange(10))
    with pytest.raises(DataError) as err:
        S.find_shards(str(tmp_path))
    assert str(err.value) == f"data_dir {tmp_path}: found shards of 2 kinds: {named} keep one kind per data_dir"


def test_unreadable_shard_files_are_one_line_naming_the_file(tmp_path, monkeypatch):
    (tmp_path / "edufineweb_val_000000.npy").write_bytes(b"")  # 0 bytes: numpy's EOFError
    (tmp_path / "train_000001.bin").mkdir()  # a directory: IsADirectoryError
    for name in ("edufineweb_val_000000.npy", "train_000001.bin"):
        with pytest.raises(DataError, match="cannot be read as a token shard") as err:
            S.open_shard(str(tmp_path / name))
        assert f"{tmp_path / name}: " in str(err.value) and "\n" not in str(err.value)
    S.write_shard(str(tmp_path / "val_000000.bin"), np.arange(10))

    def failing_read(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(np, "fromfile", failing_read)
    with pytest.raises(DataError, match=r"val_000000.bin: cannot be read as a token shard \(Input/output error\)"):
        S.open_shard(str(tmp_path / "val_000000.bin"))


def test_token_ids_beyond_the_vocabulary_name_the_shard(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens[700] = 60000
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", tokens)
    np.save(tmp_path / "edufineweb_train_000001", tokens)
    for name in ("fineweb_train_000001.bin", "edufineweb_train_000001.npy"):
        path = str(tmp_path / name)
        assert len(S.open_shard(path)) == 1000 and len(S.open_shard(path, vocab_size=60001)) == 1000
        with pytest.raises(DataError, match=f"{name}: token id 60000 at position 700 is >= vocab_size 60000"):
            S.open_shard(path, vocab_size=60000)
    np.save(tmp_path / "wide_train_000001", tokens.astype(np.int32))
    with pytest.raises(DataError, match="1-d int32 array"):
        S.open_shard(str(tmp_path / "wide_train_000001.npy"))
    (tmp_path / "junk_train_000001.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="junk_train_000001.npy: cannot be read as a token shard"):
        S.open_shard(str(tmp_path / "junk_train_000001.npy"))


def test_token_ids_the_data_tokenizer_does_not_have_are_refused(tmp_path):
    # ids a padded model embeds (bytes 257-319 under vocab_size 320, GPT-2's 50257-50303 under 50304) that no
    # tokenizer made: in headered shards, and under a manifest whose sha256s agree (verify_shards passes)
    for tokenizer, bad in (("bytes", 300), ("gpt2", 50300)):
        tokens = np.arange(1000, dtype=np.uint16) % 200
        tokens[700:] = bad
        path = str(tmp_path / f"{tokenizer}_train_000001.bin")
        S.write_shard(path, tokens, tokenizer)
        assert S.shard_tokenizer(path) == tokenizer and len(S.open_shard(path, 50304)) == 1000
        ids = S.TOKENIZERS[tokenizer].vocab_size
        with pytest.raises(
            DataError,
            match=rf"^{path}: token id {bad} at position 700 is not a {tokenizer} token "
            rf"\(its ids are 0-{ids - 1}\), the tokenizer its data names",
        ):
            S.open_shard(path, 50304, tokenizer)
        S.write_shard(path, tokens[:700], tokenizer)
        assert len(S.open_shard(path, 50304, tokenizer)) == 700
    pattern, _ = make_corpus(tmp_path)
    out = tmp_path / "out"
    P.prepare(str(out), input=pattern, val_tokens=2000, shard_tokens=6000, **BYTES)
    manifest = json.loads((out / "manifest.json").read_text())
    train1 = str(out / "train_000001.bin")
    tokens = np.array(S.open_shard(train1))
    tokens[123] = 319
    manifest["shards"][1]["sha256"] = S.write_shard(train1, tokens, "bytes")
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert S.verify_manifest(str(out), full=True)
    import train

    argv = [
        f"--data_dir={out}",
        f"--out_dir={tmp_path / 'o'}",
        "--vocab_size=320",
        "--verify_shards=True",
        "--device=cpu",
        "--eval_tokens=1000",
    ]
    with pytest.raises(
        DataError, match=rf"^{train1}: token id 319 at position 123 is not a bytes token \(its ids are 0-256\)"
    ):
        train.main(argv)
    assert not (tmp_path / "o").exists()


def test_manifest_catches_changed_extra_missing_and_truncated_shards(tmp_path):
    pattern, _ = make_corpus(tmp_path)
    out = tmp_path / "out"
    P.prepare(str(out), input=pattern, val_tokens=333, shard_tokens=1100, **BYTES)
    assert S.verify_manifest(str(out), full=True)["shards"][0]["name"] == "val_000000.bin"
    train1 = out / "train_000001.bin"
    original = train1.read_bytes()

    def fails(match, full=False):
        with pytest.raises(DataError, match=match):
            S.verify_manifest(str(out), full=full)

    overwritten = bytearray(original)
    overwritten[2000:2010] = b"\x01" * 10  # same size, other tokens: only the full check sees it
    train1.write_bytes(bytes(overwritten))
    S.verify_manifest(str(out))
    fails(r"train_000001.bin: its tokens differ from manifest.json \(sha256\); re-run data/prepare.py", full=True)
    S.write_shard(str(train1), np.arange(600), "bytes")  # a valid shard of another size
    fails("train_000001.bin holds 600 tokens, manifest.json lists 1,100; re-run data/prepare.py")
    train1.write_bytes(original[:-2])
    fails("train_000001.bin: size .* truncated or corrupt")
    train1.unlink()
    fails("train_000001.bin is listed in manifest.json but missing; re-run data/prepare.py")
    S.write_shard(str(train1), np.frombuffer(original[1024:], dtype="<u2"), "gpt2")  # the same tokens, marked GPT-2
    fails("train_000001.bin holds gpt2 tokens, manifest.json says bytes")
    train1.write_bytes(original)
    S.verify_manifest(str(out), full=True)
    np.save(out / "edufineweb_train_000009", np.arange(10, dtype=np.uint16))
    fails("edufineweb_train_000009.npy is not listed in manifest.json")


def write_parquet(path, rows, groups):
    """rows in row groups of the given sizes (each write_table call is one row group)."""
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for start, n in zip(np.cumsum([0] + groups[:-1]), groups):
            writer.write_table(pa.table({"text": rows[start : start + n]}))
    assert [pq.ParquetFile(path).metadata.row_group(g).num_rows for g in range(len(groups))] == groups


def test_reading_from_any_position_yields_the_tail_of_the_stream(tmp_path):
    # uneven row groups (a short last one is the usual shape), a group spanning several 1024-row
    # record batches, many small groups; jsonl with blank lines; txt
    shapes = {"a.parquet": [500, 500, 288], "b.parquet": [1, 1000, 3], "c.parquet": [2100], "d.parquet": [7] * 40}
    stream = []  # (file index, row, text): the uninterrupted stream, built without prepare.py
    for f, (name, groups) in enumerate(shapes.items()):
        rows = [f"{name} row {i}" for i in range(sum(groups))]
        write_parquet(str(tmp_path / name), rows, groups)
        stream += [(f, i, t) for i, t in enumerate(rows)]
    rows = [f"line {i}" for i in range(30)]
    (tmp_path / "e.jsonl").write_text(
        "\n" + "".join(json.dumps({"text": t}) + "\n" + "\n" * (i % 4 == 0) for i, t in enumerate(rows))
    )
    stream += [(4, i, t) for i, t in enumerate(rows)]
    (tmp_path / "f.txt").write_text("the whole file")
    stream += [(5, 0, "the whole file")]
    paths = [lambda p=p: p for p in sorted(str(p) for p in tmp_path.iterdir())]

    first_of_file = {}
    for i, (f, row, _) in enumerate(stream):
        first_of_file.setdefault(f, i)
    starts = {(f, 0) for f in range(6)} | {(5, 1)}  # every file start, and past the end of the last file
    for f, (name, groups) in enumerate(shapes.items()):
        ends = np.cumsum(groups)
        starts |= {(f, int(s)) for e in ends for s in (e - 1, e, e + 1) if s <= ends[-1]}  # around each group end
        starts |= {(f, s) for s in range(0, ends[-1], 11)}
        starts |= {(f, s) for s in (1023, 1024, 1025, 2047, 2048, 2049) if s <= ends[-1]}  # around batch ends
    starts |= {(4, s) for s in range(31)}
    for f, s in sorted(starts):
        expected = stream[first_of_file[f] + s :] if (f, s) != (5, 1) else []
        assert list(P.read_documents(paths, f, s)) == expected, (f, s)


def uneven_parquet_corpus(tmp_path):
    """Four parquet files with row groups [50, 50, 28]: a resume at rows 28-49 or 78-99 of a file hits
    the groups a wrong row-group skip drops."""
    src = tmp_path / "src"
    src.mkdir()
    words = "the quick brown fox jumps over a lazy dog while Shakespeare writes sonnets".split()
    rng = np.random.default_rng(1)
    for f in range(4):
        rows = [" ".join(rng.choice(words, size=int(rng.integers(3, 25)))) for _ in range(128)]
        write_parquet(str(src / f"part{f}.parquet"), rows, [50, 50, 28])
    return str(src / "*.parquet")


def prepare_dying(monkeypatch, out, args, die_at):
    """prepare() killed while closing its die_at-th shard: the tokens are in the temporary file, not renamed."""
    real_close, calls = P.ShardFile.close, []

    def dying_close(shard):
        calls.append(shard.path)
        if len(calls) == die_at:
            raise KeyboardInterrupt
        return real_close(shard)

    monkeypatch.setattr(P.ShardFile, "close", dying_close)
    with pytest.raises(KeyboardInterrupt):
        P.prepare(str(out), **args)
    monkeypatch.setattr(P.ShardFile, "close", real_close)
    assert (out / "progress.json").exists() and not (out / "manifest.json").exists()


def assert_same_shards(a, b, at_least=6):
    names = sorted(p.name for p in a.glob("*.bin"))
    assert names == sorted(p.name for p in b.glob("*.bin")) and len(names) >= at_least
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not list(b.glob("*.tmp"))


def test_resume_after_any_interruption_in_uneven_row_groups(tmp_path, monkeypatch):
    args = dict(input=uneven_parquet_corpus(tmp_path), val_tokens=2800, shard_tokens=4000, **BYTES)
    whole = tmp_path / "whole"
    n_shards = len(P.prepare(str(whole), **args)["shards"])
    for die_at in range(2, n_shards + 1):  # every shard boundary a resume can start from
        out = tmp_path / f"killed{die_at}"
        prepare_dying(monkeypatch, out, args, die_at)
        P.prepare(str(out), **args)
        assert_same_shards(whole, out)
    assert json.loads((out / "manifest.json").read_text()) == json.loads((whole / "manifest.json").read_text())


def test_two_interruptions_in_a_row(tmp_path, monkeypatch):
    args = dict(input=uneven_parquet_corpus(tmp_path), val_tokens=2800, shard_tokens=4000, **BYTES)
    P.prepare(str(tmp_path / "whole"), **args)
    out = tmp_path / "killed"
    prepare_dying(monkeypatch, out, args, 3)
    prepare_dying(monkeypatch, out, args, 4)  # the resumed run dies too, four shards further on
    assert len(json.loads((out / "progress.json").read_text())["shards"]) == 2 + 3
    P.prepare(str(out), **args)
    assert_same_shards(tmp_path / "whole", out)


def test_resume_stops_when_the_input_files_changed(tmp_path, monkeypatch):
    pattern = uneven_parquet_corpus(tmp_path)
    args = dict(input=pattern, val_tokens=2800, shard_tokens=4000, **BYTES)
    out = tmp_path / "out"
    prepare_dying(monkeypatch, out, args, 4)
    src = tmp_path / "src"
    write_parquet(str(src / "part1b.parquet"), ["a new file"], [1])  # sorts into the middle of the list
    with pytest.raises(DataError, match=r"input files differ .*\(\.\./src/part1b.parquet is new\)"):
        P.prepare(str(out), **args)
    (src / "part1b.parquet").unlink()
    (src / "part3.parquet").rename(tmp_path / "away.parquet")
    with pytest.raises(DataError, match="part3.parquet is gone"):
        P.prepare(str(out), **args)
    (tmp_path / "away.parquet").rename(src / "part3.parquet")
    P.prepare(str(out), **args)  # the same files again: the resume goes on
    assert (out / "manifest.json").exists()


def test_complete_output_is_verified_and_repaired(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P, "TASK_CHARS", 200)  # a rebuilt shard spans several tokenizer tasks
    pattern, _ = make_corpus(tmp_path)
    args = dict(input=pattern, val_tokens=2000, shard_tokens=3600, tokenizer="bytes", workers=1)
    out = tmp_path / "out"
    P.prepare(str(out), quiet=True, **args)
    whole = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    capsys.readouterr()

    overwritten = bytearray(whole["train_000002.bin"])
    overwritten[3000:3010] = b"\x01" * 10  # same size: only the sha256 sees it
    (out / "train_000002.bin").write_bytes(bytes(overwritten))
    (out / "train_000004.bin").unlink()
    (out / "val_000000.bin").write_bytes(whole["val_000000.bin"][:-2])
    P.prepare(str(out), **args)
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines()] == [
        "rebuilding val_000000.bin",
        "rebuilding train_000002.bin",
        "rebuilding train_000004.bin",
    ]
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == whole and not list(out.glob("*.tmp"))
    P.prepare(str(out), **args)
    assert "complete" in capsys.readouterr().out

    S.write_shard(str(out / "train_000099.bin"), np.arange(5))
    with pytest.raises(DataError, match="train_000099.bin is not listed in manifest.json"):
        P.prepare(str(out), **args)
    (out / "train_000099.bin").unlink()
    (out / "train_000001.bin").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(
        json.dumps({**manifest, "shards": [{k: v for k, v in s.items() if k != "start"} for s in manifest["shards"]]})
    )  # as an older prepare.py wrote it
    with pytest.raises(DataError, match="train_000001.bin is listed in manifest.json but missing.*older prepare.py"):
        P.prepare(str(out), **args)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with open(tmp_path / "src" / "c.txt", "a") as f:
        f.write("changed")
    with pytest.raises(DataError, match=r"input files differ .*c.txt was \d+ bytes, now"):
        P.prepare(str(out), **args)


def test_bad_rows_and_files_name_where(tmp_path):
    def fails(name, content, match):
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else content(str(path))
        with pytest.raises(DataError, match=match):
            P.prepare(str(tmp_path / ("out_" + name)), input=str(path), **BYTES)
        assert not list((tmp_path / ("out_" + name)).glob("*.bin"))

    fails("null.jsonl", b'{"text": "fine"}\n\n{"text": null}\n', r"null.jsonl:3: 'text' is null, not a string")
    fails("number.jsonl", b'{"text": 7}\n', r"number.jsonl:1: 'text' is 7, not a string")
    fails("latin1.jsonl", '{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"), r"latin1.jsonl:2: not UTF-8")
    fails("latin1.txt", ("x" * 70000 + "caf\u00e9").encode("latin-1"), r"latin1.txt: not UTF-8 text \(byte 70003")
    fails(
        "ints.parquet",
        lambda p: pq.write_table(pa.table({"text": [1, 2]}), p),
        r"ints.parquet: column 'text' holds int64",
    )
    fails(
        "nulls.parquet",
        lambda p: write_parquet(p, ["a", "b", "c", None, "e"], [2, 3]),
        r"nulls.parquet: row 3: 'text' is null",
    )


def test_out_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("x")
    (tmp_path / "a.txt").write_text("some text")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "data", "prepare.py"),
            "--input",
            str(tmp_path / "a.txt"),
            "--tokenizer=bytes",
            "--out_dir",
            str(tmp_path / "taken"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 1 and proc.stderr == f"error: out_dir {tmp_path / 'taken'} is a file; choose a directory\n"
    )


def test_torn_or_foreign_manifests_are_one_line(tmp_path):
    out, pattern = tmp_path / "out", make_corpus(tmp_path)[0]
    P.prepare(str(out), input=pattern, val_tokens=2000, shard_tokens=9000, **BYTES)
    good = (out / "manifest.json").read_text()
    manifest = json.loads(good)
    cases = [
        (good[: len(good) // 2], r"cannot be read as JSON \(.*line"),
        (json.dumps([1, 2]), r"missing or wrong: arguments, inputs, tokenizer"),
        (json.dumps({k: v for k, v in manifest.items() if k != "shards"}), r"missing or wrong: shards\)"),
        (json.dumps({**manifest, "shards": {"name": "val_000000.bin"}}), r"missing or wrong: shards\)"),
        (json.dumps({**manifest, "shards": [{**manifest["shards"][0], "tokens": "2000"}]}), r"shards\[0\]"),
        (json.dumps({**manifest, "tokenizer": "bpe"}), r"tokenizer 'bpe'"),
    ]
    for text, problem in cases:
        (out / "manifest.json").write_text(text)
        for read in (S.verify_manifest, S.tokenizer_of, lambda d: P.prepare(d, input=pattern, **BYTES)):
            with pytest.raises(DataError, match=problem) as err:
                read(str(out))
            assert str(err.value).startswith(f"{out / 'manifest.json'} ") and "\n" not in str(err.value)
            assert "run data/prepare.py again" in str(err.value)
    (out / "manifest.json").write_text(good)
    assert S.verify_manifest(str(out)) == manifest


def test_shards_of_two_tokenizers_are_refused(tmp_path):
    S.write_shard(str(tmp_path / "val_000000.bin"), np.arange(10), "gpt2")
    S.write_shard(str(tmp_path / "train_000001.bin"), np.arange(10), "gpt2")
    assert S.tokenizer_of(str(tmp_path)) == "gpt2"
    S.write_shard(str(tmp_path / "train_000002.bin"), np.arange(10), "bytes")
    with pytest.raises(DataError, match=r"mixes tokenizers: val_000000.bin holds gpt2 tokens, train_000002.bin bytes"):
        S.find_shards(str(tmp_path))
    write_llmc_shard(tmp_path / "val_000000.bin", np.arange(10))  # made elsewhere (header [3] = 0): GPT-2's
    with pytest.raises(DataError, match="mixes tokenizers"):
        S.tokenizer_of(str(tmp_path))
    (tmp_path / "train_000002.bin").unlink()
    assert S.tokenizer_of(str(tmp_path)) == "gpt2"
    header = np.fromfile(tmp_path / "train_000001.bin", dtype="<i4", count=256)
    header[3] = 1000
    (tmp_path / "train_000001.bin").write_bytes(header.tobytes() + np.arange(10, dtype="<u2").tobytes())
    with pytest.raises(DataError, match="train_000001.bin: its header gives vocabulary size 1000"):
        S.find_shards(str(tmp_path))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_surrogate_is_refused_naming_the_line(tmp_path, workers):
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n\n{"text": "bad \\ud800 half"}\n')
    with pytest.raises(DataError, match=r"s.jsonl:3: 'text' holds a lone surrogate \(\\ud800 at character 4\)"):
        P.prepare(str(tmp_path / "out"), input=str(tmp_path / "s.jsonl"), **BYTES | dict(workers=workers))
    assert sorted(os.listdir(tmp_path / "out")) == []  # no shard, temporary or lock left


@pytest.mark.parametrize("failure", ["file size limit", "full disk"])
def test_a_failed_shard_write_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, failure):
    pattern, _ = make_corpus(tmp_path)
    args = dict(input=pattern, val_tokens=2000, shard_tokens=9000, **BYTES)
    P.prepare(str(tmp_path / "whole"), **args)
    out = tmp_path / "out"
    limit = 10000  # bytes: the validation shard (5 KB) and progress.json fit, a train shard (19 KB) does not
    if failure == "file size limit":  # ulimit -f: Python ignores SIGXFSZ, so the write fails with EFBIG
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            with pytest.raises(DataError) as err:
                P.prepare(str(out), **args)
            with pytest.raises(DataError, match=r"cannot write .*alone.bin \(File too large\)"):
                S.write_shard(str(tmp_path / "alone.bin"), np.zeros(9000))  # a shard file cleans up after itself
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert "(File too large)" in str(err.value) and not list(tmp_path.glob("alone.bin*"))
    else:
        real_open, shards = open, []

        class FullDisk:  # the disk fills up 14 KB into the second shard
            def __init__(self, f):
                self.f, self.written, self.name = f, 0, f.name
                shards.append(self)

            def write(self, data):
                self.written += memoryview(data).nbytes
                if len(shards) == 2 and self.written > 14000:
                    raise OSError(28, "No space left on device")
                return self.f.write(data)

            def __getattr__(self, name):
                return getattr(self.f, name)

        monkeypatch.setattr(
            P,
            "open",
            lambda path, *a, **kw: (
                FullDisk(real_open(path, *a, **kw)) if str(path).endswith(".bin.tmp") else real_open(path, *a, **kw)
            ),
            raising=False,
        )
        with pytest.raises(DataError) as err:
            P.prepare(str(out), **args)
        monkeypatch.undo()
        assert "(No space left on device)" in str(err.value)
    assert str(err.value) == (
        f"cannot write {out / 'train_000001.bin'} ({str(err.value).split('(')[1].split(')')[0]}); "
        f"free disk space (or raise the file size limit, ulimit -f) and run data/prepare.py "
        f"again: it keeps the complete shards"
    )
    assert sorted(os.listdir(out)) == ["progress.json", "val_000000.bin"]  # the complete shard, no temporary
    P.prepare(str(out), **args)
    assert_same_shards(tmp_path / "whole", out, at_least=3)


def test_one_prepare_at_a_time_per_out_dir(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 500)
    args = dict(input=str(tmp_path / "a.txt"), val_tokens=1000, **BYTES)
    out = tmp_path / "out"
    out.mkdir()
    host = socket.gethostname()
    for holder, pid in ((f"{os.getppid()} {host}", os.getppid()), ("123 another-host", 123)):
        (out / "lock").write_text(holder)  # a running prepare.py: a live process here (the parent), or one elsewhere
        with pytest.raises(
            DataError,
            match=rf"{out} is being prepared by pid {pid} on .*; wait for it, or remove "
            rf"{out / 'lock'} if that process is gone",
        ):
            P.prepare(str(out), **args)
        assert sorted(os.listdir(out)) == ["lock"] and (out / "lock").read_text() == holder
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    (out / "lock").write_text(f"{dead.pid} {host}")  # a killed run's: taken over
    P.prepare(str(out), **args)
    assert "lock" not in os.listdir(out) and (out / "manifest.json").exists()


def test_an_input_edited_in_place_stops_the_resume(tmp_path, monkeypatch):
    pattern, _ = make_corpus(tmp_path)
    args = dict(input=pattern, val_tokens=2000, shard_tokens=3600, **BYTES)
    out = tmp_path / "out"
    prepare_dying(monkeypatch, out, args, 3)
    jsonl = tmp_path / "src" / "b.jsonl"
    original = jsonl.read_bytes()
    jsonl.write_bytes(original.replace(b"fox", b"cat"))  # same size, other text
    assert jsonl.stat().st_size == len(original)
    with pytest.raises(
        DataError, match=r"input files differ .*\(\.\./src/b.jsonl has other content of the same size\)"
    ):
        P.prepare(str(out), **args)
    jsonl.write_bytes(original)
    P.prepare(str(out), **args)
    P.prepare(str(tmp_path / "whole"), **args)
    assert_same_shards(tmp_path / "whole", out)


def test_fingerprint_samples_big_files_from_start_to_end(tmp_path):
    big = tmp_path / "big.jsonl"
    data = bytearray(np.random.default_rng(0).integers(0, 256, size=5 << 20, dtype=np.uint8).tobytes())
    big.write_bytes(data)
    sampled = hashlib.sha256(b"".join(bytes(data[i * (len(data) - 65536) // 63 :][:65536]) for i in range(64)))
    assert P.fingerprint(str(big)) == sampled.hexdigest()  # 64 blocks of 64 KiB, the first and the last included
    (tmp_path / "small.txt").write_bytes(data[:100000])
    assert P.fingerprint(str(tmp_path / "small.txt")) == hashlib.sha256(data[:100000]).hexdigest()  # whole


@pytest.mark.parametrize("where", ["out_dir is the input folder", "the glob reaches into out_dir"])
def test_an_out_dir_among_the_inputs_is_refused(tmp_path, where):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text " * 500)
    out, pattern = (
        (tmp_path / "src", tmp_path / "src" / "*.txt")
        if where == "out_dir is the input folder"
        else (tmp_path / "src" / "out", tmp_path / "src" / "**")
    )
    (out / "old.txt").parent.mkdir(exist_ok=True)
    (out / "old.txt").write_text("an earlier input")
    with pytest.raises(DataError, match=rf"--input .* matches .*, inside --out_dir {out}; choose an --out_dir outside"):
        P.prepare(str(out), input=str(pattern), val_tokens=1000, **BYTES)
    assert not list(out.glob("*.bin")) and not (out / "lock").exists()


def test_a_shard_cut_at_the_end_of_a_tokenizer_task_records_the_next_document(tmp_path, monkeypatch):
    # 100-character documents, two per tokenizer task (202 byte tokens), two files; every shard ends
    # where a task ends, so the next shard starts at the next task's first document, file boundary included
    monkeypatch.setattr(P, "TASK_CHARS", 200)
    monkeypatch.setattr(P, "MIN_SHARD", 404)  # shards of a few documents, so that twelve fill several
    src = tmp_path / "src"
    src.mkdir()
    docs = [f"{i:03d}" + "x" * 97 for i in range(12)]
    for name, part in (("a.jsonl", docs[:6]), ("b.jsonl", docs[6:])):
        (src / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    args = dict(input=str(src / "*.jsonl"), val_tokens=202, shard_tokens=404, **BYTES)
    out = tmp_path / "out"
    P.prepare(str(out), **args)
    manifest, stream = stream_of(out)
    assert (stream == byte_stream(docs)).all()
    # (file, one past its last row) is the next file's first row: the same place in the stream
    starts = [(f + 1, 0, 0) if (f, r) == (0, 6) else (f, r, o) for f, r, o in (s["start"] for s in manifest["shards"])]
    # the direct count: shard k starts at document 2 k (val) and 2 + 4 (k - 1) (train): (file, row, offset 0)
    expected = [(0, 0, 0)] + [divmod(2 + 4 * (k - 1), 6) + (0,) for k in range(1, len(starts))]
    assert starts == expected and len(starts) == 4
    whole = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    for name in whole:  # each shard rebuilt alone from its recorded start
        (out / name).unlink()
        P.prepare(str(out), **args)
        assert (out / name).read_bytes() == whole[name], name
    again = tmp_path / "again"
    prepare_dying(monkeypatch, again, args, 3)  # and a resume from the start recorded at a task's end
    P.prepare(str(again), **args)
    assert_same_shards(out, again, at_least=4)


# --- numbers and inputs are checked before anything is written ---------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            dict(val_tokens=-500),
            "--val_tokens=-500 must be a whole number from 1 to 2,147,483,647",
        ),  # trained on validation
        (dict(val_tokens=0), "--val_tokens=0 must be a whole number from 1"),
        (dict(val_tokens=float("inf")), "--val_tokens=inf must be a whole number"),
        (dict(val_docs=-1), "--val_docs=-1 must be a whole number of at least 0"),
        (dict(shard_tokens=0), "--shard_tokens=0 must be a whole number from 1"),  # empty shards forever
        (dict(shard_tokens=0.5), "--shard_tokens=0.5 must be a whole number"),
        (
            dict(shard_tokens=1),
            "--shard_tokens=1 is below 1,025: a train shard must hold a sequence of 1,024 tokens and its target",
        ),  # a file per token, none of them trained on
        (dict(shard_tokens=1024), "--shard_tokens=1024 is below 1,025"),
        (dict(shard_tokens=-1), "--shard_tokens=-1 must be a whole number"),
        (dict(shard_tokens=2**31), "--shard_tokens=2147483648 must be a whole number from 1 to 2,147,483,647"),
        (dict(workers=-1), "--workers=-1 must be a whole number of at least 1"),
        (dict(workers=0), "--workers=0 must be a whole number of at least 1"),
        (dict(max_tokens=0), "--max_tokens=0 must be a whole number of at least 1"),
        (dict(max_tokens=-5), "--max_tokens=-5 must be a whole number"),
        (dict(max_tokens=float("nan")), "--max_tokens=nan must be a whole number"),
        (
            dict(max_tokens=800),
            "--max_tokens=800 leaves no tokens to train on after --val_tokens=1000; raise --max_tokens",
        ),
    ],
)
def test_every_number_is_checked_before_anything_is_written(tmp_path, monkeypatch, bad, message):
    (tmp_path / "a.txt").write_text("some text " * 500)
    flushes = []  # a guard: an endless run of empty shards fails here instead of filling the disk
    real_flush = P.ShardWriter.flush
    monkeypatch.setattr(
        P.ShardWriter, "flush", lambda self, nxt: (flushes.append(1), len(flushes) < 50 or 1 / 0, real_flush(self, nxt))
    )
    args = dict(input=str(tmp_path / "a.txt"), val_tokens=1000, **BYTES) | bad
    with pytest.raises(DataError) as err:
        P.prepare(str(tmp_path / "out"), **args)
    assert str(err.value).startswith(message) and not (tmp_path / "out").exists()


def test_a_bad_number_on_the_command_line_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 500)
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "data", "prepare.py"),
            f"--input={tmp_path / 'a.txt'}",
            "--tokenizer=bytes",
            "--val_tokens=-100",
            f"--out_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 1
        and proc.stderr == "error: --val_tokens=-100.0 must be a whole number from 1 to 2,147,483,647\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_file_reached_twice_is_read_once(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    docs = ["the first document " * 30, "the second document " * 30]
    (src / "a.txt").write_text(docs[0])
    (src / "sub" / "b.txt").write_text(docs[1])
    os.symlink(src, src / "sub" / "loop")  # ** follows it 40 levels deep before the loop ends: 41 copies of each
    os.symlink(src / "a.txt", src / "z.txt")  # another name of a.txt
    assert len(__import__("glob").glob(str(src / "**" / "*.txt"), recursive=True)) > 40
    out = tmp_path / "out"
    manifest = P.prepare(str(out), input=str(src / "**" / "*.txt"), val_tokens=200, **BYTES)
    assert [name for name, _, _ in manifest["inputs"]] == ["../src/a.txt", "../src/sub/b.txt"]  # the first name of each
    assert np.array_equal(stream_of(out)[1], byte_stream(docs))


@pytest.mark.parametrize("where", ["a folder", "a glob matching a folder", "the empty folder of a refused run"])
def test_a_folder_as_input_says_how_to_give_a_glob(tmp_path, where):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("some text " * 500)
    if where == "the empty folder of a refused run":
        with pytest.raises(DataError, match="--val_tokens=0"):
            P.prepare(str(src / "out"), input=str(src / "a.txt"), val_tokens=0, **BYTES)
        (src / "sub").rmdir()
        (src / "out").mkdir()  # what a refused run of an older prepare.py left behind
    pattern, folder = {
        "a folder": (src, src),
        "a glob matching a folder": (src / "*", src / "sub"),
        "the empty folder of a refused run": (src / "*", src / "out"),
    }[where]
    with pytest.raises(DataError) as err:
        P.prepare(str(tmp_path / "o"), input=str(pattern), val_tokens=1000, **BYTES)
    assert str(err.value) == (
        f"--input {str(pattern)!r} matches the folder {folder}; give a glob of files, e.g. "
        f"--input='{folder}/*.txt' (or '{folder}/**/*.txt' with its subfolders)"
    )
    assert not (tmp_path / "o").exists()


def test_an_input_that_is_no_regular_file_is_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    os.mkfifo(tmp_path / "src" / "pipe.txt")  # reading it would wait for a writer forever: a subprocess with a timeout
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "data", "prepare.py"),
            f"--input={tmp_path / 'src' / '*'}",
            "--tokenizer=bytes",
            f"--out_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr == (
        f"error: --input {str(tmp_path / 'src' / '*')!r} matches "
        f"{tmp_path / 'src' / 'pipe.txt'}, which is not a regular file "
        f"(a pipe or a device); give a glob of files\n"
    )
    os.remove(tmp_path / "src" / "pipe.txt")
    os.symlink(tmp_path / "nowhere.txt", tmp_path / "src" / "dangling.txt")
    with pytest.raises(
        DataError,
        match=r"matches .*dangling.txt, which cannot be opened \(No such file or directory\); "
        r"remove it or give a narrower glob$",
    ):
        P.prepare(str(tmp_path / "out"), input=str(tmp_path / "src" / "*"), **BYTES)
    os.remove(tmp_path / "src" / "dangling.txt")
    (tmp_path / "src" / "notes.md").write_text("not an input type")  # refused at the start, not when it is reached
    with pytest.raises(DataError, match=r"notes.md: unsupported file type; use .parquet"):
        P.prepare(str(tmp_path / "out"), input=str(tmp_path / "src" / "*"), **BYTES)
    assert not (tmp_path / "out").exists()


def test_damaged_parquet_and_deeply_nested_jsonl_name_the_file(tmp_path):
    rows = [f"row {i} " * 20 for i in range(3000)]
    write_parquet(str(tmp_path / "whole.parquet"), rows, [1000, 1000, 1000])
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])  # a download cut short: no footer
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    for name, problem in (
        ("cut.parquet", r"cut.parquet: cannot be read \(Parquet magic bytes not found"),
        ("empty.parquet", r"empty.parquet: cannot be read \(Parquet file size is 0 bytes\)"),
        ("deep.jsonl", r"deep.jsonl:2: JSON nested too deeply to read; fix or drop that line$"),
    ):
        with pytest.raises(DataError, match=problem) as err:
            P.prepare(str(tmp_path / ("out_" + name)), input=str(tmp_path / name), val_tokens=100, **BYTES)
        assert "\n" not in str(err.value) and not list((tmp_path / ("out_" + name)).glob("*.bin"))


def test_text_columns_of_every_string_encoding_read_the_same(tmp_path):
    # pandas' category dtype and many exporters write a dictionary-encoded column; arrow also has large and view strings
    rows = [f"document {i % 7} " * 5 for i in range(60)]
    columns = dict(
        plain=pa.array(rows),
        dictionary=pa.array(rows).dictionary_encode(),
        large=pa.array(rows, pa.large_string()),
        view=pa.array(rows, pa.string_view()),
    )
    for name, column in columns.items():
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"text": column}), tmp_path / name / "a.parquet", row_group_size=25)
        assert pq.ParquetFile(tmp_path / name / "a.parquet").schema_arrow.field("text").type == column.type
        P.prepare(str(tmp_path / f"out_{name}"), input=str(tmp_path / name / "a.parquet"), val_tokens=100, **BYTES)
        assert np.array_equal(stream_of(tmp_path / f"out_{name}")[1], byte_stream(rows)), name
    pq.write_table(pa.table({"text": pa.array(list(range(60))).dictionary_encode()}), tmp_path / "numbers.parquet")
    with pytest.raises(DataError, match=r"numbers.parquet: column 'text' holds .*int64.*, not strings$"):
        P.prepare(str(tmp_path / "out_numbers"), input=str(tmp_path / "numbers.parquet"), val_tokens=100, **BYTES)


# --- locks, temporaries and names that leave the folder -----------------------------------------


@pytest.mark.parametrize(
    "name", ["../train_000001.bin", "/tmp/train_000001.bin", "sub/train_000001.bin", "..", "notes.txt"]
)
def test_a_manifest_name_outside_the_folder_is_refused(tmp_path, name):
    out = tmp_path / "data" / "out"
    pattern, _ = make_corpus(tmp_path)
    P.prepare(str(out), input=pattern, val_tokens=2000, shard_tokens=9000, **BYTES)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][1]["name"] = name
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for read in (S.verify_manifest, lambda d: P.prepare(d, input=pattern, val_tokens=2000, shard_tokens=9000, **BYTES)):
        with pytest.raises(DataError) as err:
            read(str(out))
        assert str(err.value).startswith(
            f"{out / 'manifest.json'} is not a data/prepare.py record (missing or wrong: "
            f"shards[1] name {name!r}, not a shard file of this folder)"
        )
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, inside or out


def test_planted_symlinks_and_killed_runs_temporaries(tmp_path, monkeypatch):
    pattern, _ = make_corpus(tmp_path)
    args = dict(input=pattern, val_tokens=2000, shard_tokens=3600, **BYTES)
    P.prepare(str(tmp_path / "whole"), **args)
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.write_text("precious")
    prepare_dying(monkeypatch, out, args, 3)
    os.remove(out / "train_000002.bin.tmp")
    os.symlink(victim, out / "train_000002.bin.tmp")  # where the resume writes its next shard
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = [
        out / f"progress.json.{dead.pid}.{socket.gethostname()}.tmp",
        out / f"lock.{dead.pid}.{socket.gethostname()}.tmp",
    ]
    for p in stale:  # what a run killed while writing progress.json, or while taking the lock, leaves
        p.write_text("partial")
    P.prepare(str(out), **args)
    assert victim.read_text() == "precious"
    assert_same_shards(tmp_path / "whole", out)
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "whole"))  # no temporary left


def test_a_lock_that_is_a_dangling_symlink_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 500)
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "out" / "lock")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "data", "prepare.py"),
            f"--input={tmp_path / 'a.txt'}",
            "--tokenizer=bytes",
            "--val_tokens=1000",
            f"--out_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # it used to spin forever, printing nothing
    assert proc.returncode == 1 and proc.stderr == (
        f"error: {tmp_path / 'out' / 'lock'} is a symlink, not a lock (a file holding a pid and a host); remove it\n"
    )
    assert os.listdir(tmp_path / "out") == ["lock"]
