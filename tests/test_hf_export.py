"""Hugging Face parity: our export loads in ``transformers`` offline and computes the same
logits (fp32, tight tolerance) and the same greedy continuations."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # a test dependency: its absence must fail, not skip

from tinyserve.checkpoint import load_model
from tinyserve.config import ModelConfig
from tinyserve.generate import generate_ids
from tinyserve.hf_export import export_hf, write_hf_checkpoint
from tinyserve.model import TinyLlama
from tinyserve.tokenizer import load_tokenizer


def _hf_model(folder: Path):  # type: ignore[no-untyped-def]
    return transformers.LlamaForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32).eval()


def _assert_parity(ours: TinyLlama, theirs, vocab: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    for batch, length in [(1, 1), (2, 17), (3, 64)]:
        ids = torch.randint(0, vocab, (batch, length), generator=gen)
        with torch.no_grad():
            expected = theirs(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-4, atol=1e-4)


def _greedy_hf(theirs, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0,
                              min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def random_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyLlama, Path]:
    # A randomly initialised model with a deliberately odd shape (GQA 6:2, 3 layers),
    # so parity does not depend on the shipped weights being any good.
    tok = load_tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=48, intermediate_size=80,
                      num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=128, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(3)
    model = TinyLlama(cfg).eval()
    # Non-trivial norm gains, so a mismatch in RMSNorm would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    folder = write_hf_checkpoint(model, tok, tmp_path_factory.mktemp("hf-random"))
    return model, folder


def test_random_model_logits_match_transformers(random_export: tuple[TinyLlama, Path]) -> None:
    model, folder = random_export
    _assert_parity(model, _hf_model(folder), model.config.vocab_size, seed=0)


def test_random_model_greedy_matches_transformers(random_export: tuple[TinyLlama, Path]) -> None:
    model, folder = random_export
    theirs = _hf_model(folder)
    prompt = load_tokenizer().encode("<|ticket|>Subject: export stuck at 99%")
    ours = list(generate_ids(model, prompt, 20))
    assert ours == _greedy_hf(theirs, prompt, 20)


@pytest.fixture(scope="module")
def shipped_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(tmp_path_factory.mktemp("hf-target"), "target")


def test_shipped_target_matches_transformers(shipped_export: Path) -> None:
    ours = load_model("target", device="cpu")
    theirs = _hf_model(shipped_export)
    _assert_parity(ours, theirs, ours.config.vocab_size, seed=1)
    from tinyserve.corpus import example_prompts
    prompt = load_tokenizer().encode(example_prompts(1)[0])
    assert list(generate_ids(ours, prompt, 24)) == _greedy_hf(theirs, prompt, 24)


def test_exported_tokenizer_loads_with_autotokenizer(shipped_export: Path) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(shipped_export, local_files_only=True)
    ours = load_tokenizer()
    text = "<|ticket|>Workspace: northwind-ops\nSubject: Invoice INV-2041 charged twice<|reply|>Hi"
    assert hf_tok(text)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token == "<|end|>" and hf_tok.eos_token_id == ours.eos_id
    assert hf_tok.decode(ours.encode(text)) == text


CONVERSATIONS = [
    [{"role": "user", "content": "Subject: Login fails\n\nI cannot log in."}],
    [{"role": "system", "content": "Workspace: harbor-ops"},
     {"role": "user", "content": "Subject: Refund\n\nWe removed 3 seats."}],
    [{"role": "developer", "content": "Plan: Team"},
     {"role": "user", "content": [{"type": "text", "text": "Subject: Export"},
                                  {"type": "text", "text": "It stops at 99%."}]},
     {"role": "assistant", "content": "Hi Ana, sorry about the export."},
     {"role": "user", "content": "Still stuck."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn parts"])
def test_exported_chat_template_gives_our_servers_prompt_ids(shipped_export: Path,
                                                             messages: list[dict]) -> None:
    from tinyserve.serving.api_schema import ChatMessage, chat_prompt
    hf_tok = transformers.AutoTokenizer.from_pretrained(shipped_export, local_files_only=True)
    ours = load_tokenizer().encode(chat_prompt([ChatMessage(**m) for m in messages]))
    for generation_prompt in (True, False):   # our user turn already ends with the cue
        theirs = hf_tok.apply_chat_template(messages, tokenize=True,
                                            add_generation_prompt=generation_prompt)
        ids = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
        assert list(ids) == ours
