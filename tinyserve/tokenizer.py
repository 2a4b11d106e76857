"""Byte-level BPE tokenizer for the Harbor corpus (4096 tokens).

Why byte-level BPE: every string, in any script, maps to tokens and back exactly
(``decode(encode(text)) == text``), so the serving engine never meets an unknown
character and streamed output can be reassembled byte for byte.

Why a small vocabulary trained on our own corpus: the embedding and output layers of a
~6M-parameter model would be dominated by a 50k vocabulary, and a corpus-specific 4096
vocabulary packs the regular ticket text into ~4.1 characters per token, so a short
CPU training run sees more documents per step.

Why special tokens: the four document markers (``<|ticket|>``, ``<|triage|>``,
``<|reply|>``, ``<|end|>``) must each be one id, so a prompt ends on a clean token
boundary and generation can stop on ``<|end|>`` (which doubles as EOS). ``<|pad|>``
fills batches and ``<|bos|>`` optionally starts a sequence.

The backend is a plain ``tokenizers.Tokenizer`` (no custom components), so it can be
handed to ``transformers.PreTrainedTokenizerFast(tokenizer_object=...)`` for a Hugging
Face export. Rebuild the shipped file with ``python -m tinyserve.tokenizer``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .paths import ASSETS

__all__ = [
    "VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "TOKENIZER_PATH",
    "train_tokenizer",
    "TinyTokenizer",
    "load_tokenizer",
]

#: Vocabulary size, special tokens included.
VOCAB_SIZE = 4096
#: Special tokens, in id order (ids 0..5): pad, bos, then the four document markers.
SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|ticket|>", "<|triage|>", "<|reply|>", "<|end|>")
#: Where the shipped tokenizer lives (committed with the package).
TOKENIZER_PATH = ASSETS / "tokenizer.json"

_REBUILD_HINT = "python -m tinyserve.tokenizer"


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on ``texts``.

    Deterministic: the same texts give the same vocabulary and merges (checked by the
    tests), so the shipped ``tokenizer.json`` can be verified by retraining.
    """
    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every input
    # add_prefix_space=False: a leading space would break exact round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class TinyTokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer`` with the ids the engine needs.

    Kept thin on purpose: all the real work stays in the standard backend, which other
    modules (the Hugging Face export) use directly through :attr:`backend`.
    """

    def __init__(self, backend: Tokenizer) -> None:
        self._tok = backend
        missing = [t for t in SPECIAL_TOKENS if backend.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer is missing special tokens {missing}")

    @property
    def backend(self) -> Tokenizer:
        """The raw ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_of(self, token: str) -> int:
        """The id of one vocabulary token (e.g. a special token); KeyError if absent."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    @property
    def pad_id(self) -> int:
        return self.id_of("<|pad|>")

    @property
    def bos_id(self) -> int:
        return self.id_of("<|bos|>")

    @property
    def eos_id(self) -> int:
        """``<|end|>``: the end of a document is the end of a generation."""
        return self.id_of("<|end|>")

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids for ``text``; special-token strings in it become their single ids."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool = False) -> list[list[int]]:
        """:meth:`encode` for many texts at once (the backend parallelises it)."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [[self.bos_id, *e.ids] if add_bos else e.ids for e in encs]

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text for ``ids``; exact inverse of :meth:`encode` when ``skip_special`` is False."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"TinyTokenizer(vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=8)
def _load(path: Path) -> TinyTokenizer:
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file not found: {path}. Rebuild it with `{_REBUILD_HINT}` "
            "from the repository root."
        )
    return TinyTokenizer(Tokenizer.from_file(str(path)))


def load_tokenizer(path: Path | None = None) -> TinyTokenizer:
    """Load (once per path, then cached) the shipped tokenizer or the one at ``path``."""
    return _load(Path(path or TOKENIZER_PATH).resolve())


def _main() -> None:
    from tinyserve.corpus import build_corpus

    train, val = build_corpus(seed=0)
    backend = train_tokenizer(train)
    TOKENIZER_PATH.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(TOKENIZER_PATH))
    _load.cache_clear()
    tok = TinyTokenizer(backend)
    n_train = sum(map(len, tok.encode_batch(train)))
    n_val = sum(map(len, tok.encode_batch(val)))
    chars = sum(map(len, train))
    print(f"saved {TOKENIZER_PATH}")
    print(f"vocab size: {tok.vocab_size}")
    print(f"train: {len(train)} docs, {n_train:,} tokens")
    print(f"val:   {len(val)} docs, {n_val:,} tokens")
    print(f"chars per token (train): {chars / n_train:.2f}")


if __name__ == "__main__":
    _main()
