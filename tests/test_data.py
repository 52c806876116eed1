import hashlib
import json

import pytest
import torch

from forgetless.data.corpora import (TINY_SHA256, Corpus, Document, load_corpus, rename_characters,
                                     tinyshakespeare_path)
from forgetless.data.domains import load_domains
from forgetless.data.splits import Sampler, disjoint, eval_windows, split_all, split_corpus
from forgetless.data.tokenizers import ByteTokenizer, CharTokenizer
from forgetless.errors import ForgetlessError


def test_byte_tokenizer_roundtrip_any_bytes():
    tok = ByteTokenizer()
    data = "héllo wörld".encode() + b"\xff\x00"
    ids = tok.encode(data)
    assert ids.dtype == torch.long and ids.tolist() == list(data)


def test_char_tokenizer_unseen_and_non_utf8():
    tok = CharTokenizer.from_texts([("a", b"hello")])
    assert tok.decode(tok.encode(b"hell")) == "hell"
    with pytest.raises(ForgetlessError, match=r"not in the char vocabulary \('z'\)"):
        tok.encode(b"hez", "corpus 'x'")
    with pytest.raises(ForgetlessError, match="not valid UTF-8 .*--tokenizer bytes"):
        tok.encode(b"he\xffl", "corpus 'x'")


def test_shakespeare_corpora_and_disjoint_plays():
    modern, folio = load_corpus("shakespeare-modern"), load_corpus("shakespeare-folio")
    assert len(modern.docs) == 37 and len(folio.docs) == 35
    assert {d.key for d in folio.docs} <= {d.key for d in modern.docs}  # titles aligned by alias table
    a, b = disjoint(modern, folio)
    assert not {d.key for d in a.docs} & {d.key for d in b.docs}
    assert len(a.docs) + len(b.docs) == 37
    poems = load_corpus("shakespeare-poems")
    assert "sonnets" in {d.key for d in poems.docs}


def test_split_by_play_is_deterministic():
    corpus = load_corpus("shakespeare-folio")
    s1, s2 = split_corpus(corpus), split_corpus(corpus)
    assert s1.val_keys == s2.val_keys and len(s1.val_keys) == round(35 * 0.1)
    assert s1.train == s2.train
    for key in s1.val_keys:  # a held-out play does not appear in train
        doc = next(d for d in corpus.docs if d.key == key)
        assert doc.data[:2000] not in s1.train


def test_tail_split_for_single_document(text_file):
    split = split_corpus(load_corpus(str(text_file)), 0.25, dev_fraction=0.15)
    data = text_file.read_bytes()
    assert split.train + split.dev + split.val == data and len(split.val) == len(data) - int(len(data) * 0.75)
    assert len(split.dev) == int(len(data) * 0.75) - int(len(data) * 0.6)


def test_validation_works_come_from_training_works():
    """Whole works for validation, taken from the training works: disjoint from train and held-out; the
    held-out works are those a split without validation holds out (reported numbers keep their windows)."""
    corpus = load_corpus("shakespeare-folio")
    split = split_corpus(corpus, 0.1, dev_fraction=0.1)
    assert len(split.dev_keys) == round(35 * 0.1) and split.dev
    assert not set(split.dev_keys) & set(split.train_keys) and not set(split.dev_keys) & set(split.val_keys)
    assert set(split.dev_keys) | set(split.train_keys) | set(split.val_keys) == {d.key for d in corpus.docs}
    assert split.val_keys == split_corpus(corpus, 0.1, dev_fraction=0.3).val_keys
    with pytest.raises(ForgetlessError, match="dev_fraction must be in"):
        split_corpus(corpus, 0.5, dev_fraction=0.5)


def test_tinyshakespeare_from_env():
    data = tinyshakespeare_path().read_bytes()
    assert len(data) == 1_115_394 and hashlib.sha256(data).hexdigest() == TINY_SHA256


def test_tinyshakespeare_download_is_verified(tmp_path, monkeypatch):
    source = tinyshakespeare_path()
    monkeypatch.delenv("FORGETLESS_TINYSHAKESPEARE")
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.txt"
    bad.write_text("not shakespeare")
    with pytest.raises(ForgetlessError, match="does not match Tiny Shakespeare's SHA-256"):
        tinyshakespeare_path(bad.as_uri())
    assert not (tmp_path / "cache" / "data" / "tinyshakespeare.txt").exists()
    path = tinyshakespeare_path(source.as_uri())
    assert path == tmp_path / "cache" / "data" / "tinyshakespeare.txt" and path.stat().st_size == 1_115_394
    assert tinyshakespeare_path("file:///nonexistent") == path  # now served from the cache


def test_renamed_characters_changes_names_only():
    tiny = load_corpus("tinyshakespeare")
    renamed = load_corpus("renamed:tinyshakespeare")
    old, new = tiny.docs[0].data.decode(), renamed.docs[0].data.decode()
    assert "MENENIUS" in old and "MENENIUS" not in new and "Menenius" not in new
    assert old.count("\n") == new.count("\n")
    assert "First Citizen:" in new  # role words stay
    assert rename_characters(tiny).docs[0].data == renamed.docs[0].data  # seeded, deterministic


