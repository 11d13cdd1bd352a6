"""Request prompt -> token ids: the ONE code path for the replica server and the router.

The router keys its cache-aware routing on the same token ids the engine will see, so both
call these functions with the same tokenizer and chat template. Two tokenizations of one
chat request (a missing generation prompt, a different template) would leave the router
with keys that never match the engine's cache (docs/architecture.md F12).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshare.models.tokenizer import Tokenizer
from kvshare.serve.packed_request import TOKENIZED_KEY, TOKENIZER_KEY

# Token ids as a request carries them: a list, or the int32 array kvshare.serve.http reads
# a long list of ids into.
TokenIds = list[int] | np.ndarray

CHAT_ROLES = ("system", "user", "assistant")


class PromptError(ValueError):
    """The prompt or messages of a request are unusable; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_token_list(value: object) -> bool:
    # Exact types, not isinstance: bools are not token ids. (The set of types is ~4x faster
    # than a loop over a 130k-token prompt.)
    return isinstance(value, list) and set(map(type, value)) <= {int}


def _is_token_array(value: object) -> bool:
    return isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.int32


def completion_prompt(prompt: object) -> str | TokenIds:
    """A /v1/completions `prompt`: a string, a token-id list (or array), or a list holding
    one of those."""
    if _is_token_array(prompt) and len(prompt):  # type: ignore[arg-type]
        return prompt  # type: ignore[return-value]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (_is_token_list(prompt) and prompt):
        return prompt  # type: ignore[return-value]
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, (str, list)) for p in prompt)
    ):
        raise PromptError("one prompt per request: batched prompts are not supported", "prompt")
    raise PromptError(
        "prompt must be a string, a non-empty list of token ids, or a list holding one of those",
        "prompt",
    )


def completion_prompt_ids(
    tokenizer: Tokenizer | None,
    prompt: object,
    tokenized: np.ndarray | None = None,
    scope: str | None = None,
) -> TokenIds:
    """The ids of a /v1/completions `prompt`; a text prompt's are `tokenized` when given
    (the ids this tokenizer made of it elsewhere: `tokenized_by_router`), else encoded in
    `scope` (Tokenizer.encode)."""
    text_or_ids = completion_prompt(prompt)
    if not isinstance(text_or_ids, str):
        return text_or_ids
    if tokenizer is None:
        raise PromptError(
            "this model has no tokenizer: send the prompt as a list of token ids", "prompt"
        )
    ids = tokenizer.encode(text_or_ids, scope=scope) if tokenized is None else tokenized
    if not len(ids):
        raise PromptError("the prompt is empty", "prompt")
    return ids


def chat_messages(messages: object) -> list[dict[str, str]]:
    """Checked messages, reduced to role and content (what the template renders)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(
            "messages must be a non-empty list of {role, content} objects", "messages"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(
                f"messages[{i}] must be an object, not {type(message).__name__}", "messages"
            )
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise PromptError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                "messages",
            )
        if not isinstance(content, str):
            raise PromptError(
                f"messages[{i}].content must be a string (content parts are not "
                f"supported); got {type(content).__name__}",
                "messages",
            )
        out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(
    tokenizer: Tokenizer | None,
    messages: object,
    tokenized: np.ndarray | None = None,
    scope: str | None = None,
) -> TokenIds:
    """The ids of chat `messages` rendered by the chat template; `tokenized` when given
    (the ids this tokenizer made of them elsewhere: `tokenized_by_router`), else encoded in
    `scope` (Tokenizer.encode)."""
    checked = chat_messages(messages)
    if tokenizer is None or tokenizer.chat_template is None:
        raise PromptError("this model has no chat template: use /v1/completions", "messages")
    if tokenized is not None:
        return tokenized
    try:
        return tokenizer.encode_chat(checked, scope=scope)
    except ValueError as exc:
        raise PromptError(str(exc), "messages") from None


def tokenizes_text(path: str, body: dict[str, Any]) -> bool:
    """Whether the prompt ids of a body `request_prompt_ids` read came from the tokenizer:
    chat messages, or a text prompt (by completion_prompt's rule)."""
    return path.endswith("/chat/completions") or isinstance(
        completion_prompt(body.get("prompt")), str
    )


def tokenized_by_router(tokenizer: Tokenizer | None, body: dict[str, Any]) -> np.ndarray | None:
    """The ids a packed body carries for its text prompt or messages, when the tokenizer
    that made them is this one (kvshare.serve.packed_request); None: tokenize here."""
    ids = body.get(TOKENIZED_KEY)
    if tokenizer is None or not isinstance(ids, np.ndarray):
        return None
    return ids if body.get(TOKENIZER_KEY) == tokenizer.digest else None


def request_prompt_ids(tokenizer: Tokenizer | None, path: str, body: dict[str, Any]) -> TokenIds:
    """Prompt ids of a parsed /v1/completions or /v1/chat/completions body. A text is
    encoded in the scope of the body's cache salt: a tenant's prompt never reuses the ids
    of another tenant's (kvshare.models.encoded_prefixes)."""
    tokenized = tokenized_by_router(tokenizer, body)
    salt = body.get("cache_salt")
    scope = salt if isinstance(salt, str) else ""
    if path.endswith("/chat/completions"):
        return chat_prompt_ids(tokenizer, body.get("messages"), tokenized, scope)
    return completion_prompt_ids(tokenizer, body.get("prompt"), tokenized, scope)
