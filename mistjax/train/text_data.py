"""Text corpora for pretraining: ``.txt`` / ``.jsonl`` / ``.parquet`` files (or a Hugging Face ``datasets``
``save_to_disk`` folder), tokenized with a local ``tokenizer.json``, packed and shuffled by seed.

Design. The corpus is tokenized once, in file order and in bounded pieces (never the whole corpus in memory),
into a flat token file in a cache directory, next to a small JSON manifest. The cache is keyed by the file
list (paths, sizes, modification times), the tokenizer file's hash, the separator id and the text field, so a
second run reuses it and an edited file, another tokenizer or another ``--eos-id`` builds a new one. Batches
are then read from the memory-mapped token file, like `mistjax.train.data.MemmapTokens`.

The token stream is cut into sequences of ``seq_len + 1`` tokens at a stride of ``seq_len`` (each token is a
target once per epoch). Global sample ``g = step * batch + row`` is sequence ``perm_e(g mod M)`` of epoch
``e = g div M``, where ``perm_e`` is a bijection of ``[0, M)`` keyed by ``(seed, e)``: a Feistel network,
evaluated per index, so nothing is materialised however large the corpus. The batch of a step is therefore a
pure function of the token stream, the seed and the step: a resumed run reads exactly what an uninterrupted
run would have read, and every sequence is seen once per epoch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from mistjax.train.data import DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKEN_FILE_SUFFIX = ".bin"  # --data FILE.bin is a flat token file (MemmapTokens)
CACHE_FORMAT = 1  # bump when the cache's content or layout changes: old caches are then ignored
# A .txt file is one document, tokenized in pieces of about this many bytes: bounded memory for huge files (the
# tokenizer holds ~100 bytes per character of a piece), and pieces to encode in parallel.
TXT_PIECE_BYTES = 64 << 10
# Pieces handed to the tokenizer at once: its batch encoding runs in parallel threads, and holds a few hundred bytes
# per token while it does (tokens, offsets, masks), so a batch stays around 1 M characters.
ENCODE_CHARS, ENCODE_PIECES = 1 << 20, 1024
# End-of-text tokens looked for when the tokenizer's config does not name one (GPT-2, Llama/T5, Llama-3, Gemma).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
FEISTEL_ROUNDS = 6

Piece = tuple[str, int, bool]  # (text, source bytes it covers, ends a document)


# ------------------------------------------------------------------------------------ the corpus
@dataclass(frozen=True)
class Corpus:
    """What ``--data`` names: text files in reading order, or a ``datasets`` save_to_disk folder."""

    spec: str  # the --data value, for messages
    files: tuple[Path, ...]  # text files, sorted (empty for a datasets folder)
    dataset: Path | None = None  # a Hugging Face datasets save_to_disk folder

    def stat_files(self) -> list[Path]:
        """The files whose sizes and modification times key the cache."""
        if self.dataset is None:
            return list(self.files)
        return sorted(p for p in self.dataset.rglob("*") if p.is_file())


def is_token_file(data: str) -> bool:
    """True when ``--data`` names a flat binary token file (``.bin``) rather than text."""
    return Path(data).suffix == TOKEN_FILE_SUFFIX


def find_corpus(data: str) -> Corpus:
    """The text files (or datasets folder) that ``--data`` names: a file, a folder (searched recursively,
    hidden entries skipped) or a glob (``**`` for any depth).

    Raises:
      DataError: nothing there, an unsupported file type, or a folder with no text files.
    """
    path = Path(data).expanduser()
    if any(c in data for c in "*?["):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(data), recursive=True))
        if not matches:
            raise DataError(f"--data {data!r} matches no files; check the pattern (quote it so the shell does not "
                            "expand it)")
        files = [f for m in matches for f in (_folder_files(m, data) if m.is_dir() else [_text_file(m, data)])]
        return Corpus(data, tuple(sorted(set(files))))
    if path.is_dir():
        if _is_saved_dataset(path):
            return Corpus(data, (), dataset=path)
        return Corpus(data, tuple(_folder_files(path, data)))
    if path.is_file():
        return Corpus(data, (_text_file(path, data),))
    raise DataError(f"--data {data!r}: no such file or folder; pass a .bin token file, or text: a .txt, .jsonl or "
                    ".parquet file, a folder or a glob of them")


def _text_file(path: Path, data: str) -> Path:
    if path.suffix not in TEXT_SUFFIXES:
        raise DataError(f"--data {data!r}: unknown file type {path.suffix or '(no suffix)'!r} ({path}); text data "
                        f"must be {', '.join(TEXT_SUFFIXES)} files (a file, a folder or a glob), a token file must "
                        f"end in {TOKEN_FILE_SUFFIX}")
    return path


def _folder_files(folder: Path, data: str) -> list[Path]:
    """The folder's text files; other files (READMEs, licences) are skipped, hidden ones (caches) too."""
    found = [p for p in folder.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    files = sorted(p for p in found if p.suffix in TEXT_SUFFIXES)
    if not files:
        seen = sorted({p.suffix or "(no suffix)" for p in found})
        raise DataError(f"--data {data!r}: no {', '.join(TEXT_SUFFIXES)} files in folder {str(folder)!r}"
                        + (f" (found: {', '.join(seen)})" if seen else " (it is empty)")
                        + f"; pass a folder of text files, or a {TOKEN_FILE_SUFFIX} token file")
    return files


def _is_saved_dataset(folder: Path) -> bool:
    """A `datasets` save_to_disk folder: a Dataset's state and info files, or a DatasetDict's index."""
    return ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()) or \
        (folder / "dataset_dict.json").is_file()


