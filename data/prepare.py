"""
Text -> GPT-2 tokens -> uint16 shards (llm.c / modded-nanogpt format: a 256 x int32 header of
magic 20240520, version 1 and the token count, then the tokens). Shard 0 is validation.

$ python data/prepare.py shakespeare                       # the bundled corpus -> data/shakespeare_gpt2
$ python data/prepare.py --max_tokens=2.1e9               # FineWeb-Edu sample-10BT from the HF hub
$ python data/prepare.py --input='docs/*.parquet' --out_dir=data/mine   # local parquet/jsonl/txt

The token stream is every document in input order (sorted paths, rows in file order), each
preceded by <|endoftext|>; the shards cut it in order whatever the number of workers. A run that
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

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_CORPUS = os.path.join(HERE, "shakespeare")  # Open Shakespeare (see data/README.md)
BUNDLED_OUT = os.path.join(HERE, "shakespeare_gpt2")
BUNDLED_VAL_DOCS = 3  # whole held-out plays: the first three in sorted order
TOKENIZER_FILE = os.path.join(HERE, "gpt2.tiktoken")
TOKENIZER_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# tiktoken's r50k_base split pattern (GPT-2); kept here so no tiktoken download is ever needed
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
FINEWEB_REPO = "HuggingFaceFW/fineweb-edu"
TASK_CHARS = 1 << 22  # text per tokenizer task (4 MB): big enough to amortise IPC, small enough to bound memory


class DataError(Exception):
    """Bad input: the message is the one line the user sees."""


# -----------------------------------------------------------------------------
# tokenizer and shard format

def check_tokenizer_file():
    with open(TOKENIZER_FILE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != TOKENIZER_SHA256:
        raise DataError(f"{TOKENIZER_FILE} has sha256 {digest}, expected {TOKENIZER_SHA256}; restore it from git")


def gpt2_tokenizer():
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    check_tokenizer_file()  # our one-line error; tiktoken need not hash the file again
    ranks = load_tiktoken_bpe(TOKENIZER_FILE)
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


class ShardFile:
    """
    A shard written as its tokens arrive, so a 100M-token shard is never held in memory: the tokens
    go to a temporary file behind a placeholder header while their sha256 accumulates; close()
    writes the real header and renames the file into place, so a shard on disk is always complete.
    """

    def __init__(self, path):
        self.path, self.tokens, self.sha256 = path, 0, hashlib.sha256()
        self.file = open(path + ".tmp", "wb")
        self.file.write(bytes(4 * HEADER_INTS))

    def write(self, tokens):
        data = np.ascontiguousarray(tokens, dtype="<u2").data  # no copy when already uint16
        self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)

    def close(self):
        """Finish the shard; returns the sha256 of its tokens."""
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = MAGIC, VERSION, self.tokens
        self.file.seek(0)
        self.file.write(header.tobytes())
        self.file.close()
        os.replace(self.path + ".tmp", self.path)
        return self.sha256.hexdigest()


def write_shard(path, tokens):
    """A whole shard at once; returns the sha256 of its tokens."""
    shard = ShardFile(path)
    shard.write(tokens)
    return shard.close()


def read_header(path):
    """A .bin shard's token count, after checking its magic, version and size."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)  # OSErrors: one line in open_shard
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
    return int(header[2])


