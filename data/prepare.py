"""
Text -> tokens -> uint16 shards (llm.c / modded-nanogpt format: a 256 x int32 header of magic
20240520, version 1 and the token count, then the tokens). Shard 0 is validation. Two tokenizers:
gpt2 (50,257 ids, the default) and bytes (the 256 UTF-8 byte values plus end-of-text: 257 ids).

$ python data/prepare.py shakespeare                       # the bundled corpus -> data/shakespeare_gpt2
$ python data/prepare.py shakespeare --tokenizer=bytes     # the bundled corpus -> data/shakespeare_bytes
$ python data/prepare.py --max_tokens=2.1e9               # FineWeb-Edu sample-10BT from the HF hub
$ python data/prepare.py --input='docs/*.parquet' --out_dir=data/mine   # local parquet/jsonl/txt

The token stream is every document in input order (sorted paths, rows in file order), each
preceded by end-of-text; the shards cut it in order whatever the number of workers. A run that
is interrupted continues where its last complete shard ended when started again with the same
arguments and input files, and writes byte-identical shards. Started on a finished output, it
checks every shard against manifest.json (sha256) and rebuilds any that is missing or damaged.
Training reads shards with find_shards / open_shard / verify_manifest, which also accept llm.c,
modded-nanogpt and build-nanogpt shards. Format and guarantees: docs/shards.md.
"""

import argparse
import glob
import hashlib
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
from collections import deque
from contextlib import contextmanager

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_CORPUS = os.path.join(HERE, "shakespeare")  # Open Shakespeare (see data/README.md)
BUNDLED_VAL_DOCS = 3  # whole held-out plays: the first three in sorted order
TOKENIZER_FILE = os.path.join(HERE, "gpt2.tiktoken")
TOKENIZER_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# tiktoken's r50k_base split pattern (GPT-2); kept here so no tiktoken download is ever needed
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
FINEWEB_REPO = "HuggingFaceFW/fineweb-edu"
TASK_CHARS = 1 << 22  # text per tokenizer task (4 MB): big enough to amortise IPC, small enough to bound memory
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 64, 1 << 16  # an input file's sampled content hash: 4 MiB at most


class DataError(Exception):
    """Bad input: the message is the one line the user sees."""


# -----------------------------------------------------------------------------
# tokenizers: ids, end-of-text (the last id), text -> ids and ids -> text

def check_tokenizer_file():
    with open(TOKENIZER_FILE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != TOKENIZER_SHA256:
        raise DataError(f"{TOKENIZER_FILE} has sha256 {digest}, expected {TOKENIZER_SHA256}; restore it from git")


def gpt2_tokenizer():
    """tiktoken's GPT-2 encoding, from the bundled file."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    check_tokenizer_file()  # our one-line error; tiktoken need not hash the file again
    ranks = load_tiktoken_bpe(TOKENIZER_FILE)
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2.eot})


class Tokenizer:
    """decode: token ids -> text; bytes that are not UTF-8 and ids beyond the vocabulary (a model's
    padding rows can be sampled) read as U+FFFD."""
    vocab_size = eot = None

    def decode(self, ids):
        # b"\xff" is never UTF-8, so errors="replace" turns an unknown id into one U+FFFD
        return b"".join(self.token_bytes(i) if i < self.vocab_size else b"\xff"
                        for i in map(int, ids)).decode("utf-8", errors="replace")


class Bytes(Tokenizer):
    """UTF-8 bytes: ids 0-255 are the byte values, 256 is end-of-text."""
    vocab_size, eot = 257, 256

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)  # a lone surrogate: UnicodeEncodeError

    def token_bytes(self, i):
        return b"<|endoftext|>" if i == self.eot else bytes([i])


class GPT2(Tokenizer):
    """GPT-2's BPE (tiktoken): 50,256 byte-pair ids, 50256 is <|endoftext|>."""
    vocab_size, eot = 50257, 50256

    def __init__(self):
        self.encoding = gpt2_tokenizer()

    def encode(self, text):
        # encode_to_numpy returns a buffer, not a list of Python ints: 7% faster than encode_ordinary.
        # With no special token allowed or disallowed, a literal "<|endoftext|>" in a document is
        # plain text, as in encode_ordinary
        return self.encoding.encode_to_numpy(text, disallowed_special=())

    def token_bytes(self, i):
        return self.encoding.decode_single_token_bytes(i)


TOKENIZERS = {"bytes": Bytes, "gpt2": GPT2}
# the bundled corpus, prepared on demand: one output directory per tokenizer
BUNDLED = {os.path.join(HERE, f"shakespeare_{name}"): name for name in TOKENIZERS}


def get_tokenizer(name):
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


# -----------------------------------------------------------------------------
# shard format

class ShardFile:
    """
    A shard written as its tokens arrive, so a 100M-token shard is never held in memory: the tokens
    go to a temporary file behind a placeholder header while their sha256 accumulates; close()
    writes the real header and renames the file into place, so a shard on disk is always complete.
    A failed write (a full disk, the file size limit) removes the temporary file: one DataError line.
    """

    def __init__(self, path, tokenizer="gpt2"):
        self.path, self.tmp, self.tokens, self.sha256 = path, path + ".tmp", 0, hashlib.sha256()
        self.vocab_size, self.file = TOKENIZERS[tokenizer].vocab_size, None
        with self.removed_on_error():
            self.file = open(self.tmp, "wb")
            self.file.write(bytes(4 * HEADER_INTS))

    def write(self, tokens):
        data = np.ascontiguousarray(tokens, dtype="<u2").data  # no copy when already uint16
        with self.removed_on_error():
            self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)

    def close(self):
        """Finish the shard; returns the sha256 of its tokens."""
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:4] = MAGIC, VERSION, self.tokens, self.vocab_size  # [3]: which tokenizer (readers of the format ignore it)
        with self.removed_on_error():
            self.file.seek(0)
            self.file.write(header.tobytes())
            self.file.close()
            os.replace(self.tmp, self.path)
        return self.sha256.hexdigest()

    def discard(self):
        if self.file:
            try:
                self.file.close()
            except OSError:
                pass  # its buffered tail cannot be written either; the file goes anyway
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    @contextmanager
    def removed_on_error(self):
        try:
            yield
        except OSError as e:
            self.discard()
            raise DataError(f"cannot write {self.path} ({e.strerror or e}); free disk space (or raise the file size "
                            f"limit, ulimit -f) and run data/prepare.py again: it keeps the complete shards") from None