# ------------------------------------------------------------------------------------ reading documents
def iter_pieces(corpus: Corpus, text_field: str) -> Iterator[Piece]:
    """Every document of the corpus in order, as pieces of text (see `Piece`)."""
    if corpus.dataset is not None:
        yield from _dataset_pieces(corpus.dataset, text_field)
        return
    readers = {".txt": lambda p: _txt_pieces(p), ".jsonl": lambda p: _jsonl_pieces(p, text_field),
               ".parquet": lambda p: _parquet_pieces(p, text_field)}
    for path in corpus.files:
        try:
            yield from readers[path.suffix](path)
        except OSError as e:  # unreadable (permissions, a file removed since it was listed)
            raise DataError(f"cannot read {str(path)!r} of --data {corpus.spec!r}: {e}") from None


def _txt_pieces(path: Path) -> Iterator[Piece]:
    """A .txt file is one document. Pieces are cut only where a line starts with a non-space character, a
    place where the usual pre-tokenizers (GPT-2's, Llama-3's) split anyway."""
    with open(path, "rb") as f:
        lines: list[bytes] = []
        size = 0
        for line in f:
            if size >= TXT_PIECE_BYTES and not line[:1].isspace():
                yield b"".join(lines).decode("utf-8", errors="replace"), size, False
                lines, size = [], 0
            lines.append(line)
            size += len(line)
        yield b"".join(lines).decode("utf-8", errors="replace"), size, True


def _jsonl_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                yield "", len(line), False
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{number} is not a JSON object ({e}); each line of a .jsonl file must be "
                                "one JSON object") from None
            yield _field_text(record, text_field, f"{path}:{number}"), len(line), True


def _field_text(record: object, text_field: str, where: str) -> str:
    """The document text of a record; a missing (None) value is an empty document."""
    if not isinstance(record, dict) or text_field not in record:
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no field {text_field!r} (it has: {keys}); pass --text-field NAME to name "
                        "the field that holds the text")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is a {type(text).__name__}, not text; pass --text-field "
                        "NAME to name the field that holds the text")
    return text or ""


def _parquet_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {str(path)!r} needs pyarrow, which is not installed: pip install pyarrow "
                        "(or convert the data to .jsonl)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a file that is not parquet (ArrowInvalid, ...)
        raise DataError(f"{str(path)!r} is not a readable parquet file ({e})") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{str(path)!r} has no column {text_field!r} (it has: {', '.join(map(repr, columns))}); "
                        "pass --text-field NAME to name the column that holds the text")
    rows, size = max(1, parquet.metadata.num_rows), path.stat().st_size
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        texts = batch.column(0).to_pylist()
        share = size * len(texts) // rows  # progress: the file's bytes, spread over its rows
        for i, text in enumerate(texts):
            yield _field_text({text_field: text}, text_field, str(path)), share if i == 0 else 0, True