def open_shard(path, vocab_size=None):
    """
    A shard's tokens as a read-only uint16 memmap: a .bin shard (ours, llm.c's, modded-nanogpt's;
    header checked) or a headerless .npy (build-nanogpt's). With vocab_size, a token id the model
    cannot embed is an error here rather than a crash at the first step.
    """
    try:
        if path.endswith(".npy"):
            tokens = np.load(path, mmap_mode="r")
            if tokens.dtype != np.dtype("<u2") or tokens.ndim != 1:
                raise DataError(f"{path}: a {tokens.ndim}-d {tokens.dtype} array; a token shard is 1-d uint16")
        else:
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_INTS * 4, shape=(read_header(path),))
    except FileNotFoundError:
        raise DataError(f"{path}: no such shard; run data/prepare.py to create it") from None
    except (OSError, ValueError, EOFError) as e:  # a directory, no permission, an empty or damaged .npy, ...
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise DataError(f"{path}: cannot be read as a token shard ({reason}); replace it, "
                        f"or re-run data/prepare.py if it made it") from None
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:  # one pass: 100M tokens in ~0.02 s (page cache)
        first = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token id {int(tokens[first])} at position {first:,} is >= vocab_size {vocab_size}; "
                        f"the shard was made with another tokenizer, or vocab_size is too small")
    return tokens


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
    """The validation shard and the sorted train shards in data_dir."""
    make = ("create it with data/prepare.py (python data/prepare.py shakespeare for the bundled corpus), "
            "or point data_dir at a directory of llm.c / modded-nanogpt .bin or build-nanogpt .npy shards")
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
    return os.path.join(data_dir, val[0]), train


def read_json(path):
    with open(path) as f:
        return json.load(f)


def shard_problems(data_dir, manifest, full):
    """{file name: one-line problem} for each shard file in data_dir that differs from the manifest:
    missing, damaged, other tokens (full: by sha256), or not listed at all."""
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
            tokens = open_shard(path)
        except DataError as e:
            problems[shard["name"]] = str(e)
            continue
        if len(tokens) != shard["tokens"]:
            problems[shard["name"]] = f"{path} holds {len(tokens):,} tokens, manifest.json lists {shard['tokens']:,}; {rebuild}"
        elif full and hashlib.sha256(tokens).hexdigest() != shard["sha256"]:
            problems[shard["name"]] = f"{path}: its tokens differ from manifest.json (sha256); {rebuild}"
    return problems


def verify_manifest(data_dir, full=False):
    """
    When data_dir holds a manifest.json (written by prepare), its shard files must be exactly those
    listed, with the listed sizes (full: and token sha256); returns the manifest, or None without one
    (shards made elsewhere, checked by open_shard alone).
    """
    path = os.path.join(data_dir, "manifest.json")
    if not os.path.exists(path):
        return None
    manifest = read_json(path)
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
    """(openers, [[name, size], ...]) of the input files in order; local names are relative to out_dir
    (as the recorded glob), hub files have no size before they are downloaded."""
    if not input:
        openers, names = fineweb_paths(subset, os.path.join(out_dir, "download"))
        return openers, [[n, None] for n in names]
    paths = sorted(glob.glob(input, recursive=True))
    if not paths:
        raise DataError(f"--input {input!r} matches no files")
    return [lambda p=p: p for p in paths], [[os.path.relpath(p, out_dir), os.path.getsize(p)] for p in paths]


def check_inputs(recorded, files, out_dir):
    """The input list is part of the resume state: resume positions index into it."""
    if recorded != files:
        old, new = dict(map(tuple, recorded)), dict(map(tuple, files))
        changes = ([f"{n} is new" for n in new if n not in old] + [f"{n} is gone" for n in old if n not in new] +
                   [f"{n} was {old[n]:,} bytes, now {new[n]:,}" for n in new if n in old and old[n] != new[n]])
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


def _init_worker():
    global _tokenizer
    _tokenizer = gpt2_tokenizer()


def tokenize(texts):
    """EOT + tokens for each document, concatenated; plus each document's length."""
    # encode_to_numpy returns a buffer, not a list of Python ints: 7% faster than encode_ordinary.
    # With no special token allowed or disallowed, a literal "<|endoftext|>" in a document is
    # plain text, as in encode_ordinary
    eot = np.array([EOT], dtype=np.uint32)
    docs = [_tokenizer.encode_to_numpy(t, disallowed_special=()) for t in texts]
    tokens = np.concatenate([part for d in docs for part in (eot, d)]).astype(np.uint16)
    return tokens, np.array([len(d) + 1 for d in docs])


