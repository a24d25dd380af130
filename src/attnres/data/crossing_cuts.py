"""Which of :func:`~attnres.data.tokenizer.text_chunks`' cuts a tokenizer reads apart.

The token caches encode a text in pieces of about 1 MB, cut just after a line break or just
before a space with text on either side (:data:`CUTS`). Their ids are the whole text's where no
token crosses the cut: where the pre-tokenizer splits there (GPT-2's, Llama 3's and Qwen's do at
both, a ``Metaspace`` one before a space), or where the vocabulary holds no piece across it (a
SentencePiece-style ``tokenizer.json`` without a pre-tokenizer, as Llama 2's, trained split at
whitespace: its pieces hold no line break, and a "▁" only at their start). A ``tokenizer.json``
whose pre-tokenizer does not split at a line break (a ``Metaspace`` one, or none) trained on
text with line breaks holds pieces such as ``"text\\nnext"``: cut after that line break, its
ids were not the whole text's. Its added tokens, found in the whole text before it is
pre-tokenized, are not cut inside either (:class:`AddedTokenMatches`).
"""

from __future__ import annotations

#: The kinds of cut of :func:`~attnres.data.tokenizer.text_chunks`: just after a line break,
#: just before a space (each with a character other than whitespace on either side).
CUTS = ("line", "space")

#: For each kind of cut, texts cut there (the two sides): the pre-tokenizer must split every one
#: there (after a letter or punctuation, before one) for the cut to be read apart.
CUT_PROBES = {"line": (("x\n", "y"), ("x.\n", "(y")), "space": (("x", " y"), ("x.", " (y"))}

#: The whitespace characters whose forms (as a vocabulary spells them: "Ċ" for a line break in
#: a byte-level BPE's, "▁" for a space in a SentencePiece-style one) a piece may hold on the
#: whitespace side of a cut without crossing it.
_WHITESPACE = " \n\t\r"


def clean_cuts(backend) -> tuple[str, ...]:
    """The kinds of :data:`CUTS` that the ``tokenizers.Tokenizer`` ``backend`` reads apart: the
    ids of a text cut there are those of the whole text. A kind is read apart where the
    normalizer and pre-tokenizer split each of its :data:`CUT_PROBES` there, or else where no
    piece of the vocabulary holds the cut's whitespace (as the vocabulary spells it) next to a
    character on the cut's other side."""
    unsplit = [kind for kind in CUTS if not all(_splits_at(backend, a, b) for a, b in CUT_PROBES[kind])]
    if not unsplit:
        return CUTS
    forms = {c: _form(backend, c) for c in _WHITESPACE}
    spaces = set("".join(f for f in forms.values() if f is not None))
    vocabulary = backend.get_vocab(with_added_tokens=False)
    crossed = [kind for kind in unsplit
               if not (form := forms["\n" if kind == "line" else " "])
               or any(_crosses(piece, form, kind, spaces) for piece in vocabulary)]
    return tuple(kind for kind in CUTS if kind not in crossed)


def _splits_at(backend, before: str, after: str) -> bool:
    """Whether ``backend``'s normalizer and pre-tokenizer split ``before + after`` between the
    two: no pre-token holds characters of both (one that drops whitespace, ``Whitespace``, has
    none that starts at a cut before a space, and none across it)."""
    from tokenizers import PreTokenizedString

    text = PreTokenizedString(before + after)
    if backend.normalizer is not None:
        text.normalize(backend.normalizer.normalize)
    if backend.pre_tokenizer is None:
        return False
    backend.pre_tokenizer.pre_tokenize(text)
    cut = len(before)
    return not any(start < cut < end for _, (start, end), _ in text.get_splits(offset_referential="original"))


def _form(backend, whitespace: str) -> str | None:
    """``whitespace`` as ``backend``'s vocabulary spells it between two letters (``None``
    where the letters are not found as themselves: a normalizer that changes them)."""
    text = "x" + whitespace + "y"
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    if backend.pre_tokenizer is not None:
        text = "".join(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text))
    x, y = text.find("x"), text.rfind("y")
    return text[x + 1:y] if 0 <= x < y else None


