"""Text corpora for scripts/pretrain.py: .txt / .jsonl / .parquet tokenized with a local tokenizer.json, cached,
packed, shuffled by seed; clear errors; exact resume after kill -9 (`cli`: tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mistjax.train import text_data
from mistjax.train.data import DataError
from mistjax.train.text_data import TextTokens, permute

tokenizers = pytest.importorskip("tokenizers", reason="text data needs tokenizers (pip install -e '.[dev]')")
Tokenizer, models, pre_tokenizers = tokenizers.Tokenizer, tokenizers.models, tokenizers.pre_tokenizers
PRETRAIN = Path(__file__).resolve().parents[1] / "scripts" / "pretrain.py"
HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
WORDS = ("the", "a", "model", "trains", "on", "text", "and", "tokens", "flow", "through", "layers", "while",
         "gradients", "descend", "slowly", "toward", "small", "losses", "every", "step", "shuffles", "packed",
         "sequences", "of", "words", "from", "many", "documents")
EOS = "<|endoftext|>"
SEQ, BATCH = 16, 8


# ------------------------------------------------------------------------------ helpers
def write_tokenizer(path: Path, words: tuple[str, ...] | list[str] = WORDS, eos: str | None = EOS) -> Path:
    """A word-level tokenizer.json: [UNK] 0, then the end-of-text token (if any), then the words."""
    specials = ["[UNK]"] + ([eos] if eos else [])
    vocab = {w: i for i, w in enumerate(dict.fromkeys(specials + list(words)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def sentence(rng: np.random.Generator, lo: int = 4, hi: int = 20) -> str:
    return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))


def write_corpus(root: Path, seed: int = 0) -> dict[Path, list[str]]:
    """A folder of .txt, .jsonl (and .parquet with pyarrow) files, and files the reader must skip; returns each
    text file's documents."""
    rng = np.random.default_rng(seed)
    docs: dict[Path, list[str]] = {}
    (root / "sub").mkdir(parents=True)
    for name in ("a.txt", "sub/d.txt"):
        docs[root / name] = ["\n".join(sentence(rng) for _ in range(4)) + "\n"]
        (root / name).write_text(docs[root / name][0])
    records = [{"text": sentence(rng), "id": i} for i in range(10)] + [{"text": "", "id": 10}, {"text": None}]
    (root / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    docs[root / "b.jsonl"] = [r["text"] or "" for r in records]
    if HAS_PYARROW:
        import pyarrow as pa
        import pyarrow.parquet as pq

        texts = [sentence(rng) for _ in range(6)]
        pq.write_table(pa.table({"text": texts, "n": list(range(6))}), root / "c.parquet", row_group_size=4)
        docs[root / "c.parquet"] = texts
    (root / "README.md").write_text("not training data")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "skip.txt").write_text("the the the")
    return dict(sorted(docs.items()))


def expected_stream(tok_file: Path, docs: dict[Path, list[str]]) -> list[int]:
    """The token stream by hand: each non-empty document's ids, then the end-of-text id, files in path order."""
    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.token_to_id(EOS)
    out: list[int] = []
    for texts in docs.values():
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            out += ids + [eos] if ids else []
    return out


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path, dict[Path, list[str]]]:
    """(corpus folder, tokenizer.json, documents per file)."""
    return tmp_path / "corpus", write_tokenizer(tmp_path / "tok" / "tokenizer.json"), \
        write_corpus(tmp_path / "corpus")


def source(data: Path | str, tok: Path | str | None, cache: Path, **kw) -> TextTokens:
    kw = {"seq_len": SEQ, "batch_size": BATCH, "vocab_size": 256, "log": lambda _: None, **kw}
    return TextTokens(str(data), tokenizer=None if tok is None else str(tok), cache_dir=cache, **kw)