def tokenized_batches(documents, workers):
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
        _init_worker()
        for texts, where in tasks():
            yield (*tokenize(texts), where)
        return
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker) as pool:
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

    def __init__(self, out_dir, progress, val_tokens, val_docs, shard_tokens):
        self.out_dir, self.progress = out_dir, progress
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
            self.shard = ShardFile(os.path.join(self.out_dir, f"{'val' if index == 0 else 'train'}_{index:06d}.bin"))
        return self.shard

    def flush(self, next_position):
        shard = self.open()
        self.progress["shards"].append(dict(name=os.path.basename(shard.path), tokens=shard.tokens, sha256=shard.close(),
                                            start=self.progress["next"]))  # where it starts: it can be rebuilt alone
        self.progress["next"] = list(next_position)
        write_json(os.path.join(self.out_dir, "progress.json"), self.progress)
        self.shard = None


def write_json(path, obj):
    """Written to path.tmp and renamed: a reader never sees half a file, a full disk leaves no .tmp behind."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise DataError(f"cannot write {path} ({e.strerror or e}); free disk space or check the permissions "
                        f"of {os.path.dirname(path) or '.'}") from None


def prepare(out_dir, input=None, subset="sample-10BT", max_tokens=None, val_tokens=10_485_760,
            val_docs=0, shard_tokens=100_000_000, workers=None, quiet=False):
    """Tokenize the input into shards under out_dir; returns the manifest (see module docstring)."""
    from tqdm import tqdm
    workers = workers or os.cpu_count()
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"out_dir {out_dir} is a file; choose a directory")
    # the input glob is recorded relative to out_dir, so moving the whole project keeps it valid
    arguments = dict(input=input and os.path.relpath(input, out_dir), subset=None if input else subset, max_tokens=max_tokens,
                     val_tokens=val_tokens, val_docs=val_docs, shard_tokens=shard_tokens)
    manifest_path, progress_path = os.path.join(out_dir, "manifest.json"), os.path.join(out_dir, "progress.json")
    previous = {path: read_json(path) for path in (manifest_path, progress_path) if os.path.exists(path)}
    for record in previous.values():
        if record["arguments"] != arguments:
            raise DataError(f"{out_dir} holds shards made with other arguments ({record['arguments']}); "
                            f"choose another --out_dir or delete it")
    if manifest_path in previous:
        return repair(out_dir, previous[manifest_path], input, subset, workers, quiet)
    os.makedirs(out_dir, exist_ok=True)
    check_tokenizer_file()  # fail now, not in a worker, if the vocabulary file is damaged
    paths, files = input_files(input, subset, out_dir)
    progress = previous.get(progress_path) or dict(arguments=arguments, inputs=files, shards=[], next=[0, 0, 0])
    check_inputs(progress.setdefault("inputs", files), files, out_dir)  # (a progress.json older than the record adopts it)
    for shard in progress["shards"]:  # a resume trusts only shards that still open cleanly
        open_shard(os.path.join(out_dir, shard["name"]))

    start_file, start_row, start_offset = progress["next"]
    done = sum(s["tokens"] for s in progress["shards"])
    remaining = (int(max_tokens) - done) if max_tokens else float("inf")
    writer = ShardWriter(out_dir, progress, int(val_tokens), int(val_docs), int(shard_tokens))
    bar = tqdm(total=int(max_tokens) if max_tokens else None, initial=done, unit="tok", unit_scale=True,
               desc="tokenizing", disable=quiet)
    offset = start_offset  # the first document resumes mid-way through its tokens
    for tokens, lengths, where in tokenized_batches(read_documents(paths, start_file, start_row), workers):
        taken = writer.add_batch(tokens, lengths, where, offset, remaining)
        remaining -= taken
        bar.update(taken)
        offset = 0
        if remaining <= 0:
            break
    bar.close()
    if writer.shard or not progress["shards"]:
        writer.flush((len(paths), 0, 0))
    if len(progress["shards"]) < 2:
        raise DataError(f"the input holds too few tokens for a validation shard and a train shard "
                        f"({sum(s['tokens'] for s in progress['shards']):,}); lower --val_tokens or --val_docs")
    manifest = dict(arguments=arguments, inputs=files, tokenizer="gpt2", tokenizer_sha256=TOKENIZER_SHA256,
                    total_tokens=sum(s["tokens"] for s in progress["shards"]),
                    val_tokens=progress["shards"][0]["tokens"], shards=progress["shards"])
    write_json(manifest_path, manifest)
    os.remove(progress_path)
    if not quiet:
        print(f"wrote {len(manifest['shards'])} shards, {manifest['total_tokens']:,} tokens "
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
    check_tokenizer_file()
    paths, files = input_files(input, subset, out_dir)
    check_inputs(manifest["inputs"], files, out_dir)
    for shard in manifest["shards"]:
        if shard["name"] in problems:
            if not quiet:
                print(f"rebuilding {shard['name']}: {problems[shard['name']].split(';')[0]}")
            rebuild_shard(out_dir, paths, shard, workers)
    return manifest


def rebuild_shard(out_dir, paths, shard, workers):
    file_index, row, offset = shard["start"]
    out = ShardFile(os.path.join(out_dir, shard["name"]))
    for tokens, _, _ in tokenized_batches(read_documents(paths, file_index, row), workers):
        out.write(tokens[offset:offset + shard["tokens"] - out.tokens])
        offset = 0
        if out.tokens == shard["tokens"]:
            break
    if out.sha256.hexdigest() != shard["sha256"]:
        out.file.close()
        os.remove(out.path + ".tmp")
        raise DataError(f"{out.path}: rebuilt from the inputs, its tokens differ from manifest.json (did the input files "
                        f"change?); delete {out_dir} and prepare it again")
    out.close()


def prepare_bundled(out_dir=BUNDLED_OUT, quiet=False):
    """The embedded default dataset: Shakespeare, three whole plays held out for validation."""
    # 1.6M tokens take a quarter second in this process; a spawned worker would first re-import the
    # caller's main module (train.py: torch), which takes longer
    return prepare(out_dir, input=os.path.join(BUNDLED_CORPUS, "*.txt"), val_docs=BUNDLED_VAL_DOCS,
                   shard_tokens=100_000_000, workers=1, quiet=quiet)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", nargs="?", choices=["shakespeare"], help="prepare the bundled corpus")
    parser.add_argument("--input", help="glob of local .parquet/.jsonl/.txt files (default: FineWeb-Edu from the hub)")
    parser.add_argument("--subset", default="sample-10BT", help="FineWeb-Edu subset (sample-10BT, sample-100BT, CC-MAIN-2024-10, ...)")
    parser.add_argument("--out_dir", help="output directory (default: data/<source>)")
    parser.add_argument("--max_tokens", type=float, help="stop after this many tokens (e.g. 2.1e9)")
    parser.add_argument("--val_tokens", type=float, default=10_485_760, help="validation shard: the first N tokens")
    parser.add_argument("--val_docs", type=int, default=0, help="validation shard: the first N whole documents instead")
    parser.add_argument("--shard_tokens", type=float, default=1e8, help="tokens per train shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    args = parser.parse_args()
    try:
        if args.preset == "shakespeare":
            prepare_bundled(args.out_dir or BUNDLED_OUT)
        else:
            out_dir = args.out_dir or os.path.join(HERE, "fineweb_edu_" + args.subset if not args.input else "local")
            prepare(out_dir, input=args.input, subset=args.subset, max_tokens=args.max_tokens,
                    val_tokens=args.val_tokens, val_docs=args.val_docs, shard_tokens=args.shard_tokens,
                    workers=args.workers)
    except DataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
