"""
Text -> tokens -> uint16 shards (llm.c / modded-nanogpt format: a 256 x int32 header of magic
20240520, version 1 and the token count, then the tokens). Shard 0 is validation. Two tokenizers:
gpt2 (50,257 ids, the default) and bytes (the 256 UTF-8 byte values plus end-of-text: 257 ids).

$ python data/prepare.py shakespeare                       # the bundled corpus -> data/shakespeare_gpt2
$ python data/prepare.py shakespeare --tokenizer=bytes     # the bundled corpus -> data/shakespeare_bytes
$ python data/prepare.py pydoc --tokenizer=bytes           # the second, Python's own docs -> data/pydoc_bytes
$ python data/prepare.py --max_tokens=2.1e9               # FineWeb-Edu sample-10BT from the HF hub
$ python data/prepare.py --input='docs/*.parquet' --out_dir=data/mine   # local parquet/jsonl/txt

The token stream is every document in input order (sorted paths, rows in file order), each
preceded by end-of-text; the shards cut it in order whatever the number of workers. A run that
is interrupted continues where its last complete shard ended when started again with the same
arguments and input files, and writes byte-identical shards. Started on a finished output, it
checks every shard against manifest.json (sha256) and rebuilds any that is missing or damaged.
Training reads shards with data/shards.py (find_shards, open_shard, verify_manifest), which also
accepts llm.c, modded-nanogpt and build-nanogpt shards. Format and guarantees: docs/shards.md.
"""

import errno
import glob
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import stat
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run as a script: the repository's modules too
from common import DataError, LockHeld, Parser, check_writable, pid_lock, run, write_json, write_text  # noqa: E402
from data.shards import (BUNDLED, HEADER_INTS, TOKENIZER_SHA256, TOKENIZERS, bundled_corpus, find_data,  # noqa: E402
                         get_tokenizer, open_shard, read_prepare_record, resolve_data_dir, shard_header, shard_problems)

BUNDLED_CORPUS = os.path.join(HERE, "shakespeare")  # Open Shakespeare (see data/README.md)
BUNDLED_VAL_DOCS = 3  # whole held-out plays: the first three in sorted order
PYDOC_VAL_DOCS = 20  # whole held-out topics of the second corpus: the first 20 in sorted order (54 KB of 466 KB on 3.11)
FINEWEB_REPO = "HuggingFaceFW/fineweb-edu"
TASK_CHARS = 1 << 22  # text per tokenizer task (4 MB): big enough to amortise IPC, small enough to bound memory
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 64, 1 << 16  # an input file's sampled content hash: 4 MiB at most


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
            if os.path.lexists(self.tmp):
                os.remove(self.tmp)  # a killed run's: out_dir's lock says no other run is writing it
            self.file = open(self.tmp, "xb")  # exclusive: a symlink planted at this name is not followed
            self.file.write(bytes(4 * HEADER_INTS))  # the header is written last: a torn file has none

    def write(self, tokens):
        data = np.ascontiguousarray(tokens, dtype="<u2").data  # no copy when already uint16
        with self.removed_on_error():
            self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)

    def close(self):
        """Finish the shard; returns the sha256 of its tokens."""
        with self.removed_on_error():
            self.file.seek(0)
            self.file.write(shard_header(self.tokens, self.vocab_size))
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


# -----------------------------------------------------------------------------
# sources: documents as (file index, row index, text), starting from a resume position

def read_documents(paths, start_file=0, start_row=0):
    for file_index in range(start_file, len(paths)):
        skip = start_row if file_index == start_file else 0
        path = paths[file_index]()  # a callable: FineWeb files are downloaded only when reached
        for row, text in enumerate(read_file(path, skip), start=skip):
            yield file_index, row, text