# ------------------------------------------------------------------------------ reading, packing, shuffling
def test_batches_are_packed_windows_of_the_tokenized_corpus(corpus, tmp_path: Path) -> None:
    folder, tok, docs = corpus
    src = source(folder, tok, tmp_path / "cache")
    stream = np.asarray(expected_stream(tok, docs))
    assert np.array_equal(np.asarray(src.tokens), stream), "files in path order, one EOS per non-empty document"
    assert src.num_sequences == (len(stream) - 1) // SEQ
    assert src.manifest["num_documents"] == sum(bool(t.strip()) for texts in docs.values() for t in texts)
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    for step in (0, 3, 50):
        batch = src.batch(step)
        assert set(batch) == {"inputs", "targets"}
        assert batch["inputs"].shape == batch["targets"].shape == (BATCH, SEQ)
        assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
        assert batch["inputs"].min() >= 0 and batch["targets"].max() < vocab
        assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        for row, seq in zip(batch["inputs"], src.sequence_ids(step)):  # window `seq` at stride seq_len
            assert np.array_equal(row, stream[seq * SEQ: seq * SEQ + SEQ])


def test_single_file_glob_and_txt_pieces(corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A single file and a glob read like a folder; a large .txt is tokenized in pieces cut at line starts, with
    the same tokens and one EOS."""
    folder, tok, docs = corpus
    monkeypatch.setattr(text_data, "TXT_PIECE_BYTES", 40)
    big = folder / "a.txt"
    src = source(big, tok, tmp_path / "cache", batch_size=1)
    assert np.array_equal(np.asarray(src.tokens), expected_stream(tok, {big: docs[big]}))
    src = source(f"{folder}/**/*.txt", tok, tmp_path / "cache", batch_size=1)
    want = expected_stream(tok, {p: d for p, d in docs.items() if p.suffix == ".txt"})
    assert np.array_equal(np.asarray(src.tokens), want)


def test_batches_are_deterministic_and_depend_on_the_seed(corpus, tmp_path: Path) -> None:
    folder, tok, _ = corpus
    a, b = source(folder, tok, tmp_path / "c1"), source(folder, tok, tmp_path / "c2")  # two fresh caches
    other = source(folder, tok, tmp_path / "c1", seed=1)
    for step in range(6):
        assert all(np.array_equal(a.batch(step)[k], b.batch(step)[k]) for k in ("inputs", "targets"))
    assert any(not np.array_equal(a.batch(s)["inputs"], other.batch(s)["inputs"]) for s in range(3))


def test_every_sequence_once_per_epoch_and_epochs_differ(corpus, tmp_path: Path) -> None:
    folder, tok, _ = corpus
    src = source(folder, tok, tmp_path / "cache", batch_size=3)
    m = src.num_sequences
    order = np.concatenate([src.sequence_ids(s) for s in range(2 * m // 3 + 2)])
    first, second = order[:m], order[m: 2 * m]
    assert sorted(first) == sorted(second) == list(range(m))  # wrap-around: a batch may straddle two epochs
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4097])
def test_permute_is_a_bijection(n: int) -> None:
    for key in (0, 12345):
        assert sorted(permute(np.arange(n), n, key).tolist()) == list(range(n))
    assert permute(np.arange(5), 10**12, 3).max() < 10**12  # no table: any corpus size


# ------------------------------------------------------------------------------ the cache
def test_cache_is_reused_and_invalidated(corpus, tmp_path: Path) -> None:
    folder, tok, _ = corpus
    cache = tmp_path / "cache"
    first = source(folder, tok, cache)
    assert not first.cache_hit and first.path.is_file() and first.path.with_suffix(".json").is_file()
    built = first.path.stat().st_mtime_ns
    again = source(folder, tok, cache)
    assert again.cache_hit and again.path == first.path and again.path.stat().st_mtime_ns == built
    assert again.fingerprint == first.fingerprint
    with open(folder / "a.txt", "a") as f:  # an edited file: another key, a new pass
        f.write("more words\n")
    edited = source(folder, tok, cache)
    assert not edited.cache_hit and edited.path != first.path and len(edited) > len(first)
    assert edited.fingerprint != first.fingerprint
    assert source(folder, tok, cache).cache_hit
    assert not source(folder, tok, cache, eos_id=0).cache_hit  # another separator
    tok2 = write_tokenizer(tmp_path / "tok2" / "tokenizer.json", words=list(reversed(WORDS)))
    assert not source(folder, tok2, cache).cache_hit  # another tokenizer
    assert not list(cache.glob(".*.tmp")), "no temporary files left behind"


def test_eos_from_tokenizer_config_and_flag(corpus, tmp_path: Path) -> None:
    folder, _, _ = corpus
    tok = write_tokenizer(tmp_path / "t" / "tokenizer.json", words=list(WORDS) + ["<end>"], eos=None)
    (tok.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    end = Tokenizer.from_file(str(tok)).token_to_id("<end>")
    src = source(folder, tok.parent, tmp_path / "cache")  # a folder holding tokenizer.json works too
    assert src.manifest["eos_id"] == end and np.asarray(src.tokens)[-1] == end
    assert source(folder, tok, tmp_path / "cache", eos_id=3).manifest["eos_id"] == 3


# ------------------------------------------------------------------------------ clear errors
def test_mistakes_are_clear_errors(corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, tok, _ = corpus
    cache = tmp_path / "cache"

    def refused(match: str, data: Path | str = folder, tokenizer: Path | str | None = tok, **kw) -> None:
        with pytest.raises(DataError, match=match):
            source(data, tokenizer, cache, **kw)

    refused(r"is text, which needs a tokenizer: pass --tokenizer", tokenizer=None)
    refused(r"--tokenizer .*: no such file", tokenizer=tmp_path / "nope.json")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    refused(r"--tokenizer .* cannot be loaded .*tokenizer.json written by Hugging Face", tokenizer=bad)
    refused(r"has \d+ tokens, more than the model's vocab_size 10; use the model's tokenizer", vocab_size=10)
    no_eos = write_tokenizer(tmp_path / "noeos" / "tokenizer.json", eos=None)
    refused(r"has no end-of-text token .*pass --eos-id ID", tokenizer=no_eos)
    refused(r"--eos-id 999 is outside the tokenizer's", eos_id=999)
    refused(r"fewer than one batch \(--global-batch 1000\); add text, or lower --global-batch", batch_size=1000)
    (tmp_path / "data.csv").write_text("a,b\n")
    refused(r"unknown file type '.csv'.*\.txt, \.jsonl, \.parquet", data=tmp_path / "data.csv")
    refused(r"no such file or folder", data=tmp_path / "missing")
    refused(r"matches no files", data=f"{tmp_path}/*.nothing")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("x")
    refused(r"no \.txt, \.jsonl, \.parquet files in folder .*found: \.md", data=tmp_path / "docs")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "e.txt").write_text("")
    (empty / "e.jsonl").write_text('{"text": ""}\n')
    refused(r"holds no text .*check --data and --text-field", data=empty)
    refused(r"b.jsonl:1 has no field 'body' \(it has: 'text', 'id'\); pass --text-field NAME", text_field="body")
    (tmp_path / "blocker").write_text("")
    with pytest.raises(DataError, match="pass a writable --data-cache"):
        source(folder, tok, tmp_path / "blocker" / "cache")


@pytest.mark.parametrize("kw,match", [(dict(eos_id=-1), "--eos-id -1: must be a token id"),
                                      (dict(text_field=""), "--text-field '': name the field")])
def test_train_config_checks_the_text_flags(kw: dict, match: str) -> None:
    from mistjax.train.loop import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_parquet_and_datasets_errors(corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, tok, _ = corpus
    table = tmp_path / "t.parquet"
    table.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(DataError, match=r"needs pyarrow, which is not installed: pip install pyarrow"):
        source(table, tok, tmp_path / "cache")
    monkeypatch.undo()
    if HAS_PYARROW:
        with pytest.raises(DataError, match=r"has no column 'body' \(it has: 'text', 'n'\); pass --text-field"):
            source(folder / "c.parquet", tok, tmp_path / "cache", text_field="body")
        with pytest.raises(DataError, match=r"t.parquet' is not a readable parquet file"):
            source(table, tok, tmp_path / "cache")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "dataset_info.json").write_text("{}")
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(DataError, match=r"datasets folder \(save_to_disk\).*pip install datasets"):
            source(saved, tok, tmp_path / "cache")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets is not installed")
def test_saved_datasets_folder(corpus, tmp_path: Path) -> None:
    import datasets

    _, tok, docs = corpus
    texts = [t for texts in docs.values() for t in texts if t]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(tmp_path / "ds")
    src = source(tmp_path / "ds", tok, tmp_path / "cache")
    assert np.array_equal(np.asarray(src.tokens), expected_stream(tok, {tmp_path: texts}))


def test_script_reports_data_mistakes_in_one_line(cli, corpus, tmp_path: Path) -> None:
    folder, tok, _ = corpus
    small = ["--model", "gpt3-tiny", "--global-batch", "8", "--seq-len", "16", "--steps", "1", "--no-progress",
             "--data-cache", tmp_path / "cache"]
    code, _, err = cli(*small, "--data", folder)
    assert code == 1 and "error: --data" in err and "pass --tokenizer" in err and "Traceback" not in err
    big = write_tokenizer(tmp_path / "big" / "tokenizer.json", words=[f"w{i}" for i in range(300)])
    code, _, err = cli(*small, "--data", folder, "--tokenizer", big)
    assert code == 1 and "more than the model's vocab_size 256" in err and "Traceback" not in err
    # The folder is read recursively: a metrics log written into it would become training text.
    code, _, err = cli(*small, "--data", folder, "--tokenizer", tok, "--metrics", folder / "run" / "m.jsonl")
    assert code == 1 and "--metrics" in err and "inside the --data folder" in err and "Traceback" not in err
    assert not (folder / "run").exists()


def test_resume_warns_when_the_tokenized_data_changed(corpus, tmp_path: Path) -> None:
    import jax

    from mistjax.core.plan import uniform_plan
    from mistjax.train.loop import TrainConfig, _check_compatible

    folder, tok, _ = corpus
    cfg = TrainConfig(data=str(folder), tokenizer=str(tok))
    plan = uniform_plan(4, 8, micro_batch=1, shard_opt=True)
    meta = {"model": cfg.model, "plan": plan.to_dict(), "step": 2, "process_count": jax.process_count(),
            "device_count": jax.device_count(), "config": {}, "data_position": {"tokens_sha256": "0" * 64}}
    with pytest.warns(RuntimeWarning, match=r"tokenized --data .* differs from the checkpoint's"):
        _check_compatible(meta, cfg, plan, tmp_path, source(folder, tok, tmp_path / "cache"))


# ------------------------------------------------------------------------------ end to end
def test_pretrain_on_text_resumes_exactly_after_sigkill(corpus, tmp_path: Path, killed_and_resumed) -> None:
    folder, tok, _ = corpus
    steps = 12  # the corpus holds about 20 sequences: the run wraps around several epochs
    run = killed_and_resumed([sys.executable, str(PRETRAIN), "--model", "gpt3-tiny", "--steps", str(steps),
                              "--global-batch", "8", "--seq-len", "16", "--warmup", "3", "--ckpt-every", "2",
                              "--keep", "2", "--no-progress", "--data", str(folder), "--tokenizer", str(tok),
                              "--data-cache", str(tmp_path / "tokens")])
    assert "tokenizing" not in run.killed_output, "the second run reuses the token cache"
    assert 5 <= run.killed_at < steps
    assert "resumed from step" in run.resumed.stdout and "warning" not in run.resumed.stderr
    assert [r["step"] for r in run.got] == list(range(1, steps + 1))
    assert [r["loss"] for r in run.got] == [r["loss"] for r in run.want], "resume on text data is not bit-identical"
    meta = json.loads(next(run.ckpt.glob(f"{steps}/meta/metadata")).read_text())
    assert meta["data_position"]["tokens_sha256"] and meta["data_position"]["source"] == str(folder)