def test_file_glob_corpus(tmp_path):
    for i in range(5):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    corpus = load_corpus(str(tmp_path / "*.txt"))
    assert [d.key for d in corpus.docs] == [f"doc{i}" for i in range(5)]
    assert split_corpus(corpus, 0.2).val_keys == ["doc2"]


def test_unknown_and_empty_corpus(tmp_path):
    with pytest.raises(ForgetlessError, match="unknown corpus 'nope'.*shakespeare-modern"):
        load_corpus("nope")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ForgetlessError, match="is empty"):
        load_corpus(str(empty))


def test_too_short_corpus(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 300)
    with pytest.raises(ForgetlessError, match="val split has 30 tokens, fewer than context \\+ 1 = 65"):
        load_domains([str(short)], "bytes", 64, 0.1, 8)


def test_hf_datasets_corpus_from_local_json(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"body": f"row number {i} " * 5}) for i in range(100)))
    corpus = load_corpus(f"hf:json?data_files={rows}&column=body")
    assert len(corpus.docs) == 20 and b"row number 99" in corpus.docs[-1].data
    with pytest.raises(ForgetlessError, match="has no column 'text'; columns: body"):
        load_corpus(f"hf:json?data_files={rows}")
    with pytest.raises(ForgetlessError, match="options are split, column"):
        load_corpus("hf:json?colum=text")


def test_sampler_mixing_and_state():
    main, other = torch.zeros(1000, dtype=torch.long), torch.ones(1000, dtype=torch.long)
    s = Sampler(main, 10, 8, seed=0, other=other, p=0.3)
    batch = s.next()
    assert batch.x.shape == (10, 8) and batch.from_other.sum() == 3
    assert (batch.x[batch.from_other] == 1).all() and (batch.x[~batch.from_other] == 0).all()
    tokens = torch.arange(1000)
    s1 = Sampler(tokens, 4, 8, seed=1)
    s1.next()
    state = s1.get_state()
    expected = s1.next().x
    s2 = Sampler(tokens, 4, 8, seed=99)
    s2.set_state(state)
    assert torch.equal(s2.next().x, expected)
    with pytest.raises(ForgetlessError, match="needs another corpus"):
        Sampler(tokens, 4, 8, seed=0, p=0.1)


def test_eval_windows_fixed_and_non_overlapping():
    tokens = torch.arange(1000)
    w = eval_windows(tokens, 16, 10)
    assert w.shape == (10, 17) and torch.equal(w, eval_windows(tokens, 16, 10))
    starts = w[:, 0].tolist()
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:]))


def test_char_mode_domains_share_one_vocabulary(tmp_path, text_file):
    other = tmp_path / "other.txt"
    other.write_text("zebra quiz " * 2000)
    (a, b), tok = load_domains([str(text_file), str(other)], "chars", 32, 0.1, 4)
    assert tok.kind == "chars" and "z" in tok.chars and "R" in tok.chars
    assert a.train.max() < tok.vocab_size and b.train.max() < tok.vocab_size


def test_corpus_fingerprint_changes_with_content():
    a = Corpus("x", [Document("k", b"abc")])
    b = Corpus("x", [Document("k", b"abd")])
    assert a.fingerprint() != b.fingerprint()


def test_single_work_shift_is_not_partitioned():
    tiny = load_corpus("tinyshakespeare")
    a, b = disjoint(tiny, load_corpus("renamed:tinyshakespeare"))
    assert a.nbytes == tiny.nbytes and len(b.docs) == 1 and b.nbytes > 1_000_000
    assert ByteTokenizer().encode(b"").numel() == 0


@pytest.mark.parametrize("specs", [
    ["shakespeare-modern", "shakespeare-folio", "shakespeare-poems", "renamed:shakespeare-modern", "python-stdlib"],
    ["shakespeare-folio", "renamed:shakespeare-folio", "shakespeare-modern", "renamed:shakespeare-modern"],
])
def test_no_corpus_trains_on_another_corpus_held_out_works(specs):
    """The default sequence (and any list of corpora sharing works, e.g. renamed copies): every corpus's
    training works are disjoint from every corpus's held-out works."""
    corpora = [load_corpus(s) for s in specs]
    corpora[0], corpora[1] = disjoint(corpora[0], corpora[1])
    splits = split_all(corpora)
    held = {key for s in splits for key in s.val_keys}
    for spec, split in zip(specs, splits):
        assert split.train_keys and not set(split.train_keys) & held, spec
    dev = {key for s in splits for key in s.dev_keys}  # validation works are nobody's training works either
    assert dev and not dev & held and all(not set(s.train_keys) & dev for s in splits)
    by_spec = dict(zip(specs, splits))  # a renamed copy holds out the works its original holds out
    assert set(by_spec["shakespeare-modern"].val_keys) <= set(by_spec["renamed:shakespeare-modern"].val_keys)
