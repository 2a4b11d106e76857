"""What a prompt must be for a model to take it: the one check every loop makes first (the
plain loop, the compiled and graph decoders, the engine, speculation), with its error."""
from __future__ import annotations


class PromptError(ValueError):
    """A prompt the model cannot take; the message says which limit and what to do."""


def check_prompt(prompt_ids: list[int], max_tokens: int, context_window: int) -> None:
    if not prompt_ids:
        raise PromptError("the prompt is empty; give at least one character of text.")
    if max_tokens < 1:
        raise PromptError(f"max_tokens must be at least 1, got {max_tokens}.")
    if len(prompt_ids) >= context_window:
        raise PromptError(
            f"the prompt is {len(prompt_ids)} tokens but the context window is "
            f"{context_window}; shorten the prompt to at most {context_window - 1} tokens.")