def _dataset_pieces(folder: Path, text_field: str) -> Iterator[Piece]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {str(folder)!r} is a Hugging Face datasets folder (save_to_disk); reading it "
                        "needs the datasets package: pip install datasets") from None
    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"--data {str(folder)!r} is a DatasetDict without a 'train' split (splits: "
                            f"{', '.join(ds)}); pass the folder of one split, e.g. {folder / next(iter(ds))}")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise DataError(f"--data {str(folder)!r} has no column {text_field!r} (it has: "
                        f"{', '.join(map(repr, ds.column_names))}); pass --text-field NAME")
    size = sum(p.stat().st_size for p in folder.rglob("*.arrow"))
    rows = max(1, len(ds))
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        texts = batch[text_field]
        share = size * len(texts) // rows
        for i, text in enumerate(texts):
            yield _field_text({text_field: text}, text_field, str(folder)), share if i == 0 else 0, True


# ------------------------------------------------------------------------------------ the tokenizer
def load_tokenizer(path: str | None, data: str) -> tuple[Tokenizer, Path]:
    """The tokenizer of ``--tokenizer``: a ``tokenizer.json`` file, or a folder holding one; read locally.

    Raises:
      DataError: no ``--tokenizer`` for text data, no such file, or a file the tokenizers library cannot read.
    """
    if path is None:
        raise DataError(f"--data {data!r} is text, which needs a tokenizer: pass --tokenizer path/to/tokenizer.json "
                        "(a Hugging Face tokenizers file, e.g. from a model folder; nothing is downloaded)")
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"--tokenizer {path!r}: no such file; pass a tokenizer.json (or the folder holding one)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("text data needs the tokenizers package: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as e:  # the Rust library raises a bare Exception for malformed files
        raise DataError(f"--tokenizer {path!r} cannot be loaded ({str(e).splitlines()[0][:200]}); pass a "
                        "tokenizer.json written by Hugging Face tokenizers (Tokenizer.save, or save_pretrained of "
                        "a fast tokenizer)") from None


