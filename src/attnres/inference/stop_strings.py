"""Stop strings: a sequence ends when the decoded text of its new tokens contains one of them
(transformers' ``generate(stop_strings=..., tokenizer=...)``, vLLM's ``stop``,
``attnres generate --stop``).

The text is followed as it grows, token by token, each decoding a tail window of a few tokens
(:class:`TextPieces`), and searched piece by piece (:class:`StopStrings`), so a stop string is
found at the token that completes it - across tokens, inside one, or ending inside a
character's bytes - and ``stream``, ``generate`` and ``attnres generate`` stop at the same
token. The stop string's tokens are
returned (as transformers does, and as a stop token is); :func:`text_until_stop` gives the
text before the stop string, what ``attnres generate`` prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["StopStrings", "TextPieces", "Completion", "text_until_stop", "check_stop_strings", "RowStops"]


#: The character a decoder writes for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"
#: The most tokens a character's bytes can span (UTF-8 has at most 4 bytes a character, a token
#: at least one): past twice this many tokens whose text ends in U+FFFD, all but the last this
#: many are settled (:meth:`TextPieces._settle_early`).
_CHARACTER_TOKENS = 4


class TextPieces:
    """The text of one sequence's new tokens as they come: :meth:`add` takes a token and
    gives the text it adds. A token that ends inside a character (a byte-level token holding
    part of "é": U+FFFD) waits for the rest of it, so the pieces add up to the final text, not
    to a U+FFFD that the next token completes; :meth:`end` gives a character cut short by the
    last token, as it is. ``ids``: the tokens so far (a list given is appended to).

    Decoding the whole continuation at each token costs work that grows with its length (the
    generation quadratic in it); as transformers' ``TextStreamer`` and vLLM's detokenizer do,
    only a tail window is decoded: from the token where the text before last ended on a
    whole character (``_start``) to the newest, and the new text is what it adds to the
    window's text up to where the text last ended whole (``_read``) - a decoder that joins
    tokens (a word's leading space, a byte-fallback character) sees the tokens it joins. The
    pieces are those that decoding the whole continuation each time gives, for decoders whose
    text past a whole character does not depend on the tokens before it (byte-level BPE, byte
    fallback on valid UTF-8, the byte tokenizer)."""

    def __init__(self, tokenizer, ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids = [] if ids is None else ids
        self._start = self._read = 0  # the window's first token; the tokens whose text is settled
        self._prefix = 0  # len(decode(ids[_start:_read])): where the window's new text begins
        self._held = 0  # the U+FFFD that the settled text ends with (after _settle_early), not yet shown
        self._tail = ""  # the text after the settled text
        self._shown = 0  # how much of _tail is given out (-k: all but the settled text's last k U+FFFD)

    def add(self, token: int) -> str:
        """Append ``token``; the text it adds that is now settled (possibly ``""``)."""
        self.ids.append(token)
        window = self.tokenizer.decode(self.ids[self._start:])
        self._tail = window[self._prefix:]
        ready = self._tail.rstrip(_REPLACEMENT)
        # (the text with its final U+FFFD held back reaches `reach` past the settled text)
        reach = len(ready) if ready else -self._held
        piece = ""
        if reach > self._shown:
            piece = (_REPLACEMENT * self._held + self._tail)[self._held + self._shown:self._held + reach]
            self._shown = reach
        if len(ready) == len(self._tail):  # the text ends on a whole character: all of it settled
            self._settle(len(self.ids), self._tail)
        elif len(self.ids) - self._read > 2 * _CHARACTER_TOKENS:
            self._settle_early(window)
        return piece

    def end(self) -> str:
        """The text not given yet, at the end of the sequence (a character cut short as it is)."""
        rest = (_REPLACEMENT * self._held + self._tail)[self._held + self._shown:]
        self._shown = len(self._tail)
        return rest

    def _settle(self, upto: int, text: str) -> None:
        """The tokens before ``upto`` are settled, ``text`` what they add to the settled text;
        the window now starts where the settled text ended before."""
        whole = text.rstrip(_REPLACEMENT)
        self._held = len(text) - len(whole) + (0 if whole else self._held)
        self._shown -= len(text)
        self._tail = self._tail[len(text):]
        self._start, self._read = self._read, upto
        self._prefix = len(self.tokenizer.decode(self.ids[self._start:self._read]))

    def _settle_early(self, window: str) -> None:
        """A long run of tokens whose text ends in U+FFFD (bytes that are no character: a model
        gone astray) would widen the window without end: the tokens before the last
        :data:`_CHARACTER_TOKENS` are settled when their text is the window's beginning - the
        tokens after them, 3 bytes or more, have decided any character their last bytes begin:
        completed, it would have changed that text's final U+FFFD."""
        upto = len(self.ids) - _CHARACTER_TOKENS
        before = self.tokenizer.decode(self.ids[self._start:upto])
        if window.startswith(before):
            self._settle(upto, before[self._prefix:])


class StopStrings:
    """The streamed text up to the first of ``stops``, without the stop string and what
    follows. :meth:`feed` takes each piece of the text and gives what is now safe to print: it
    holds back the longest end of the text that begins a stop string (more text may complete
    it) until it can no longer match; :meth:`flush` gives what is held back when the text
    ends. ``found``: the stop string met, else ``None``."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.found: str | None = None
        self._held = ""
        self._longest = max(map(len, stops), default=0)

    def feed(self, piece: str) -> str:
        """Take the next ``piece`` of the text; the part now safe to print (``""`` after a stop)."""
        if self.found is not None:
            return ""
        text = self._held + piece  # (a stop string that was not in the text before begins in what is held)
        hits = [(at, stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if hits:
            at, self.found = min(hits, key=lambda hit: hit[0])
            self._held = ""
            return text[:at]
        keep = next((k for k in range(min(len(text), self._longest - 1), 0, -1)
                     if any(stop.startswith(text[-k:]) for stop in self.stops)), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back (a possible start of a stop string), at the end of the text."""
        held, self._held = self._held, ""
        return held


class Completion(NamedTuple):
    """One sequence's completion as :func:`text_until_stop` reads it."""

    text: str  #: the text of its tokens, up to the first stop string (without it)
    stop: str | None  #: the stop string found, or None
    n_tokens: int  #: the tokens read: up to the one that ended it (a stop string's last, a stop token), or all


def text_until_stop(tokenizer, ids: Iterable[int], stop_strings: Iterable[str] | str | None = (),
                    stop_tokens: Iterable[int] = ()) -> Completion:
    """The text of ``ids`` (one sequence's new tokens, a row of ``generate``'s output) up to
    the first of ``stop_strings``, without it - what ``attnres generate --stop`` prints - and
    the stop string found. The tokens after the one that completes a stop string, or after
    one of ``stop_tokens`` (its text kept), are not read: ``generate``'s padding. ``ids`` and
    ``stop_tokens``: lists of ids or 1-D tensors."""
    pieces, until = TextPieces(tokenizer), StopStrings(check_stop_strings(stop_strings, tokenizer))
    ends, out = set(_token_ids(stop_tokens, "stop_tokens", "[id] for one")), []
    for token in _token_ids(ids, "ids", "one sequence's: a row of generate's output, out[0]"):
        out.append(until.feed(pieces.add(token)))
        if until.found is not None:
            return Completion("".join(out), until.found, len(pieces.ids))
        if token in ends:
            break
    out.append(until.feed(pieces.end()))
    return Completion("".join(out) + until.flush(), until.found, len(pieces.ids))


def _token_ids(values: Iterable[int], name: str, hint: str) -> list[int]:
    """``values`` as Python ints: a 0-d tensor's elements were never equal to an int (its
    stop tokens were not seen), a 2-D tensor (``generate``'s output, not a row) raised torch's
    "only one element tensors can be converted"; ``ValueError`` naming ``name`` (``hint``: what
    to give) for those and for one int alone."""
    if isinstance(values, Tensor) and values.dim() == 1:
        return values.tolist()
    if isinstance(values, (Integral, str, bytes, Tensor)) or not isinstance(values, Iterable):
        shape = f" of shape {tuple(values.shape)}" if isinstance(values, Tensor) else ""
        raise ValueError(f"{name} must be a list of token ids or a 1-D tensor ({hint}); got {type(values).__name__}"
                         f"{shape}")
    return [int(v) for v in values]


def check_stop_strings(stop_strings: Iterable[str] | str | None, tokenizer) -> list[str]:
    """``stop_strings`` as a list (one string alone: that one, as transformers takes it;
    ``None``, transformers' default: none), after checking each is a non-empty ``str`` and that
    ``tokenizer`` can decode (``decode(ids) -> str``) when there are any; ``ValueError`` naming
    the parameter otherwise."""
    if stop_strings is None:
        return []
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if isinstance(stop_strings, (bytes, Tensor)) or not isinstance(stop_strings, Iterable):
        raise ValueError(f"stop_strings must be a list of non-empty strings (a str for one); got {stop_strings!r}")
    stops = list(stop_strings)
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise ValueError(f"stop_strings must be non-empty strings; got {stop!r}")
    if stops and not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"stop_strings needs tokenizer=, the tokenizer whose decode(ids) gives the text "
                         f"(attnres.inference.load_tokenizer(run), or a transformers tokenizer); got {tokenizer!r}")
    return stops


