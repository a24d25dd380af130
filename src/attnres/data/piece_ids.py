"""The ids of a text encoded in pieces (those of :func:`~attnres.data.tokenizer.text_chunks`,
about 1 MB each) as the ids of the text as a whole.

A tokenizer that marks the start of every text it encodes
(:attr:`~attnres.data.tokenizer.BPETokenizer.marks_text_start`: a SentencePiece-style
``tokenizer.json``, Llama 2's or Mistral v0.1's, puts a "▁" before it) read each piece after
the first as a text's start: "▁word" where the whole text has "word", other ids at every cut.
Such a piece is encoded after the text just before its cut (its context), and the context's
ids are dropped from the result. Other tokenizers (attnres's own byte-level BPE, bytes) read a
piece's start as any other place: their pieces are encoded alone, as they always were.
"""

from __future__ import annotations

import re

from .tokenizer import Tokenizer

#: At most how many characters before a cut a piece is encoded after: the word (or line)
#: the cut ends, so that the piece's first word is read as inside the text.
CONTEXT_CHARS = 256

_WHITESPACE = re.compile(r"\s")


def context_before(text: str) -> str:
    """What a piece that follows ``text`` is encoded after: ``text``'s last
    :data:`CONTEXT_CHARS` characters from their first whitespace on (a word's start, where a
    SentencePiece-style tokenizer's words start too), or all of them where none is one."""
    tail = text[-CONTEXT_CHARS:]
    space = _WHITESPACE.search(tail)
    return tail if space is None else tail[space.start():]


def pieces_ids(tok: Tokenizer, pieces: list[str], before: str = "") -> list[list[int]]:
    """The ids of ``pieces``, consecutive pieces of a text that follow ``before`` (the piece
    before the first of them; ``""`` at the text's start), encoded in batches
    (``tok.encode_batch``, on the tokenizer's threads). Where ``tok`` marks a text's start, each
    piece is encoded after its :func:`context_before` and the context's own ids are dropped
    from the start of the result, so that joined the ids are the whole text's; where they do not
    start it (the text across the cut read otherwise), the piece's ids alone, as before."""
    if not tok.marks_text_start:
        return tok.encode_batch(pieces)
    contexts = [context_before(text) for text in [before, *pieces[:-1]]]
    read = tok.encode_batch([context + piece for context, piece in zip(contexts, pieces)])
    heads = tok.encode_batch(contexts)
    return [ids[len(head):] if ids[:len(head)] == head else tok.encode(piece)
            for piece, head, ids in zip(pieces, heads, read)]