def separator_id(tokenizer: Tokenizer, file: Path, eos_id: int | None) -> int:
    """The id appended after every document: ``--eos-id``, else the end-of-text token named by a
    ``tokenizer_config.json`` beside the tokenizer, else the first of `EOS_CANDIDATES` it knows.

    Raises:
      DataError: no such token, or an ``--eos-id`` outside the tokenizer's vocabulary.
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if eos_id is not None:
        if not 0 <= eos_id < size:
            raise DataError(f"--eos-id {eos_id} is outside the tokenizer's {size} ids; pass an id below {size}")
        return eos_id
    for name in (_configured_eos(file), *EOS_CANDIDATES):
        if name is not None and (found := tokenizer.token_to_id(name)) is not None:
            return found
    raise DataError(f"--tokenizer {str(file)!r} has no end-of-text token (looked for "
                    f"{', '.join(EOS_CANDIDATES)} and tokenizer_config.json's eos_token); pass --eos-id ID, the id "
                    "that separates documents")


def _configured_eos(file: Path) -> str | None:
    """``eos_token`` of the ``tokenizer_config.json`` saved beside a transformers tokenizer, if any."""
    try:
        eos = json.loads((file.parent / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


# ------------------------------------------------------------------------------------ the token cache
def default_cache_dir() -> Path:
    """``$MISTJAX_CACHE_DIR/tokens``, else ``$XDG_CACHE_HOME/mistjax/tokens`` (``~/.cache/mistjax/tokens``)."""
    env = os.environ.get("MISTJAX_CACHE_DIR", "")
    if env.strip() and env.strip().lower() not in ("off", "0", "none"):
        return Path(env) / "tokens"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mistjax" / "tokens"


@dataclass(frozen=True)
class CacheKey:
    """Everything the token stream depends on, and the cache files it names."""

    digest: str  # hash of the fields below
    name: str  # file stem: a readable prefix and the digest
    inputs: dict[str, Any]  # files (path, size, mtime), tokenizer hash, separator, text field, dtype


def cache_key(corpus: Corpus, tokenizer_file: Path, eos: int, text_field: str, dtype: str) -> CacheKey:
    """The cache key of a corpus tokenized with a tokenizer (file stats only: no file is read but the tokenizer)."""
    files = [{"path": str(p.resolve()), "size": (s := p.stat()).st_size, "mtime_ns": s.st_mtime_ns}
             for p in corpus.stat_files()]
    inputs = {"format": CACHE_FORMAT, "files": files, "tokenizer_sha256": _sha256(tokenizer_file), "eos_id": eos,
              "text_field": text_field, "dtype": dtype}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(corpus.spec.rstrip("/*")).name)[:40]
    return CacheKey(digest, f"{stem or 'corpus'}-{digest}", inputs)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cached_manifest(directory: Path, key: CacheKey) -> dict[str, Any] | None:
    """The manifest of a complete cache entry for `key`, or None (absent, another format, or a torn token file)."""
    try:
        manifest = json.loads((directory / f"{key.name}.json").read_text())
        itemsize = np.dtype(manifest["dtype"]).itemsize
        complete = (directory / f"{key.name}.bin").stat().st_size == manifest["num_tokens"] * itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if complete and manifest.get("key") == key.digest else None


def build_cache(corpus: Corpus, tokenizer: Tokenizer, key: CacheKey, directory: Path,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Tokenize the corpus into ``directory/<key>.bin`` and write its manifest ``<key>.json``; returns the
    manifest. Both files are written under temporary names and renamed, the manifest last: an interrupted
    pass leaves no entry, and processes building the same entry at once (a shared file system) do not clash.

    Raises:
      DataError: the directory cannot be written, or a file cannot be read.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the token cache {str(directory)!r} ({e}); pass a writable --data-cache") \
            from None
    files = corpus.stat_files()
    total = sum(p.stat().st_size for p in files)
    log(f"tokenizing {corpus.spec!r} ({len(files)} file(s), {total / 1e6:,.1f} MB) into the cache "
        f"{str(directory)!r} (once)")
    t0 = time.perf_counter()
    tmp = directory / f".{key.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as out:
            stats = _tokenize_into(out, corpus, tokenizer, key.inputs, total)
        manifest = {"key": key.digest, "data": corpus.spec, **key.inputs, **stats,
                    "seconds": round(time.perf_counter() - t0, 3)}
        os.replace(tmp, directory / f"{key.name}.bin")
        _write_atomic(directory / f"{key.name}.json", json.dumps(manifest, indent=1))
    except OSError as e:
        raise DataError(f"cannot write the token cache in {str(directory)!r} ({e}); pass a writable --data-cache") \
            from None
    finally:
        tmp.unlink(missing_ok=True)
    log(f"tokenized {stats['num_documents']:,} documents into {stats['num_tokens']:,} tokens in "
        f"{manifest['seconds']:.1f} s")
    return manifest


def _tokenize_into(out: BinaryIO, corpus: Corpus, tokenizer: Tokenizer, inputs: dict[str, Any], total: int
                   ) -> dict[str, Any]:
    """Tokenize every piece of the corpus into `out`; returns the counts and the token stream's sha256."""
    from tqdm.auto import tqdm

    writer = _TokenWriter(out, tokenizer, inputs["eos_id"], np.dtype(inputs["dtype"]))
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None, leave=False) as bar:
        for text, nbytes, ends in iter_pieces(corpus, inputs["text_field"]):
            writer.add(text, ends)
            bar.update(nbytes)
        writer.flush()
    return {"num_tokens": writer.num_tokens, "num_documents": writer.num_documents,
            "tokens_sha256": writer.hash.hexdigest()}


class _TokenWriter:
    """Encodes pieces in batches (the tokenizer's parallel batch encoding) and appends their ids to a file, with
    the separator after each document that has tokens, hashing what it writes."""

    def __init__(self, out: BinaryIO, tokenizer: Tokenizer, eos: int, dtype: np.dtype) -> None:
        self.out, self.eos, self.dtype = out, eos, dtype
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which nothing here needs.
        self.encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.pending: list[tuple[str, bool]] = []
        self.chars = self.num_tokens = self.num_documents = 0
        self.open_doc = False  # the current document has tokens: its separator is still due
        self.hash = hashlib.sha256()

    def add(self, text: str, ends: bool) -> None:
        self.pending.append((text, ends))
        self.chars += len(text)
        if self.chars >= ENCODE_CHARS or len(self.pending) >= ENCODE_PIECES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        # No special tokens: a BOS/CLS that a post-processor would add is not a document separator.
        encodings = self.encode([text for text, _ in self.pending], add_special_tokens=False)
        ids: list[int] = []
        for encoding, (_, ends) in zip(encodings, self.pending):
            ids.extend(encoding.ids)
            self.open_doc = self.open_doc or bool(encoding.ids)
            if ends and self.open_doc:
                ids.append(self.eos)
                self.num_documents += 1
                self.open_doc = False
        chunk = np.asarray(ids, dtype=self.dtype).tobytes()
        self.out.write(chunk)
        self.hash.update(chunk)
        self.num_tokens += len(ids)
        self.pending, self.chars = [], 0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ the shuffle