class RowStops:
    """The stop strings of a batch of ``batch_size`` sequences in a generation loop: after a
    step's tokens, :meth:`update` reads them (with ``finished``, the rows already ended, and
    ``flags``, 0-d tensors the loop reads anyway: one host sync for all), follows each
    unfinished row's text and marks ``finished`` for those that now hold a stop string."""

    def __init__(self, tokenizer, stops: list[str], batch_size: int) -> None:
        self.texts = [TextPieces(tokenizer) for _ in range(batch_size)]
        self.until = [StopStrings(stops) for _ in range(batch_size)]

    def update(self, tokens: Tensor, finished: Tensor, *flags: Tensor) -> tuple[bool, ...]:
        """``(every row finished, *flags)`` as Python bools; ``finished`` updated in place."""
        b = len(self.texts)
        host = torch.cat((tokens, finished.long(), *(f.long().reshape(1) for f in flags))).tolist()
        ended = []
        for i, (token, done) in enumerate(zip(host[:b], host[b:2 * b])):
            if not done:  # (a row ended by a stop token, or before: its text is no longer followed)
                self.until[i].feed(self.texts[i].add(token))
                if self.until[i].found is not None:
                    ended.append(i)
        if ended:
            finished[ended] = True
        return (sum(host[b:2 * b]) + len(ended) == b, *map(bool, host[2 * b:]))