def read_file(path, skip):
    """The documents of one file from row skip on; a file that cannot be read is one line naming it."""
    try:
        if path.endswith(".parquet"):
            yield from read_parquet(path, skip)
        elif path.endswith(".jsonl"):
            yield from read_jsonl(path, skip)
        elif path.endswith(".txt"):
            yield from read_txt(path, skip)
        else:
            raise DataError(f"{path}: {UNSUPPORTED}")
    except OSError as e:  # gone, no permission, an I/O error (pyarrow's too)
        raise unreadable(path, e.strerror or str(e).splitlines()[0]) from None


UNSUPPORTED = "unsupported file type; use .parquet (column 'text'), .jsonl (field 'text') or .txt"


def unreadable(path, reason):
    return DataError(f"{path}: cannot be read ({reason}); replace it (a copy or download cut short?) or leave it "
                     f"out of --input")


def read_parquet(path, skip):
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except pa.ArrowInvalid as e:  # empty, truncated, not parquet at all
        raise unreadable(path, str(e).splitlines()[0]) from None
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    kind = pf.schema_arrow.field("text").type
    if not is_text(kind):
        raise DataError(f"{path}: column 'text' holds {kind}, not strings")
    groups, row = [], 0  # row: the file row of the next batch's first document
    for g in range(pf.num_row_groups):  # skip whole leading row groups on resume without reading them
        n = pf.metadata.row_group(g).num_rows
        if not groups and skip >= n:
            skip, row = skip - n, row + n
        else:
            groups.append(g)
    if groups:
        try:
            for batch in pf.iter_batches(batch_size=1024, row_groups=groups, columns=["text"]):
                texts = batch.column(0)
                if texts.null_count:
                    raise DataError(f"{path}: row {row + texts.is_null().to_pylist().index(True)}: 'text' is null")
                yield from texts.to_pylist()[skip:]
                skip, row = max(0, skip - len(texts)), row + len(texts)
        except pa.ArrowInvalid as e:  # a damaged page
            raise unreadable(path, f"row {row} on: {str(e).splitlines()[0]}") from None


def is_text(kind):
    """Whether an arrow column type holds strings: plain, large, a view, or dictionary-encoded (pandas'
    category dtype and many exporters write repeated strings so; the values read the same)."""
    import pyarrow as pa
    if pa.types.is_dictionary(kind):
        return is_text(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def read_jsonl(path, skip):
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
                except RecursionError:
                    raise DataError(f"{path}:{line_number}: JSON nested too deeply to read; fix or drop that line") from None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{line_number}: 'text' is {json.dumps(text)[:40]}, not a string")
                try:  # JSON's \ud800 escapes make lone surrogates, which are no text a tokenizer can encode
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise DataError(f"{path}:{line_number}: 'text' holds a lone surrogate (\\u{ord(text[e.start]):04x} "
                                    f"at character {e.start}), which is not text; fix or drop that line") from None
                yield text


def read_txt(path, skip):
    if skip == 0:
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()  # one document per file
        except UnicodeDecodeError:
            with open(path, "rb") as f:
                e = utf8_error(f.read())
            raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8") from None


def utf8_error(data):
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e


def local_inputs(input, out_dir):
    """
    The files the --input glob matches, in stream order (sorted), each file once: two names of one
    file (a symlink, or a ** glob through a symlink loop) are read once, under the first name. A
    folder, a file that is not a regular one, an unsupported type, or a match inside out_dir is one
    line, before anything is written.
    """
    matches = sorted(glob.glob(input, recursive=True))
    if not matches:
        raise DataError(f"--input {input!r} matches no files")
    out = os.path.realpath(out_dir)
    inside = [p for p in matches if os.path.commonpath([os.path.realpath(p), out]) == out]
    if inside:  # the first run would work, but then the glob would match what it wrote: no resume, no repair
        raise DataError(f"--input {input!r} matches {inside[0]}, inside --out_dir {out_dir}; "
                        f"choose an --out_dir outside the input folder")
    paths, seen = [], set()
    for path in matches:
        try:
            st = os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a ** glob's name 40 times round a symlink loop: matched by a shorter name too
                continue
            raise DataError(f"--input {input!r} matches {path}, which cannot be opened ({e.strerror}); "
                            f"remove it or give a narrower glob") from None
        if stat.S_ISDIR(st.st_mode):
            folder = path.rstrip(os.sep)
            raise DataError(f"--input {input!r} matches the folder {folder}; give a glob of files, e.g. "
                            f"--input='{os.path.join(folder, '*.txt')}' (or '{os.path.join(folder, '**', '*.txt')}' "
                            f"with its subfolders)")
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"--input {input!r} matches {path}, which is not a regular file (a pipe or a device); "
                            f"give a glob of files")
        if not path.endswith((".parquet", ".jsonl", ".txt")):
            raise DataError(f"{path}: {UNSUPPORTED}")
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            paths.append(path)
    return paths


