"""Checks on what a caller sends as a prompt, before it reaches the engine loop."""
from __future__ import annotations

from ..errors import RequestError
from ..sampling_params import SamplingParams


def check_prompt(prompt: object, name: str = "the prompt") -> None:
    """One line naming `name` (`prompts[1]`) for a prompt `encode` cannot take: empty, or no string, list of
    token ids or list of chat messages."""
    if isinstance(prompt, (str, list)) and not prompt:
        raise RequestError(f"{name} is empty; send at least one token.")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) or all(isinstance(m, dict)
                                                                                       for m in prompt):
            return
        kinds = sorted({type(p).__name__ for p in prompt})
        got = f"a list of {' and '.join(kinds)}"
        several = "; to run several prompts, pass generate() a list of them" if kinds == ["str"] else ""
    else:
        got, several = type(prompt).__name__, ""
    raise RequestError(f"{name} must be a string, a list of token ids or a list of chat messages; got {got}"
                       f"{several}.")


class UnencodableText(RequestError):
    """Text that is not Unicode: a string holding a lone surrogate. JSON's `"\\ud800"` parses into one, and
    no tokenizer can encode it (UTF-8 has no bytes for it). `field` names where it is, as a path into what
    was sent (`messages[1].content`)."""

    def __init__(self, field: str, at: int, char: str):
        super().__init__(f"{field} holds a lone surrogate (U+{ord(char):04X}) at character {at}, which is not "
                         f"Unicode text and cannot be tokenised; send the character it stands for (a surrogate "
                         f"pair in JSON) or leave it out.")
        self.field = field


def unencodable(value: object, field: str = "") -> UnencodableText | None:
    """The first string in `value` (through nested lists and dicts) that is not Unicode text, as the error
    naming its path under `field`; None when all of it is text."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as e:
            return UnencodableText(field, e.start, value[e.start])
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        path = f"{field}[{key}]" if isinstance(key, int) else f"{field}.{key}" if field else str(key)
        if (found := unencodable(item, path)) is not None:
            return found
    return None


def check_encodable(value: object, field: str) -> None:
    """Raises UnencodableText naming the first string under `field` that no tokenizer can take."""
    if (found := unencodable(value, field)) is not None:
        raise found


class ContextTooLong(RequestError):
    """A prompt that leaves the context no room for one generated token. The one place a prompt is measured
    against the context (on its token ids, whatever route or SDK call sent it); the server answers it as
    OpenAI does (code context_length_exceeded), and the message holds OpenAI's words ("maximum context length"),
    which clients match to compact a conversation."""

    def __init__(self, prompt_tokens: int, max_model_len: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens but this model's maximum context length is "
                         f"{max_model_len} tokens (max_model_len; prompt plus at least one generated token must "
                         f"fit); shorten the prompt or rebuild with a larger --max-model-len.")
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len


def check_prompt_ids(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """One line for token ids this engine cannot run: none, too many for max_model_len (ContextTooLong), or an
    id (in the prompt or in logit_bias) outside the vocabulary."""
    if not prompt_ids:
        raise RequestError("the prompt is empty; send at least one token.")
    if len(prompt_ids) >= max_model_len:
        raise ContextTooLong(len(prompt_ids), max_model_len)
    if (bad := next((t for t in prompt_ids if not 0 <= t < vocab_size), None)) is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size}); send ids from this "
                           f"model's tokenizer.")
    if params.logit_bias and (bad := next((t for t in params.logit_bias if t >= vocab_size), None)) is not None:
        raise RequestError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size}); send ids from "
                           f"this model's tokenizer.")
