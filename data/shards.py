"""
What training reads: the token shard format (llm.c / modded-nanogpt: a 256 x int32 header of magic
20240520, version 1 and the token count, then uint16 tokens; build-nanogpt's headerless .npy too),
finding a data_dir's shards, checking them against data/prepare.py's manifest.json, the two
tokenizers: gpt2 (50,257 ids) and bytes (the 256 UTF-8 byte values plus end-of-text: 257 ids), and
the checks of a run's data before anything trains (resolve_data_dir, find_data, open_data: train.py).
It never writes shards: data/prepare.py does, and prepares a bundled corpus on first use (find_or_prepare_data);
format and guarantees: docs/shards.md.
"""

import dataclasses
import hashlib
import os
from contextlib import contextmanager

import numpy as np

from common import ConfigError, DataError, read_json, write_atomic

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_FILE = os.path.join(HERE, "gpt2.tiktoken")
TOKENIZER_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# tiktoken's r50k_base split pattern (GPT-2); kept here so no tiktoken download is ever needed
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256


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
# the bundled corpora's outputs, data/<corpus>_<tokenizer> -> tokenizer: data/prepare.py's prepare_bundled makes
# them on demand (Shakespeare; the Python documentation the interpreter ships, another genre)
BUNDLED_CORPORA = ("shakespeare", "pydoc")
BUNDLED = {os.path.join(HERE, f"{corpus}_{name}"): name for corpus in BUNDLED_CORPORA for name in TOKENIZERS}


def bundled_corpus(path):
    """The corpus a bundled output holds, by its name data/<corpus>_<tokenizer> (Shakespeare for another name)."""
    corpus = os.path.basename(os.path.abspath(path)).rpartition("_")[0]
    return corpus if corpus in BUNDLED_CORPORA else "shakespeare"


def get_tokenizer(name):
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


# -----------------------------------------------------------------------------
# shard format