def input_files(local, subset, out_dir):
    """(openers, [[name, size, fingerprint], ...]) of the input files in order: local ones (local_inputs),
    named relative to out_dir (as the recorded glob), else the hub's, which have no size or fingerprint
    before they are downloaded."""
    if local is None:
        openers, names = fineweb_paths(subset, os.path.join(out_dir, "download"))
        return openers, [[n, None, None] for n in names]
    files = []
    for path in local:
        try:
            files.append([os.path.relpath(path, out_dir), os.path.getsize(path), fingerprint(path)])
        except OSError as e:
            raise unreadable(path, e.strerror or e) from None
    return [lambda p=p: p for p in local], files


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
        if self.val_docs and not self.progress["shards"] and shard.tokens < MIN_SHARD:  # the caller discards it
            raise DataError(f"--val_docs={self.val_docs} holds out {shard.tokens:,} tokens, fewer than one validation "
                            f"sequence of the paper configs' 1,024 tokens and its target ({MIN_SHARD:,}); raise "
                            f"--val_docs, or give --val_tokens instead")
        self.progress["shards"].append(dict(name=os.path.basename(shard.path), tokens=shard.tokens, sha256=shard.close(),
                                            start=self.progress["next"]))  # where it starts: it can be rebuilt alone
        self.progress["next"] = list(next_position)
        write_json(os.path.join(self.out_dir, "progress.json"), self.progress)
        self.shard = None


def prepare(out_dir, input=None, tokenizer="gpt2", subset="sample-10BT", max_tokens=None, val_tokens=10_485_760,
            val_docs=0, shard_tokens=100_000_000, workers=None, quiet=False):
    """Tokenize the input into shards under out_dir; returns the manifest (see module docstring). Every
    argument and the input files are checked before anything is written."""
    max_tokens = None if max_tokens is None else count("max_tokens", max_tokens)
    val_tokens = count("val_tokens", val_tokens, most=MAX_SHARD)  # < 0 would copy validation tokens into training
    shard_tokens = count("shard_tokens", shard_tokens, most=MAX_SHARD)  # < 1: empty shards without end
    if shard_tokens < MIN_SHARD:
        raise DataError(f"--shard_tokens={shard_tokens} is below {MIN_SHARD:,}: a train shard must hold a sequence of "
                        f"1,024 tokens and its target (sequences never cross shards, so a smaller shard would never "
                        f"be trained on); raise it (default 1e8)")
    val_docs, workers = count("val_docs", val_docs, least=0), count("workers", os.cpu_count() if workers is None else workers)
    if max_tokens is not None and not val_docs and max_tokens <= val_tokens:
        raise DataError(f"--max_tokens={max_tokens} leaves no tokens to train on after --val_tokens={val_tokens}; "
                        f"raise --max_tokens or lower --val_tokens")
    get_tokenizer(tokenizer)  # fail now, not in a worker, on an unknown name or a damaged vocabulary file
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"out_dir {out_dir} is a file; choose a directory")
    local = local_inputs(input, out_dir) if input else None
    # the input glob is recorded relative to out_dir, so moving the whole project keeps it valid
    arguments = dict(input=input and os.path.relpath(input, out_dir), tokenizer=tokenizer, subset=None if input else subset,
                     max_tokens=max_tokens, val_tokens=val_tokens, val_docs=val_docs, shard_tokens=shard_tokens)
    check_writable(out_dir, "choose another --out_dir")
    with pid_lock(os.path.join(out_dir, "lock"), f"{out_dir} is being prepared"):
        return prepare_locked(out_dir, arguments, local, workers, quiet)


