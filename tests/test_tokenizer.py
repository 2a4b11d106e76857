"""The byte-level BPE: exact round-trips on any text, one id per special token, and a
shipped tokenizer.json that is exactly what the rebuild command produces."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tinyserve.corpus import build_corpus, generate_tickets, prompt_for, render
from tinyserve.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_PATH,
    VOCAB_SIZE,
    TinyTokenizer,
    load_tokenizer,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tok() -> TinyTokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return [render(t) for t in generate_tickets(200, seed=77)]


def _model_state(backend: Tokenizer) -> dict:
    state = json.loads(backend.to_str())
    return {"model": state["model"], "added": state["added_tokens"],
            "pre": state["pre_tokenizer"], "dec": state["decoder"]}


def test_shipped_file_exists_and_loads(tok: TinyTokenizer) -> None:
    assert TOKENIZER_PATH.is_file()
    assert TOKENIZER_PATH.parent.name == "assets"
    assert tok.vocab_size == VOCAB_SIZE == 4096
    assert isinstance(tok.backend, Tokenizer)
    assert load_tokenizer() is tok  # cached


def test_special_ids(tok: TinyTokenizer) -> None:
    assert [tok.id_of(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.pad_id == tok.id_of("<|pad|>")
    assert tok.bos_id == tok.id_of("<|bos|>")
    assert tok.eos_id == tok.id_of("<|end|>")
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    with pytest.raises(KeyError):
        tok.id_of("<|nope|>")


@pytest.mark.parametrize("special", SPECIAL_TOKENS)
def test_special_token_is_one_id(tok: TinyTokenizer, special: str) -> None:
    assert tok.encode(special) == [tok.id_of(special)]
    ids = tok.encode(f"x {special}y")
    assert ids.count(tok.id_of(special)) == 1 and tok.decode(ids) == f"x {special}y"
    assert tok.decode([tok.id_of(special)]) == special


def test_round_trip_on_corpus(tok: TinyTokenizer, docs: list[str]) -> None:
    for d in docs:
        ids = tok.encode(d)
        assert tok.decode(ids) == d
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert [tok.decode(ids) for ids in tok.encode_batch(docs)] == docs


def test_compression_on_corpus(tok: TinyTokenizer, docs: list[str]) -> None:
    n_chars = sum(map(len, docs))
    n_tokens = sum(map(len, tok.encode_batch(docs)))
    assert n_chars / n_tokens > 3.5  # a corpus-trained BPE packs the regular text well


def test_prompt_ends_on_reply_marker(tok: TinyTokenizer) -> None:
    t = generate_tickets(1, seed=5)[0]
    p, d = tok.encode(prompt_for(t)), tok.encode(render(t))
    assert p[-1] == tok.id_of("<|reply|>")
    assert d[: len(p)] == p  # the prompt's tokens are a prefix of the document's
    assert d[-1] == tok.eos_id


def test_bos_and_skip_special(tok: TinyTokenizer) -> None:
    text = "<|ticket|>Hello Zoë<|end|>"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode(text)
    assert tok.decode(ids) == "<|bos|>" + text
    assert tok.decode(ids, skip_special=True) == "Hello Zoë"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_unicode(tok: TinyTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", ["", " ", "  leading", "trailing  ", "\n\n\t", "naïve café 東京 🚢⚓",
                                  "\u200b\ufeff", "مرحبا", "a<|end|>b<|reply|>", "<|end", "|>"])
def test_round_trip_edge_cases(tok: TinyTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_training_is_deterministic_on_a_sample(docs: list[str]) -> None:
    a = train_tokenizer(docs, vocab_size=600)
    b = train_tokenizer(docs, vocab_size=600)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 600
    assert [a.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    small = TinyTokenizer(a)
    assert all(small.decode(small.encode(d)) == d for d in docs)


def test_missing_file_error_names_file_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=r"nope\.json.*python -m tinyserve\.tokenizer"):
        load_tokenizer(missing)


def test_tinytokenizer_rejects_backend_without_specials(docs: list[str]) -> None:
    from tokenizers import models
    with pytest.raises(ValueError, match="special"):
        TinyTokenizer(Tokenizer(models.BPE()))


def test_shipped_tokenizer_equals_retrain(tok: TinyTokenizer) -> None:
    """``python -m tinyserve.tokenizer`` reproduces the committed file (~2 s)."""
    train, _ = build_corpus(seed=0)
    assert _model_state(train_tokenizer(train)) == _model_state(tok.backend)
