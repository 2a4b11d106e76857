"""The command line: useful output, and one clear line (no traceback) for bad input."""
from __future__ import annotations

import argparse

import pytest

from tinyserve.__main__ import build_parser, main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_empty_prompt_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "generate", "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err and "Traceback" not in err


def test_unknown_model_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "hi", "--model", "giant"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'giant'" in err and "'target', 'draft'" in err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_model_choice_comes_from_one_list() -> None:
    from tinyserve.paths import MODEL_NAMES
    seen = 0
    for name, parser in _subparsers().items():
        for action in parser._actions:
            if "--model" in action.option_strings and name != "loadgen":  # loadgen: any server's
                assert tuple(action.choices) == MODEL_NAMES, name
                seen += 1
    assert seen == 4   # generate, serve, calibrate, export-hf


def test_serve_defaults_are_serve_options() -> None:
    from dataclasses import fields

    from tinyserve.serving.options import ServeOptions
    args = build_parser().parse_args(["serve"])
    assert ServeOptions(**{f.name: getattr(args, f.name) for f in fields(ServeOptions)}) \
        == ServeOptions()


def test_prompt_longer_than_the_context_window(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "generate", "--prompt", "word " * 2000, "--max-tokens", "5")
    assert code == 2
    assert "context window is 512" in err and "shorten the prompt" in err


def test_truncate_stops_at_the_window_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "generate", "--prompt", "word " * 250, "--max-tokens", "50",
                        "--truncate")
    assert code == 0, err
    # 500 prompt tokens leave 12 in the 512-token window.
    assert err.strip().splitlines()[-1].startswith("12 tokens")
    assert "(--max-tokens 50 cut to 12: the 512-token context window)" in err


def test_negative_temperature_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "generate", "--prompt", "hi", "--temperature", "-1")
    assert code == 2 and "temperature must be >= 0" in err


def test_generate_drafts_a_reply_for_a_ticket(capsys: pytest.CaptureFixture[str]) -> None:
    from tinyserve.corpus import generate_tickets, prompt_for
    ticket = generate_tickets(1, seed=987)[0]
    code, out, _ = _run(capsys, "generate", "--prompt", prompt_for(ticket), "--max-tokens", "80")
    assert code == 0
    # A trained model writes a reply in the corpus's shape and cites the policy that governs
    # the ticket's category (the triage line in the prompt names the category).
    assert out.startswith("Hi "), out[:200]
    assert f"Policy {ticket.policy_id}" in out, out[:400]


def test_sampling_is_reproducible_under_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("generate", "--prompt", "<|ticket|>Subject:", "--max-tokens", "12",
            "--temperature", "1.0", "--seed", "7")
    first, second = _run(capsys, *args), _run(capsys, *args)
    assert first[0] == 0 and first[1] == second[1]


@pytest.mark.parametrize("argv, fragment", [
    (("generate", "--example", "-1"), "--example takes a ticket number from 0 to 99, got -1"),
    (("generate", "--example", "100"), "--example takes a ticket number from 0 to 99, got 100"),
    (("generate", "--prompt", "hi", "--max-tokens", "0"), "--max-tokens must be at least 1"),
    (("generate", "--prompt", "hi", "--max-tokens", "600"),
     "context window is 512 tokens; the prompt has 2 tokens and --max-tokens is 600 (602 in all); "
     "shorten the prompt or lower --max-tokens; or pass --truncate"),
    (("train", "--preset", "draft", "--steps", "0"), "--steps must be at least 1"),
    (("bench", "nosuch"), "unknown bench suite 'nosuch'"),
    (("calibrate", "--repeats", "0"), "--repeats must be at least 1"),
    (("serve", "--port", "99999"), "--port must be between 1 and 65535"),
    (("serve", "--num-blocks", "0"), "--num-blocks must be at least 1"),
    (("serve", "--queue-timeout", "0"), "--queue-timeout must be a positive"),
    (("serve", "--host", "0.0.0.0"), "pass --allow-remote"),
])
def test_bad_arguments_get_one_line(capsys: pytest.CaptureFixture[str], argv: tuple,
                                    fragment: str) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and fragment in err and "Traceback" not in err


def test_serve_on_a_busy_port_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = _run(capsys, "serve", "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