def write_shard(path, tokens, tokenizer="gpt2"):
    """A whole shard at once; returns the sha256 of its tokens."""
    shard = ShardFile(path, tokenizer)
    shard.write(tokens)
    return shard.close()


def read_header(path):
    """A .bin shard's token count and header vocabulary size, after checking its magic, version and size."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)  # OSErrors: one line in reading_shard
    if len(header) < HEADER_INTS:
        raise DataError(f"{path}: truncated header ({len(header) * 4} of {HEADER_INTS * 4} bytes); re-run data/prepare.py")
    if header[0] != MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {MAGIC}); not a token shard")
    if header[1] != VERSION:
        raise DataError(f"{path}: unsupported version {header[1]} (expected {VERSION})")
    expected = HEADER_INTS * 4 + 2 * int(header[2])
    if os.path.getsize(path) != expected:
        raise DataError(f"{path}: size {os.path.getsize(path)} bytes, header says {expected} "
                        f"({header[2]} tokens); the shard is truncated or corrupt, re-run data/prepare.py")
    return int(header[2]), int(header[3])


@contextmanager
def reading_shard(path):
    try:
        yield
    except FileNotFoundError:
        raise DataError(f"{path}: no such shard; run data/prepare.py to create it") from None
    except (OSError, ValueError, EOFError) as e:  # a directory, no permission, an empty or damaged .npy, ...
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise DataError(f"{path}: cannot be read as a token shard ({reason}); replace it, "
                        f"or re-run data/prepare.py if it made it") from None


def open_shard(path, vocab_size=None):
    """
    A shard's tokens as a read-only uint16 memmap: a .bin shard (ours, llm.c's, modded-nanogpt's;
    header checked) or a headerless .npy (build-nanogpt's). With vocab_size, a token id the model
    cannot embed is an error here rather than a crash at the first step.
    """
    with reading_shard(path):
        if path.endswith(".npy"):
            tokens = np.load(path, mmap_mode="r")
            if tokens.dtype != np.dtype("<u2") or tokens.ndim != 1:
                raise DataError(f"{path}: a {tokens.ndim}-d {tokens.dtype} array; a token shard is 1-d uint16")
        else:
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_INTS * 4, shape=(read_header(path)[0],))
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:  # one pass: 100M tokens in ~0.02 s (page cache)
        first = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {int(tokens[first])} at position {first:,} is >= vocab_size {vocab_size}; "
                        f"the shard was made with another tokenizer, or vocab_size is too small")
    return tokens


def shard_tokenizer(path):
    """The tokenizer a shard was made with, from its header's [3] (the vocabulary size); shards made
    elsewhere (0 there, and .npy shards) are GPT-2's, as llm.c's, modded-nanogpt's and build-nanogpt's are."""
    if path.endswith(".npy"):
        return "gpt2"
    with reading_shard(path):
        vocab_size = read_header(path)[1]
    names = {0: "gpt2"} | {t.vocab_size: name for name, t in TOKENIZERS.items()}
    if vocab_size not in names:
        raise DataError(f"{path}: its header gives vocabulary size {vocab_size}, not one of a known tokenizer "
                        f"({', '.join(f'{n}: {t.vocab_size}' for n, t in TOKENIZERS.items())}); not a shard of ours")
    return names[vocab_size]


def shard_split(name):
    """'val' or 'train' for a shard file name (val_000000.bin, fineweb_train_000001.bin,
    edufineweb_val_000000.npy, ...), None for any other file."""
    stem, ext = os.path.splitext(name)
    parts = stem.split("_")
    if ext in (".bin", ".npy"):
        for split in ("val", "train"):
            if split in parts:
                return split
    return None


def shard_kind(name):
    """A shard's naming scheme: its name up to the split, and its extension (fineweb_*.bin)."""
    stem, ext = os.path.splitext(name)
    parts = stem.split("_")
    return "_".join(parts[:parts.index(shard_split(name))] + ["*"]) + ext


def find_shards(data_dir):
    """The validation shard and the sorted train shards in data_dir, all of one tokenizer."""
    bundled = BUNDLED.get(os.path.abspath(data_dir))
    make = (f"create it with: python data/prepare.py shakespeare --tokenizer={bundled}" if bundled else
            "create it with data/prepare.py (python data/prepare.py shakespeare --tokenizer=bytes for the bundled "
            "corpus), or point data_dir at a directory of llm.c / modded-nanogpt .bin or build-nanogpt .npy shards")
    if not os.path.exists(data_dir):
        raise DataError(f"data_dir {data_dir} does not exist; {make}")
    if not os.path.isdir(data_dir):
        raise DataError(f"data_dir {data_dir} is a file, not a directory of shards; {make}")
    names = sorted(os.listdir(data_dir))
    kinds = {}  # one example file per naming scheme: two schemes are likely the same data twice
    for n in names:
        if shard_split(n):
            kinds.setdefault(shard_kind(n), n)
    if len(kinds) > 1:
        raise DataError(f"data_dir {data_dir}: found shards of {len(kinds)} kinds: {', '.join(kinds.values())}; "
                        f"keep one kind per data_dir")
    val = [n for n in names if shard_split(n) == "val"]
    train = [os.path.join(data_dir, n) for n in names if shard_split(n) == "train"]
    if len(val) != 1 or not train:
        raise DataError(f"data_dir {data_dir} needs exactly one validation shard (*val_*.bin or .npy) and at least "
                        f"one train shard (*train_*.bin or .npy); found {len(val)} ({', '.join(val) or 'none'}) "
                        f"and {len(train)}; {make}")
    val = os.path.join(data_dir, val[0])
    tokenizer = shard_tokenizer(val)
    for path in train:
        if shard_tokenizer(path) != tokenizer:
            raise DataError(f"data_dir {data_dir} mixes tokenizers: {os.path.basename(val)} holds {tokenizer} tokens, "
                            f"{os.path.basename(path)} {shard_tokenizer(path)} tokens; keep one tokenizer's shards per data_dir")
    return val, train


def tokenizer_of(data_dir):
    """The name of the tokenizer data_dir's shards were made with: manifest.json's where prepare.py
    wrote one (its shards checked against it), else the shards' own (GPT-2 for shards made elsewhere)."""
    manifest = verify_manifest(data_dir)
    return manifest["tokenizer"] if manifest else shard_tokenizer(find_shards(data_dir)[0])


def read_json(path):
    with open(path) as f:
        return json.load(f)


SHARD_FIELDS = dict(name=str, tokens=int, sha256=str)
RECORD_FIELDS = {"manifest.json": dict(arguments=dict, inputs=list, tokenizer=str, total_tokens=int, shards=list),
                 "progress.json": dict(arguments=dict, shards=list, next=list)}


def read_record(path):
    """manifest.json or progress.json, checked: a torn file, or one prepare.py did not write, is one line."""
    remedy = (f"restore it, or delete {os.path.dirname(path) or '.'} and run data/prepare.py again (or, for shards "
              f"made elsewhere, remove {os.path.basename(path)})")
    try:
        record = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} cannot be read as JSON ({e.strerror if isinstance(e, OSError) else e}); {remedy}") from None
    fields = RECORD_FIELDS[os.path.basename(path)]
    bad = [k for k, kind in fields.items() if not isinstance(record, dict) or not isinstance(record.get(k), kind)]
    bad += [f"shards[{i}]" for i, s in enumerate(record.get("shards", []) if not bad else [])
            if not isinstance(s, dict) or any(not isinstance(s.get(k), kind) for k, kind in SHARD_FIELDS.items())]
    if bad or (record.get("tokenizer", "gpt2") not in TOKENIZERS):
        what = ", ".join(bad[:3]) or f"tokenizer {record['tokenizer']!r}"
        raise DataError(f"{path} is not a data/prepare.py record (missing or wrong: {what}); {remedy}")
    return record