def _crosses(piece: str, form: str, kind: str, spaces: set[str]) -> bool:
    """Whether ``piece`` holds a cut of ``kind`` whose whitespace is spelled ``form``: the
    line break followed by a character other than whitespace, or a space after one."""
    at = piece.find(form)
    while at >= 0:
        beside = at + len(form) if kind == "line" else at - 1
        if 0 <= beside < len(piece) and piece[beside] not in spaces:
            return True
        at = piece.find(form, at + 1)
    return False


class AddedTokenMatches:
    """Where the added tokens of a ``tokenizers.Tokenizer`` (``tokenizer.add_tokens``, its
    special tokens) may match a text, for :func:`~attnres.data.tokenizer.text_chunks` not to cut
    inside one. ``tokenizers`` finds them in the whole text before it pre-tokenizes: their
    content, and with ``lstrip`` / ``rstrip`` the whitespace before / after it. A cut inside a
    match - after the line break of ``"<p>\\n</p>"``, before the space of ``"New York"``, before
    a ``lstrip`` token after a line break, a last-resort cut at ``"<|" | "endoftext|>"`` -
    split it in two, and the pieces' ids there were not the whole text's. Each occurrence of a
    content counts (leftmost-longest matching may take another there: a cut is then passed over
    that could have been taken), as the text spells it (a normalizer that changes the text,
    lowercasing, is not applied)."""

    def __init__(self, tokens) -> None:
        #: ``(content, lstrip, rstrip)`` of each added token a cut can fall inside.
        self.tokens = tuple((t.content, t.lstrip, t.rstrip) for t in tokens
                            if len(t.content) > 1 or t.lstrip or t.rstrip)
        #: How many characters after a cut decide whether it is inside a match.
        self.reach = max((len(content) for content, _, _ in self.tokens), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def holding(self, text: str, at: int) -> int | None:
        """The start of the first match in ``text`` that a cut at ``at`` would split (``at``
        inside it, the whitespace an ``lstrip`` / ``rstrip`` token takes included), or ``None``
        where there is none."""
        found = None
        # (the whitespace run around the cut: an rstrip token's match may end in it, far after the token's
        # content, and an lstrip token's begin in it, far before)
        run_start, run_end = at, at
        while run_start > 0 and text[run_start - 1].isspace():
            run_start -= 1
        while run_end < len(text) and text[run_end].isspace():
            run_end += 1
        for content, lstrip, rstrip in self.tokens:
            n = len(content)
            begin = text.find(content, max(0, run_start - n), run_end + n)
            while begin != -1:
                first, last = begin, begin + n
                while lstrip and first > 0 and text[first - 1].isspace():
                    first -= 1
                while rstrip and last <= at < len(text) and text[last].isspace():  # (read up to the cut only)
                    last += 1
                if first < at < last:
                    found = first if found is None else min(found, first)
                begin = text.find(content, begin + 1, run_end + n)
        return found

    def starts_at(self, text: str, at: int) -> bool:
        """Whether a content starts at ``at`` in ``text`` (its match's own start, less any
        whitespace an ``lstrip`` token takes before it)."""
        return any(text.startswith(content, at) for content, _, _ in self.tokens)

    def holds_a_cut(self) -> bool:
        """Whether a cut of a kind of :data:`CUTS` (after a line break, before a space, each
        between characters other than whitespace) can fall inside a match: a content with a
        line break before, or a space after, a character other than whitespace; a token that
        takes the whitespace before or after it (``lstrip``, ``rstrip``)."""
        return any(lstrip or rstrip or _inner_cut(content) for content, lstrip, rstrip in self.tokens)


def _inner_cut(content: str) -> bool:
    """Whether ``content`` holds a place strictly inside it where a cut of :data:`CUTS` may
    fall: just after a line break followed by a character other than whitespace, or just
    before a space preceded by one (each with no whitespace on its other side within
    ``content``: what is beyond it may be the text's)."""
    def space(k: int) -> bool:
        return content[k].isspace()

    return any(content[k - 1] == "\n" and not space(k) and (k == 1 or not space(k - 2))
               or content[k] == " " and not space(k - 1) and (k + 1 == len(content) or not space(k + 1))
               for k in range(1, len(content)))


def added_token_matches(backend) -> AddedTokenMatches | None:
    """The :class:`AddedTokenMatches` of the ``tokenizers.Tokenizer`` ``backend``, or ``None``
    where it has no added token a cut can fall inside (attnres's own BPE has none)."""
    matches = AddedTokenMatches(backend.get_added_tokens_decoder().values())
    return matches if matches else None