def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A bijection of ``[0, n)`` keyed by `key`, evaluated at `index` (int64) without materialising it.

    A balanced Feistel network permutes ``[0, 4**half)`` (the smallest such range covering ``n``); values
    landing outside ``[0, n)`` are permuted again (cycle walking), which keeps it a bijection of ``[0, n)``.
    Under 4 rounds per value on average; numpy uint64 arithmetic only, so it is the same on every platform.
    """
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(key).integers(0, 1 << 63, FEISTEL_ROUNDS, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        x[todo] = _feistel(x[todo], keys, np.uint64(half), mask)
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def _feistel(x: np.ndarray, keys: np.ndarray, half: np.uint64, mask: np.uint64) -> np.ndarray:
    left, right = x >> half, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << half) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing hash of 64-bit words (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# ------------------------------------------------------------------------------------ the source
class TextTokens:
    """Batches of packed, shuffled sequences from a tokenized text corpus (see the module docstring).

    Attributes:
      manifest: the cache entry's manifest (files, tokenizer hash, separator, token count, token hash).
      cache_hit: False when this construction tokenized the corpus, True when it reused the cache.
      num_sequences: sequences of ``seq_len + 1`` tokens per epoch.
    """

    def __init__(self, data: str, *, tokenizer: str | None, seq_len: int, batch_size: int,
                 vocab_size: int | None = None, seed: int = 0, text_field: str = "text", eos_id: int | None = None,
                 cache_dir: str | Path | None = None, log: Callable[[str], None] = print) -> None:
        corpus = find_corpus(data)
        tok, tok_file = load_tokenizer(tokenizer, data)
        size = tok.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and size > vocab_size:
            raise DataError(f"--tokenizer {tokenizer!r} has {size:,} tokens, more than the model's vocab_size "
                            f"{vocab_size:,}; use the model's tokenizer, or a --model whose vocabulary holds it")
        eos = separator_id(tok, tok_file, eos_id)
        dtype = "uint16" if size <= 1 << 16 else "uint32"
        key = cache_key(corpus, tok_file, eos, text_field, dtype)
        directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        manifest = cached_manifest(directory, key)
        self.cache_hit = manifest is not None
        if manifest is None:
            manifest = build_cache(corpus, tok, key, directory, log)
        self.manifest, self.seq_len, self.batch_size, self.seed = manifest, seq_len, batch_size, seed
        self.path = directory / f"{key.name}.bin"
        self.num_sequences = self._check_size(data, manifest["num_tokens"])
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")

    def _check_size(self, data: str, num_tokens: int) -> int:
        if num_tokens == 0:
            raise DataError(f"--data {data!r} holds no text (no tokens in any document of field "
                            f"{self.manifest['text_field']!r}); check --data and --text-field")
        sequences = (num_tokens - 1) // self.seq_len
        if sequences < self.batch_size:
            raise DataError(f"--data {data!r} tokenizes to {num_tokens:,} tokens: {sequences} sequence(s) of "
                            f"--seq-len {self.seq_len}, fewer than one batch (--global-batch {self.batch_size}); "
                            "add text, or lower --global-batch or --seq-len")
        return sequences

    @property
    def fingerprint(self) -> str:
        """The token stream's hash: what a checkpoint records, so a resume can tell that the data changed."""
        return self.manifest["tokens_sha256"]

    def __len__(self) -> int:
        return len(self.tokens)

    def sequence_ids(self, step: int) -> np.ndarray:
        """The packed sequences (indices in ``[0, num_sequences)``) of the batch of `step`."""
        g = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        epoch, offset = np.divmod(g, self.num_sequences)
        out = np.empty_like(g)
        for e in np.unique(epoch):  # a batch spans at most two epochs
            at = epoch == e
            out[at] = permute(offset[at], self.num_sequences, _epoch_key(self.seed, int(e)))
        return out

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch for `step`: ``inputs`` and ``targets`` int32 ``[batch, seq_len]``."""
        starts = self.sequence_ids(step) * self.seq_len
        seqs = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1]) for s in starts]).astype(np.int32)
        return {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}


def _epoch_key(seed: int, epoch: int) -> int:
    """One permutation key per (seed, epoch); negative seeds are fine."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little")