def shard_problems(data_dir, manifest, full):
    """{file name: one-line problem} for each shard file in data_dir that differs from the manifest:
    missing, damaged, of another tokenizer, other tokens (full: by sha256), or not listed at all."""
    listed = {s["name"] for s in manifest["shards"]}
    problems = {n: f"{os.path.join(data_dir, n)} is not listed in manifest.json (a shard from another run?); "
                   f"move it out of {data_dir}"
                for n in sorted(os.listdir(data_dir)) if shard_split(n) and n not in listed}
    rebuild = "re-run data/prepare.py with the same arguments to rebuild it"
    for shard in manifest["shards"]:
        path = os.path.join(data_dir, shard["name"])
        if not os.path.exists(path):
            problems[shard["name"]] = f"{path} is listed in manifest.json but missing; {rebuild}"
            continue
        try:
            tokens, tokenizer = open_shard(path), shard_tokenizer(path)
        except DataError as e:
            problems[shard["name"]] = str(e)
            continue
        if tokenizer != manifest["tokenizer"]:
            problems[shard["name"]] = (f"{path} holds {tokenizer} tokens, manifest.json says {manifest['tokenizer']}; "
                                       f"move it out of {data_dir} and {rebuild}")
        elif len(tokens) != shard["tokens"]:
            problems[shard["name"]] = f"{path} holds {len(tokens):,} tokens, manifest.json lists {shard['tokens']:,}; {rebuild}"
        elif full and hashlib.sha256(tokens).hexdigest() != shard["sha256"]:
            problems[shard["name"]] = f"{path}: its tokens differ from manifest.json (sha256); {rebuild}"
    return problems


