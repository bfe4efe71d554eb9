"""Tokenizers: the model directory's tokenizer.json when it has one, else byte-level."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from relayout.engine.model.config import ModelConfig

BYTE_SPECIALS = 256  # ids below are raw bytes; ids from here up are specials


class Tokenizer:
    """Common interface; ``eos_token_ids`` comes from the model config."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """ids 0..255 are UTF-8 bytes; ids >= 256 are specials and decode to ""."""

    def __init__(
        self, vocab_size: int = 260, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no specials are ever added

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_SPECIALS).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer.json; special tokens are skipped when decoding."""

    def __init__(self, path: Path, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens=True: the tokenizer's own post-processor decides (e.g. a BOS); a
        # rendered chat template places its own, so chat encodes without
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: Path | None, cfg: ModelConfig | None = None) -> Tokenizer:
    eos = tuple(cfg.eos_token_id) if cfg else ()
    bos = cfg.bos_token_id if cfg else None
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(model_dir) / "tokenizer.json", eos, bos)
    return ByteTokenizer(cfg.vocab_size if cfg else 260, eos, bos)


class IncrementalDetokenizer:
    """Streaming detokenization: ``add(id)`` returns the text that id completes.

    Decodes a small window of recent ids (the previous emitted token as context, so
    tokenizers that drop a leading space on the first token still emit it) and holds the
    text back while it ends in U+FFFD, i.e. while a multi-byte character is still split
    across tokens. The output depends only on the id sequence, so a resumed stream
    rebuilds its state by replaying the already-sent ids (``add_many``) and dropping the text.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start (context already emitted)
        self._read = 0  # ids before this have been emitted
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        dec = self.tokenizer.decode
        prefix_text = dec(self.ids[self._prefix : self._read])
        new_text = dec(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character at the end: wait
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def add_many(self, ids: Iterable[int]) -> str:
        return "".join(self.add(i) for i in ids)

    def flush(self) -> str:
        """End of stream: emit whatever is held back (an invalid tail becomes U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(self.ids[self._prefix :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