def shard_header(tokens, vocab_size):
    """The 1024-byte header of a shard of that many tokens; [3]: which tokenizer (readers of the format ignore it)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = MAGIC, VERSION, tokens, vocab_size
    return header.tobytes()


def write_shard(path, tokens, tokenizer="gpt2"):
    """A whole shard at once, written atomically; returns the sha256 of its tokens."""
    data = np.ascontiguousarray(tokens, dtype="<u2")

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(shard_header(len(data), TOKENIZERS[tokenizer].vocab_size))
            f.write(data.data)
    write_atomic(path, write)
    return hashlib.sha256(data.data).hexdigest()


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


def open_shard(path, vocab_size=None, tokenizer=None):
    """
    A shard's tokens as a read-only uint16 memmap: a .bin shard (ours, llm.c's, modded-nanogpt's;
    header checked) or a headerless .npy (build-nanogpt's). With tokenizer (the name the data's manifest
    or headers give), an id that tokenizer does not have is an error (a model padded past its ids would
    train on it silently); with vocab_size, so is an id the model cannot embed (rather than a crash at
    the first step). Either is one max over the shard: 100M tokens in ~0.02 s (page cache).
    """
    with reading_shard(path):
        if path.endswith(".npy"):
            tokens = np.load(path, mmap_mode="r")
            if tokens.dtype != np.dtype("<u2") or tokens.ndim != 1:
                raise DataError(f"{path}: a {tokens.ndim}-d {tokens.dtype} array; a token shard is 1-d uint16")
        else:
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_INTS * 4, shape=(read_header(path)[0],))
    if (vocab_size is None and tokenizer is None) or not len(tokens):
        return tokens
    top = int(tokens.max())
    ids = TOKENIZERS[tokenizer].vocab_size if tokenizer else None
    if ids is not None and top >= ids:
        first = int(np.argmax(tokens >= ids))
        raise DataError(f"{path}: token id {int(tokens[first])} at position {first:,} is not a {tokenizer} token (its "
                        f"ids are 0-{ids - 1}), the tokenizer its data names (manifest.json or the shard headers); "
                        f"re-make the shard with data/prepare.py, or move it out of {os.path.dirname(path) or '.'}")
    if vocab_size is not None and top >= vocab_size:
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
    make = (f"create it with: python data/prepare.py {bundled_corpus(data_dir)} --tokenizer={bundled}" if bundled else
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


SHARD_FIELDS = dict(name=str, tokens=int, sha256=str)
RECORD_FIELDS = {"manifest.json": dict(arguments=dict, inputs=list, tokenizer=str, total_tokens=int, shards=list),
                 "progress.json": dict(arguments=dict, shards=list, next=list)}


def read_prepare_record(path):
    """manifest.json or progress.json, checked: a torn file, or one prepare.py did not write, is one line."""
    remedy = (f"restore it, or delete {os.path.dirname(path) or '.'} and run data/prepare.py again (or, for shards "
              f"made elsewhere, remove {os.path.basename(path)})")
    try:
        record = read_json(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read as JSON ({e.strerror if isinstance(e, OSError) else e}); {remedy}") from None
    fields = RECORD_FIELDS[os.path.basename(path)]
    bad = [k for k, kind in fields.items() if not isinstance(record, dict) or not isinstance(record.get(k), kind)]
    bad += [f"shards[{i}]" for i, s in enumerate(record.get("shards", []) if not bad else [])
            if not isinstance(s, dict) or any(not isinstance(s.get(k), kind) for k, kind in SHARD_FIELDS.items())]
    # a name with a folder in it (../x.bin, /abs.bin) would have a repair write outside data_dir
    bad += [f"shards[{i}] name {s['name']!r}, not a shard file of this folder"
            for i, s in enumerate(record["shards"] if not bad else [])
            if os.path.basename(s["name"]) != s["name"] or not shard_split(s["name"])]
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
    manifest = read_prepare_record(path)
    problems = shard_problems(data_dir, manifest, full)
    if problems:
        raise DataError(next(iter(problems.values())))
    return manifest


# -----------------------------------------------------------------------------
# the data a run trains on: train.py's checks before anything trains

def resolve_data_dir(path):
    """data_dir as an absolute path: a relative one is taken from the working directory when it is
    there, else from the project directory (so the bundled default works from anywhere)."""
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    return os.path.abspath(os.path.join(os.path.dirname(HERE), path))


@dataclasses.dataclass
class DataFiles:
    """What find_data found: the absolute data_dir, its tokenizer (byte and GPT-2 cells never pair), its
    manifest (None without one) and its shards."""
    dir: str
    tokenizer: str
    manifest: dict | None
    val_path: str
    train_paths: list


def find_data(cfg, runtime):
    """cfg's data_dir as DataFiles, with the shards' names and sizes checked against the manifest. Shards are
    only read here: train.py's find_data (data/prepare.py's find_or_prepare_data) prepares a bundled corpus first."""
    data_dir = resolve_data_dir(cfg["data_dir"])
    manifest = verify_manifest(data_dir, full=cfg["verify_shards"] and runtime.master)  # the sha256s once, on rank 0
    val_path, train_paths = find_shards(data_dir)
    tokenizer = manifest["tokenizer"] if manifest else shard_tokenizer(val_path)
    return DataFiles(data_dir, tokenizer, manifest, val_path, train_paths)


def data_vocab_size(tokenizer):
    """The vocabulary of a tokenizer's data: its ids padded to a multiple of 64 (bytes 320, gpt2 50304)."""
    return -(-TOKENIZERS[tokenizer].vocab_size // 64) * 64


def open_data(cfg, data, vocab_size, init_tokenizer):
    """The validation shard and the train shards of find_data's data, every one checked before
    anything trains (other validation tokens show in each cell's val_hash)."""
    manifest, val_path, train_paths = data.manifest, data.val_path, data.train_paths
    tokenizer, data_dir = cfg["tokenizer"], cfg["data_dir"]
    if init_tokenizer not in (None, tokenizer):  # the same ids would be other tokens
        raise ConfigError(f"init_from={cfg['init_from']} was trained on {init_tokenizer} tokens, data_dir {data_dir} "
                          f"holds {tokenizer} tokens; warm-start on data of the checkpoint's tokenizer")
    needed = TOKENIZERS[tokenizer].vocab_size
    if manifest and vocab_size < needed:
        raise ConfigError(f"vocab_size={vocab_size} is less than the {needed} ids of {data_dir}'s {tokenizer} tokens; "
                          f"set --vocab_size={data_vocab_size(tokenizer)} (padded to a multiple of 64), or leave it unset")
    val = open_shard(val_path, vocab_size, tokenizer)
    if cfg["eval_tokens"] > len(val):
        raise ConfigError(f"eval_tokens={cfg['eval_tokens']} is more than the validation shard {val_path} holds "
                          f"({len(val):,} tokens); lower eval_tokens")
    train_shards = [open_shard(path, vocab_size, tokenizer) for path in train_paths]
    return val, train_shards