def verify_manifest(data_dir, full=False):
    """
    When data_dir holds a manifest.json (written by prepare), its shard files must be exactly those
    listed, with the listed sizes and tokenizer (full: and token sha256); returns the manifest, or
    None without one (shards made elsewhere, checked by open_shard alone).
    """
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.exists(path):
        return None
    manifest = read_record(path)
    problems = shard_problems(data_dir, manifest, full)
    if problems:
        raise DataError(next(iter(problems.values())))
    return manifest


# -----------------------------------------------------------------------------
# sources: documents as (file index, row index, text), starting from a resume position

def read_documents(paths, start_file=0, start_row=0):
    for file_index in range(start_file, len(paths)):
        skip = start_row if file_index == start_file else 0
        path = paths[file_index]()  # a callable: FineWeb files are downloaded only when reached
        for row, text in enumerate(read_file(path, skip), start=skip):
            yield file_index, row, text


def read_file(path, skip):
    """The documents of one file from row skip on."""
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise DataError(f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
        kind = pf.schema_arrow.field("text").type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column 'text' holds {kind}, not strings")
        groups, row = [], 0  # row: the file row of the next batch's first document
        for g in range(pf.num_row_groups):  # skip whole leading row groups on resume without reading them
            n = pf.metadata.row_group(g).num_rows
            if not groups and skip >= n:
                skip, row = skip - n, row + n
            else:
                groups.append(g)
        if groups:
            for batch in pf.iter_batches(batch_size=1024, row_groups=groups, columns=["text"]):
                texts = batch.column(0)
                if texts.null_count:
                    raise DataError(f"{path}: row {row + texts.is_null().to_pylist().index(True)}: 'text' is null")
                yield from texts.to_pylist()[skip:]
                skip, row = max(0, skip - len(texts)), row + len(texts)
    elif path.endswith(".jsonl"):
        with open(path, "rb") as f:
            documents = (n_line for n_line in enumerate(f, start=1) if n_line[1].strip())  # blank lines are no rows
            for row, (line_number, line) in enumerate(documents):
                if row >= skip:
                    try:
                        text = json.loads(line)["text"]
                    except UnicodeDecodeError as e:
                        raise DataError(f"{path}:{line_number}: not UTF-8 (byte {e.start} of the line)") from None
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DataError(f"{path}:{line_number}: not a JSON object with a 'text' field") from None
                    if not isinstance(text, str):
                        raise DataError(f"{path}:{line_number}: 'text' is {json.dumps(text)[:40]}, not a string")
                    try:  # JSON's \ud800 escapes make lone surrogates, which are no text a tokenizer can encode
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise DataError(f"{path}:{line_number}: 'text' holds a lone surrogate (\\u{ord(text[e.start]):04x} "
                                        f"at character {e.start}), which is not text; fix or drop that line") from None
                    yield text
    elif path.endswith(".txt"):
        if skip == 0:
            try:
                with open(path, encoding="utf-8") as f:
                    yield f.read()  # one document per file
            except UnicodeDecodeError:
                with open(path, "rb") as f:
                    e = utf8_error(f.read())
                raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8") from None
    else:
        raise DataError(f"{path}: unsupported file type; use .parquet (column 'text'), .jsonl (field 'text') or .txt")


def utf8_error(data):
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e


def input_files(input, subset, out_dir):
    """(openers, [[name, size, fingerprint], ...]) of the input files in order; local names are relative
    to out_dir (as the recorded glob), hub files have no size or fingerprint before they are downloaded."""
    if not input:
        openers, names = fineweb_paths(subset, os.path.join(out_dir, "download"))
        return openers, [[n, None, None] for n in names]
    paths = sorted(glob.glob(input, recursive=True))
    if not paths:
        raise DataError(f"--input {input!r} matches no files")
    out = os.path.realpath(out_dir)
    inside = [p for p in paths if os.path.commonpath([os.path.realpath(p), out]) == out]
    if inside:  # the first run would work, but then the glob would match what it wrote: no resume, no repair
        raise DataError(f"--input {input!r} matches {inside[0]}, inside --out_dir {out_dir}; "
                        f"choose an --out_dir outside the input folder")
    return [lambda p=p: p for p in paths], [[os.path.relpath(p, out_dir), os.path.getsize(p), fingerprint(p)] for p in paths]


def fingerprint(path):
    """sha256 of a file's content, sampled: the whole file up to 4 MiB, else 64 blocks of 64 KiB evenly
    spaced from its first byte to its last. Cheap enough for every start (a multi-GB FineWeb-Edu file
    costs 64 reads, not a read of the file); what it misses: docs/shards.md."""
    size, h = os.path.getsize(path), hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
            h.update(f.read())
        else:
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(i * (size - FINGERPRINT_BLOCK) // (FINGERPRINT_BLOCKS - 1))
                h.update(f.read(FINGERPRINT_BLOCK))
    return h.hexdigest()


def check_inputs(recorded, files, out_dir):
    """The input list is part of the resume state: resume positions index into it, and the shards
    so far hold its content."""
    # a record by an older prepare.py has [name, size]: compared on those
    old, new = {n: rest for n, *rest in recorded}, {n: rest for n, *rest in files}
    changes = ([f"{n} is new" for n in new if n not in old] + [f"{n} is gone" for n in old if n not in new] +
               [f"{n} was {old[n][0]:,} bytes, now {new[n][0]:,}" if old[n][0] != new[n][0] else
                f"{n} has other content of the same size" for n in new if n in old and old[n] != new[n][:len(old[n])]])
    if changes:
        raise DataError(f"the input files differ from those {out_dir} was made from ({'; '.join(changes[:3])}"
                        f"{'; ...' if len(changes) > 3 else ''}); restore them, or choose another --out_dir")


def fineweb_paths(subset, cache_dir):
    """The subset's parquet files on the hub, each downloaded (resumably) when first read."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    offline_help = ("the Hugging Face hub is unreachable{}; prepare local files with --input GLOB, "
                    "or the bundled corpus with: python data/prepare.py shakespeare")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or constants.HF_HUB_OFFLINE:
        raise DataError(offline_help.format(" (HF_HUB_OFFLINE is set)"))
    host = constants.ENDPOINT.split("://")[-1].split("/")[0]
    try:  # some hub calls have no timeout: fail fast before making any
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as e:
        raise DataError(offline_help.format(f" ({host}: {e})")) from None
    prefix = "sample/" + subset[len("sample-"):] + "/" if subset.startswith("sample-") else f"data/{subset}/"
    listing = call_with_timeout(lambda: HfApi().list_repo_files(FINEWEB_REPO, repo_type="dataset"), 60,
                                offline_help.format(" (listing the dataset timed out)"))
    files = sorted(f for f in listing if f.startswith(prefix) and f.endswith(".parquet"))
    if not files:
        raise DataError(f"no parquet files for subset {subset!r} in {FINEWEB_REPO} (looked under {prefix})")
    download = lambda f: hf_hub_download(FINEWEB_REPO, f, repo_type="dataset", local_dir=cache_dir)
    return [lambda f=f: download(f) for f in files], [f"hf://datasets/{FINEWEB_REPO}/{f}" for f in files]


def call_with_timeout(fn, seconds, message):
    result = {}
    def run():
        try:
            result["value"] = fn()
        except Exception as e:  # reported below as one line
            result["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise DataError(message)
    if "error" in result:
        raise DataError(f"{message.split(';')[0]}: {type(result['error']).__name__}: {result['error']}"
                        .replace("\n", " "))
    return result["value"]


# -----------------------------------------------------------------------------
# tokenization in worker processes, results consumed in order

_tokenizer = None


def _init_worker(tokenizer):
    global _tokenizer
    _tokenizer = get_tokenizer(tokenizer)


def tokenize(texts):
    """EOT + tokens for each document, concatenated; plus each document's length."""
    eot = np.array([_tokenizer.eot], dtype=np.uint32)
    docs = [_tokenizer.encode(t) for t in texts]
    tokens = np.concatenate([part for d in docs for part in (eot, d)]).astype(np.uint16)
    return tokens, np.array([len(d) + 1 for d in docs])


def tokenized_batches(documents, workers, tokenizer):
    """(tokens, doc lengths, [(file, row), ...]) per task, in input order, with bounded memory."""
    def tasks():
        texts, where, chars = [], [], 0
        for file_index, row, text in documents:
            texts.append(text)
            where.append((file_index, row))
            chars += len(text)
            if chars >= TASK_CHARS:
                yield texts, where
                texts, where, chars = [], [], 0
        if texts:
            yield texts, where

    if workers == 1:
        _init_worker(tokenizer)
        for texts, where in tasks():
            yield (*tokenize(texts), where)
        return
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending = deque()  # at most 2 tasks per worker in flight: memory stays bounded
        for texts, where in tasks():
            pending.append((pool.apply_async(tokenize, (texts,)), where))
            if len(pending) >= 2 * workers:
                result, where = pending.popleft()
                yield (*result.get(), where)
        while pending:
            result, where = pending.popleft()
            yield (*result.get(), where)


# -----------------------------------------------------------------------------
# cutting the stream into shards

class ShardWriter:
    """Cuts the token stream into val + train shards and records where each starts and ends."""

    def __init__(self, out_dir, progress, tokenizer, val_tokens, val_docs, shard_tokens):
        self.out_dir, self.progress, self.tokenizer = out_dir, progress, tokenizer
        self.val_tokens, self.val_docs, self.shard_tokens = val_tokens, val_docs, shard_tokens
        self.shard, self.docs_before = None, 0  # the shard being filled, opened when tokens arrive

    def add_batch(self, tokens, lengths, where, pos, budget):
        """Append a task's tokens from pos on (pos > 0: the first document resumes mid-way), at
        most budget of them, cutting shards where they fill; returns the tokens taken."""
        ends = np.cumsum(lengths)
        taken = 0
        while pos < len(tokens) and taken < budget:
            shard = self.open()
            if self.val_docs and not self.progress["shards"]:  # validation ends with document val_docs
                last = self.val_docs - self.docs_before - 1
                room = ends[last] - pos if last < len(ends) else float("inf")
            else:
                room = (self.shard_tokens if self.progress["shards"] else self.val_tokens) - shard.tokens
            n = int(min(room, len(tokens) - pos, budget - taken))
            shard.write(tokens[pos:pos + n])
            pos, taken = pos + n, taken + n
            if n == room:
                self.flush(self.position(pos, ends, lengths, where))
        self.docs_before += len(lengths)
        return taken

    @staticmethod
    def position(pos, ends, lengths, where):
        """(file, row, token offset) of the token at pos: where the next shard starts."""
        j = int(np.searchsorted(ends, pos, side="right"))  # the document holding that token
        if j == len(ends):
            file_index, row = where[-1]
            return file_index, row + 1, 0
        file_index, row = where[j]
        return file_index, row, int(pos - (ends[j] - lengths[j]))

    def open(self):
        if self.shard is None:
            index = len(self.progress["shards"])
            self.shard = ShardFile(os.path.join(self.out_dir, f"{'val' if index == 0 else 'train'}_{index:06d}.bin"),
                                   self.tokenizer)
        return self.shard

    def flush(self, next_position):
        shard = self.open()
        self.progress["shards"].append(dict(name=os.path.basename(shard.path), tokens=shard.tokens, sha256=shard.close(),
                                            start=self.progress["next"]))  # where it starts: it can be rebuilt alone
        self.progress["next"] = list(next_position)
        write_json(os.path.join(self.out_dir, "progress.json"), self.progress)
        self.shard = None


def write_atomic(path, write):
    """
    write(tmp) to a temporary name of this process, then renamed onto path: a reader never sees half a
    file, two writers never share a temporary, and a failed write leaves the previous file and no
    temporary behind. Every file the project writes goes through here.
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise DataError(f"cannot write {path} ({e.strerror or e}); free disk space or check the permissions "
                        f"of {os.path.dirname(path) or '.'}") from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    """Strict JSON, written atomically: a NaN or an Infinity is the caller's bug (a ValueError naming the path)."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
    try:
        write_atomic(path, write)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; write null for a number that is not finite") from None


@contextmanager
def pid_lock(path, busy):
    """
    One process at a time: path holds the holder's pid and host while it runs. A lock whose process
    is gone from this host (a killed run) is taken over; one from another host (a shared filesystem)
    cannot be checked and stays until removed. The lock appears with its content (a hard link of a
    written file), so no kill leaves an empty one. busy: what the error says is going on.
    """
    host, mine = socket.gethostname(), f"{path}.{os.getpid()}.tmp"
    try:
        with open(mine, "w") as f:
            f.write(f"{os.getpid()} {host}")
    except OSError as e:
        raise DataError(f"cannot write {mine} ({e.strerror}); free disk space or check the permissions of "
                        f"{os.path.dirname(path) or '.'}") from None
    try:
        while True:
            try:
                os.link(mine, path)
                break
            except FileExistsError:
                try:
                    with open(path) as f:
                        pid, _, owner = f.read().partition(" ")
                except FileNotFoundError:
                    continue  # released meanwhile
                if pid and (owner != host or not pid.isdigit() or process_exists(int(pid))):
                    raise DataError(f"{busy} by pid {pid} on {owner or '?'}; wait for it, or remove {path} "
                                    f"if that process is gone") from None
                os.remove(path)  # stale: its process ended without releasing it (or an older version left it empty)
    finally:
        os.remove(mine)
    try:
        yield
    finally:
        os.remove(path)


def process_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def prepare(out_dir, input=None, tokenizer="gpt2", subset="sample-10BT", max_tokens=None, val_tokens=10_485_760,
            val_docs=0, shard_tokens=100_000_000, workers=None, quiet=False):
    """Tokenize the input into shards under out_dir; returns the manifest (see module docstring)."""
    get_tokenizer(tokenizer)  # fail now, not in a worker, on an unknown name or a damaged vocabulary file
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"out_dir {out_dir} is a file; choose a directory")
    os.makedirs(out_dir, exist_ok=True)
    with pid_lock(os.path.join(out_dir, "lock"), f"{out_dir} is being prepared"):
        return prepare_locked(out_dir, input, tokenizer, subset, max_tokens, val_tokens, val_docs, shard_tokens,
                              workers or os.cpu_count(), quiet)


def prepare_locked(out_dir, input, tokenizer, subset, max_tokens, val_tokens, val_docs, shard_tokens, workers, quiet):
    from tqdm import tqdm
    # the input glob is recorded relative to out_dir, so moving the whole project keeps it valid
    arguments = dict(input=input and os.path.relpath(input, out_dir), tokenizer=tokenizer, subset=None if input else subset,
                     max_tokens=max_tokens, val_tokens=val_tokens, val_docs=val_docs, shard_tokens=shard_tokens)
    manifest_path, progress_path = os.path.join(out_dir, "manifest.json"), os.path.join(out_dir, "progress.json")
    previous = {path: read_record(path) for path in (manifest_path, progress_path) if os.path.exists(path)}
    for record in previous.values():
        recorded = {"tokenizer": "gpt2"} | record["arguments"]  # by a prepare.py before the tokenizer was an argument
        if recorded != arguments:
            raise DataError(f"{out_dir} holds shards made with other arguments ({recorded}); "
                            f"choose another --out_dir or delete it")
    if manifest_path in previous:
        return repair(out_dir, previous[manifest_path], input, subset, workers, quiet)
    paths, files = input_files(input, subset, out_dir)
    progress = previous.get(progress_path) or dict(arguments=arguments, inputs=files, shards=[], next=[0, 0, 0])
    check_inputs(progress.setdefault("inputs", files), files, out_dir)  # (a progress.json older than the record adopts it)
    for shard in progress["shards"]:  # a resume trusts only shards that still open cleanly
        open_shard(os.path.join(out_dir, shard["name"]))

    start_file, start_row, start_offset = progress["next"]
    done = sum(s["tokens"] for s in progress["shards"])
    remaining = (int(max_tokens) - done) if max_tokens else float("inf")
    writer = ShardWriter(out_dir, progress, tokenizer, int(val_tokens), int(val_docs), int(shard_tokens))
    bar = tqdm(total=int(max_tokens) if max_tokens else None, initial=done, unit="tok", unit_scale=True,
               desc="tokenizing", disable=quiet)
    offset = start_offset  # the first document resumes mid-way through its tokens
    try:
        for tokens, lengths, where in tokenized_batches(read_documents(paths, start_file, start_row), workers, tokenizer):
            taken = writer.add_batch(tokens, lengths, where, offset, remaining)
            remaining -= taken
            bar.update(taken)
            offset = 0
            if remaining <= 0:
                break
        if writer.shard or not progress["shards"]:
            writer.flush((len(paths), 0, 0))
    except DataError:
        if writer.shard:  # a bad row or a full disk: the shard it was filling is incomplete
            writer.shard.discard()
        raise
    finally:
        bar.close()
    if len(progress["shards"]) < 2:
        raise DataError(f"the input holds too few tokens for a validation shard and a train shard "
                        f"({sum(s['tokens'] for s in progress['shards']):,}); lower --val_tokens or --val_docs")
    manifest = dict(arguments=arguments, inputs=files, tokenizer=tokenizer,
                    tokenizer_sha256=TOKENIZER_SHA256 if tokenizer == "gpt2" else None,
                    total_tokens=sum(s["tokens"] for s in progress["shards"]),
                    val_tokens=progress["shards"][0]["tokens"], shards=progress["shards"])
    write_json(manifest_path, manifest)
    os.remove(progress_path)
    if not quiet:
        print(f"wrote {len(manifest['shards'])} shards, {manifest['total_tokens']:,} tokens of {tokenizer} "
              f"({manifest['val_tokens']:,} validation) to {out_dir}")
    return manifest


def repair(out_dir, manifest, input, subset, workers, quiet):
    """A complete output is verified in full (sha256); a missing or damaged shard is rebuilt alone,
    from the stream position where it starts, and must come out identical."""
    problems = shard_problems(out_dir, manifest, full=True)
    for shard in manifest["shards"]:
        if shard["name"] in problems and "start" not in shard:
            raise DataError(f"{problems[shard['name']]} - but {out_dir} was made by an older prepare.py that cannot "
                            f"rebuild one shard; delete {out_dir} and prepare it again")
    listed = {s["name"] for s in manifest["shards"]}
    for name, problem in problems.items():
        if name not in listed:
            raise DataError(problem)
    if not problems:
        if not quiet:
            print(f"{out_dir} is complete ({manifest['total_tokens']:,} tokens, every shard matches manifest.json); nothing to do")
        return manifest
    paths, files = input_files(input, subset, out_dir)
    check_inputs(manifest["inputs"], files, out_dir)
    for shard in manifest["shards"]:
        if shard["name"] in problems:
            if not quiet:
                print(f"rebuilding {shard['name']}: {problems[shard['name']].split(';')[0]}")
            rebuild_shard(out_dir, paths, shard, workers, manifest["tokenizer"])
    return manifest


def rebuild_shard(out_dir, paths, shard, workers, tokenizer):
    file_index, row, offset = shard["start"]
    out = ShardFile(os.path.join(out_dir, shard["name"]), tokenizer)
    try:
        for tokens, _, _ in tokenized_batches(read_documents(paths, file_index, row), workers, tokenizer):
            out.write(tokens[offset:offset + shard["tokens"] - out.tokens])
            offset = 0
            if out.tokens == shard["tokens"]:
                break
    except DataError:
        out.discard()
        raise
    if out.sha256.hexdigest() != shard["sha256"]:
        out.discard()
        raise DataError(f"{out.path}: rebuilt from the inputs, its tokens differ from manifest.json (did the input files "
                        f"change?); delete {out_dir} and prepare it again")
    out.close()


def prepare_bundled(out_dir, tokenizer=None, quiet=False):
    """The embedded dataset: Shakespeare, three whole plays held out for validation; tokenizer: the one
    BUNDLED names for out_dir unless given."""
    tokenizer = tokenizer or BUNDLED.get(os.path.abspath(out_dir))
    if tokenizer is None:
        raise DataError(f"{out_dir} is not one of the bundled outputs ({', '.join(BUNDLED)}); give the tokenizer")
    # seconds in this process; a spawned worker would first re-import the caller's main module
    # (train.py: torch), which takes longer
    return prepare(out_dir, input=os.path.join(BUNDLED_CORPUS, "*.txt"), tokenizer=tokenizer, val_docs=BUNDLED_VAL_DOCS,
                   shard_tokens=100_000_000, workers=1, quiet=quiet)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other error of the project
        sys.exit(f"error: {message}; see python data/prepare.py --help")


def main():
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", nargs="?", choices=["shakespeare"], help="prepare the bundled corpus")
    parser.add_argument("--input", help="glob of local .parquet/.jsonl/.txt files (default: FineWeb-Edu from the hub)")
    parser.add_argument("--tokenizer", default="gpt2", choices=list(TOKENIZERS), help="gpt2 (50,257 ids) or bytes (257)")
    parser.add_argument("--subset", default="sample-10BT", help="FineWeb-Edu subset (sample-10BT, sample-100BT, CC-MAIN-2024-10, ...)")
    parser.add_argument("--out_dir", help="output directory (default: data/<source>, with _bytes for byte tokens)")
    parser.add_argument("--max_tokens", type=float, help="stop after this many tokens (e.g. 2.1e9)")
    parser.add_argument("--val_tokens", type=float, default=10_485_760, help="validation shard: the first N tokens")
    parser.add_argument("--val_docs", type=int, default=0, help="validation shard: the first N whole documents instead")
    parser.add_argument("--shard_tokens", type=float, default=1e8, help="tokens per train shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    args = parser.parse_args()
    try:
        if args.preset == "shakespeare":
            prepare_bundled(args.out_dir or os.path.join(HERE, f"shakespeare_{args.tokenizer}"), args.tokenizer)
        else:
            source = "local" if args.input else "fineweb_edu_" + args.subset
            out_dir = args.out_dir or os.path.join(HERE, source + ("" if args.tokenizer == "gpt2" else "_" + args.tokenizer))
            prepare(out_dir, input=args.input, tokenizer=args.tokenizer, subset=args.subset, max_tokens=args.max_tokens,
                    val_tokens=args.val_tokens, val_docs=args.val_docs, shard_tokens=args.shard_tokens,
                    workers=args.workers)
    except DataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