MAX_SHARD = 2**31 - 1  # a shard header holds its token count as an int32
# a train shard holds at least one sequence of the paper configs' context (block_size 1024, plus its
# target): sequences never cross shards, so a smaller shard's tokens would never be trained on. So does a
# validation shard of whole documents (--val_docs), whose size no argument states (--val_tokens states its own)
MIN_SHARD = 1025


def count(name, value, least=1, most=math.inf):
    """A count argument as an int: a whole number from least to most (2.1e9 is one; 0.5, nan and inf are not)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or not least <= value <= most):
        limit = f"from {least:,} to {most:,}" if most < math.inf else f"of at least {least:,}"
        raise DataError(f"--{name}={value} must be a whole number {limit}")
    return int(value)


def prepare_locked(out_dir, arguments, local, workers, quiet):
    from tqdm import tqdm
    tokenizer, max_tokens = arguments["tokenizer"], arguments["max_tokens"]
    manifest_path, progress_path = os.path.join(out_dir, "manifest.json"), os.path.join(out_dir, "progress.json")
    previous = {path: read_prepare_record(path) for path in (manifest_path, progress_path) if os.path.exists(path)}
    for record in previous.values():
        recorded = {"tokenizer": "gpt2"} | record["arguments"]  # by a prepare.py before the tokenizer was an argument
        if recorded != arguments:
            raise DataError(f"{out_dir} holds shards made with other arguments ({recorded}); "
                            f"choose another --out_dir or delete it")
    if manifest_path in previous:
        return repair(out_dir, previous[manifest_path], local, arguments["subset"], workers, quiet)
    paths, files = input_files(local, arguments["subset"], out_dir)
    progress = previous.get(progress_path) or dict(arguments=arguments, inputs=files, shards=[], next=[0, 0, 0])
    check_inputs(progress.setdefault("inputs", files), files, out_dir)  # (a progress.json older than the record adopts it)
    for shard in progress["shards"]:  # a resume trusts only shards that still open cleanly
        open_shard(os.path.join(out_dir, shard["name"]))

    start_file, start_row, start_offset = progress["next"]
    done = sum(s["tokens"] for s in progress["shards"])
    remaining = (max_tokens - done) if max_tokens else float("inf")
    writer = ShardWriter(out_dir, progress, tokenizer, arguments["val_tokens"], arguments["val_docs"], arguments["shard_tokens"])
    bar = tqdm(total=max_tokens, initial=done, unit="tok", unit_scale=True,
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


def repair(out_dir, manifest, local, subset, workers, quiet):
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
    paths, files = input_files(local, subset, out_dir)
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


# -----------------------------------------------------------------------------
# the held-out documents by name (what report.md says the validation text was)

def held_out_names(manifest, out_dir):
    """The names of the documents the validation shard holds, in its order, from out_dir's manifest; None where
    they cannot be told. They are the documents of the stream before the first train shard's start, and the one it
    starts inside (--val_tokens cuts one). A .txt file is one document, named by its path below the inputs' common
    folder; a .jsonl or .parquet row is '<file> row <r>' (from 0), a .jsonl row with a 'topic' (the bundled Python
    documentation's) its topic. The rows of a file held out whole are counted from the file, found where it was read
    (or in data/pydoc/) with the fingerprint the manifest records."""
    shards, inputs = manifest["shards"], manifest["inputs"]
    if len(shards) < 2 or not isinstance(shards[1].get("start"), list):
        return None  # an older prepare.py's, which did not record where a shard starts
    last_file, last_row, offset = shards[1]["start"]
    short = input_names([i[0] for i in inputs])
    names = []
    for f in range(min(last_file + 1, len(inputs))):
        rows = last_row + (offset > 0) if f == last_file else document_count(inputs[f], out_dir)
        if rows is None:
            return None
        names += row_names(inputs[f], short[f], rows, out_dir)
    return names


def held_out_names_in(data_dir):
    """held_out_names of a prepared folder; None for shards made elsewhere (no manifest.json)."""
    path = os.path.join(data_dir, "manifest.json")
    return held_out_names(read_prepare_record(path), data_dir) if os.path.exists(path) else None


def input_names(paths):
    """Input paths below the folder they all share: the file names of one folder, subfolders kept."""
    parts = [p.split("/") for p in paths]
    common = 0
    while all(len(q) > common + 1 and q[common] == parts[0][common] for q in parts):
        common += 1
    return ["/".join(q[common:]) for q in parts]


def found_input(entry, out_dir):
    """An input file as recorded ([path, bytes, fingerprint]) where it still is, unchanged; else None."""
    path, recorded = entry[0], entry[2] if len(entry) > 2 else None  # [path, bytes]: an older prepare.py's
    hub = f"hf://datasets/{FINEWEB_REPO}/"
    where = os.path.join(out_dir, "download", path[len(hub):]) if path.startswith(hub) else os.path.join(out_dir, path)
    for candidate in (where, os.path.join(HERE, "pydoc", os.path.basename(path))):
        try:
            if recorded and recorded == fingerprint(candidate):
                return candidate
        except OSError:
            continue  # not there, or not readable: the next place
    return None


def document_count(entry, out_dir):
    """How many documents an input file holds: 1 for .txt, its rows otherwise (None where it is not found)."""
    if entry[0].endswith(".txt"):
        return 1
    path = found_input(entry, out_dir)
    if path is None:
        return None
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())  # a blank line is no row, as read_jsonl reads it


def row_names(entry, short, rows, out_dir):
    """The names of an input file's first rows documents."""
    if entry[0].endswith(".txt"):
        return [short] * rows
    topics = {}
    if entry[0].endswith(".jsonl") and (path := found_input(entry, out_dir)):
        with open(path, "rb") as f:
            for row, line in enumerate(line for line in f if line.strip()):
                if row == rows:
                    break
                topic = json.loads(line).get("topic")
                if isinstance(topic, str):
                    topics[row] = topic
    return [topics.get(row, f"{short} row {row}") for row in range(rows)]


def pydoc_topics():
    """The second bundled corpus's source: the CPython documentation every interpreter ships
    (pydoc_data.topics, the text help('topic') shows: the language reference), one topic per line
    of a jsonl file in sorted order. Another Python version ships other text, so the file is named
    by the version that wrote it, and the manifest's inputs name it: its shards and data fingerprint differ."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError("this Python has no pydoc_data (a trimmed install); use the Shakespeare corpus "
                        "(--data_dir=data/shakespeare_bytes) or prepare local files with --input") from None
    path = os.path.join(HERE, "pydoc", f"topics_python{platform.python_version()}.jsonl")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text(path, "".join(json.dumps(dict(topic=name, text=topics[name])) + "\n" for name in sorted(topics)))
    return path


def prepare_bundled(out_dir, tokenizer=None, quiet=False, corpus=None):
    """A bundled corpus, whole documents held out for validation: Shakespeare (three plays) or Python's
    documentation (pydoc_topics: 20 topics). corpus and tokenizer: those BUNDLED names for out_dir
    (data/<corpus>_<tokenizer>) unless given; Shakespeare for a folder of another name."""
    tokenizer = tokenizer or BUNDLED.get(os.path.abspath(out_dir))
    if tokenizer is None:
        raise DataError(f"{out_dir} is not one of the bundled outputs ({', '.join(BUNDLED)}); give the tokenizer")
    corpus = corpus or bundled_corpus(out_dir)
    input, val_docs = (pydoc_topics(), PYDOC_VAL_DOCS) if corpus == "pydoc" else \
        (os.path.join(BUNDLED_CORPUS, "*.txt"), BUNDLED_VAL_DOCS)
    # seconds in this process; a spawned worker would first re-import the caller's main module
    # (train.py: torch), which takes longer
    return prepare(out_dir, input=input, tokenizer=tokenizer, val_docs=val_docs, shard_tokens=100_000_000, workers=1,
                   quiet=quiet)


def prepare_bundled_or_wait(data_dir):
    """The bundled corpus prepared on first use: by this process, or by the one preparing it now (a
    worker of the same grid started meanwhile), which this one waits for."""
    said = False
    while True:
        try:
            return prepare_bundled(data_dir)
        except LockHeld as e:
            if not said:
                print(f"waiting for {data_dir}: being prepared by {e.holder}")
            said = True
            time.sleep(2)


def find_or_prepare_data(cfg, runtime):
    """data/shards.py's find_data of cfg's data_dir, a bundled corpus prepared first where it is missing: by rank 0
    (prepare_bundled_or_wait), the other ranks waiting for it. What train.py calls find_data."""
    data_dir = resolve_data_dir(cfg["data_dir"])
    if data_dir in BUNDLED and not os.path.exists(os.path.join(data_dir, "manifest.json")):
        if runtime.master:
            prepare_bundled_or_wait(data_dir)
        if runtime.world > 1:
            import torch.distributed as dist  # here: this file is torch-free for the command line

            dist.barrier()
    return find_data(cfg, runtime)


def main(argv):
    parser = Parser("data/prepare.py", __doc__)
    parser.add_argument("preset", nargs="?", choices=["shakespeare", "pydoc"],
                        help="prepare a bundled corpus: Shakespeare, or the Python documentation this interpreter ships")
    parser.add_argument("--input", help="glob of local .parquet/.jsonl/.txt files (default: FineWeb-Edu from the hub)")
    parser.add_argument("--tokenizer", default="gpt2", choices=list(TOKENIZERS), help="gpt2 (50,257 ids) or bytes (257)")
    parser.add_argument("--subset", default="sample-10BT", help="FineWeb-Edu subset (sample-10BT, sample-100BT, CC-MAIN-2024-10, ...)")
    parser.add_argument("--out_dir", help="output directory (default: data/<source>, with _bytes for byte tokens)")
    parser.add_argument("--max_tokens", type=float, help="stop after this many tokens (e.g. 2.1e9)")
    parser.add_argument("--val_tokens", type=float, default=10_485_760, help="validation shard: the first N tokens")
    parser.add_argument("--val_docs", type=int, default=0, help="validation shard: the first N whole documents instead")
    parser.add_argument("--shard_tokens", type=float, default=1e8, help="tokens per train shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    args = parser.parse_args(argv)
    if args.preset:
        prepare_bundled(args.out_dir or os.path.join(HERE, f"{args.preset}_{args.tokenizer}"), args.tokenizer,
                        corpus=args.preset)
    else:
        source = "local" if args.input else "fineweb_edu_" + args.subset
        out_dir = args.out_dir or os.path.join(HERE, source + ("" if args.tokenizer == "gpt2" else "_" + args.tokenizer))
        prepare(out_dir, input=args.input, tokenizer=args.tokenizer, subset=args.subset, max_tokens=args.max_tokens,
                val_tokens=args.val_tokens, val_docs=args.val_docs, shard_tokens=args.shard_tokens,
                workers=args.workers)


if __name__ == "__main__":
    run(main)
