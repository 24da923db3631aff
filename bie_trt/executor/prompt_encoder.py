"""Prompts into token ids: plain text as the tokenizer splits it, chat messages (and OpenAI tools) through
the chat template. The engine encodes with one; a scale-out ingress holds its own over the same engine
directory, so the ids it routes by are the ids the replica's prefix cache is keyed by."""
from __future__ import annotations

from ..chat.tokenizer import load_tokenizer
from ..chat.tool_calls import template_messages, template_renders_tools
from ..errors import RequestError
from .prompt_checks import check_encodable, check_prompt


def developer_as_system(messages: list[dict], template: object) -> list[dict]:
    """OpenAI's `developer` role (its newer name for system instructions; Codex CLI sends its whole base
    prompt so) as a `system` message, for a template that names no developer role: Qwen's, Llama's and
    most others have no branch for it and would leave its text out of the prompt without a word."""
    if isinstance(template, str) and "developer" in template:
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


class FinalMessageError(RequestError):
    """A final message that cannot be continued (continue_final): not an assistant's text, or one the chat
    template does not write as sent. Checked here alone, for the SDK and the server (which names its field)."""


class PromptEncoder:
    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs or {}   # the chat template's extra variables by default
        self._template_renders_tools: bool | None = None   # checked at the first chat with tools

    @classmethod
    def load(cls, engine_dir: str, chat_template: str | None = None,
             template_kwargs: dict | None = None) -> "PromptEncoder":
        return cls(load_tokenizer(engine_dir, chat_template), template_kwargs)

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Text as `tokenizer(prompt)` tokenises it; a message list or `chat=True` through the chat template."""
        check_prompt(prompt)
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, list):
            check_encodable(prompt, "messages")
            return self._apply_template(prompt)
        if chat:
            check_encodable(prompt, "prompt")
            return self._apply_template([{"role": "user", "content": prompt}])
        return self.encode_text(prompt)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text as the tokenizer splits it (its special tokens added unless told not to)."""
        check_encodable(text, "prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _apply_template(self, messages: list[dict], tools: list[dict] | None = None,
                        template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        if not self.tokenizer.chat_template:
            raise RequestError("this engine's tokenizer has no chat template; send a plain prompt, or give the engine "
                               "one with --chat-template FILE (generate, serve).")
        variables = {**self.template_kwargs, **(template_kwargs or {})}
        messages = developer_as_system(messages, self.tokenizer.chat_template)
        # continue_final: the last (assistant) message is left open, its text the start of the reply
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=not continue_final,
                                                     continue_final_message=continue_final, tokenize=True,
                                                     **variables)
        except ValueError as e:   # transformers cuts the render after the final message's text: not found
            if not continue_final:
                raise
            raise FinalMessageError(f"the chat template does not write the final assistant message as sent, so "
                                    f"the reply cannot continue it ({e})") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        """Chat messages and OpenAI tools through the chat template, its default extra variables overridden
        key by key by `template_kwargs`. A template that does not render tools gets them as a system
        prompt, and assistant tool calls and tool results as text it can render. `continue_final`: the
        last message is an assistant's reply begun by the client (a prefill), which the model continues."""
        last = messages[-1] if messages else {}
        if continue_final and (last.get("role") != "assistant" or last.get("tool_calls")):
            raise FinalMessageError("continuing the final message needs the last message to be an assistant message "
                                    "with text (the reply to continue).")
        # all the request's text the template may write, before the tokenizer meets it
        for field, value in (("messages", messages), ("tools", tools), ("chat_template_kwargs", template_kwargs)):
            check_encodable(value, field)
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if not uses_tools:
            check_prompt(messages)
            return self._apply_template(messages, None, template_kwargs, continue_final)
        check_prompt(messages, "messages")
        if self._template_renders_tools is None and self.tokenizer.chat_template:
            self._template_renders_tools = template_renders_tools(self.tokenizer)
        native = bool(self._template_renders_tools)
        return self._apply_template(template_messages(messages, tools, native), tools if native else None,
                                    template_kwargs, continue_final)
