"""The OpenAI request and response shapes of /v1/completions and /v1/chat/completions.

Parsing turns a JSON body into a `GenerateRequest` or raises `APIError` (a 4xx naming the
field). Extensions beyond OpenAI: `top_k`, `ignore_eos`, `cache_salt` (vLLM's: a
non-empty string; only requests with the same salt share prefix cache), `token_ids` in
every choice (the generated ids: a model without a tokenizer streams no text), and
`usage.kv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshare.engine.block_manager import check_cache_salt
from kvshare.engine.llm_engine import RequestOutput
from kvshare.engine.sampling_params import SamplingParams
from kvshare.models.tokenizer import Tokenizer
from kvshare.serve.errors import APIError, bad_request
from kvshare.serve.prompts import PromptError, request_prompt_ids

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
# Fields whose OpenAI meaning this server does not implement, with the values that ask for
# nothing: any other value is refused rather than silently ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "echo": (None, False), "logprobs": (None, False), "top_logprobs": (None, 0),
    "suffix": (None, ""), "tools": (None, []), "best_of": (None, 1),
}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    dtype: str


@dataclass(frozen=True)
class GenerateRequest:
    chat: bool
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    cache_salt: str | None = None


def _present(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got {value!r}", name)
    if not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad_request(f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request(f"stop must be a non-empty string or a list of at most "
                          f"{MAX_STOP_STRINGS} non-empty strings", "stop")
    return tuple(stops)


def cache_salt_of(body: dict[str, Any]) -> str | None:
    """The request's `cache_salt`: absent or null is None; anything but a non-empty string
    of at most MAX_CACHE_SALT_CHARS characters is a 400."""
    try:
        return check_cache_salt(body.get("cache_salt"))
    except ValueError as exc:
        raise bad_request(str(exc), "cache_salt") from None


def check_model(body: dict[str, Any], model: ModelInfo) -> None:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required (a string naming the served model)", "model")
    if name != model.name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {model.name!r}",
                       param="model", code="model_not_found")


def _prompt_ids(body: dict[str, Any], chat: bool, model: ModelInfo) -> list[int]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        ids = request_prompt_ids(model.tokenizer, path, body)
    except PromptError as exc:
        raise bad_request(str(exc), exc.param) from None
    if min(ids) < 0 or max(ids) >= model.vocab_size:
        raise bad_request(f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
    param = "messages" if chat else "prompt"
    if len(ids) >= model.max_model_len:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is "
                          f"{model.max_model_len} tokens, so at most {model.max_model_len - 1} "
                          f"fit with one generated token", param)
    return ids


def _max_tokens(body: dict[str, Any], chat: bool, prompt_len: int, model: ModelInfo) -> int:
    name = "max_completion_tokens" if _present(body, "max_completion_tokens") else "max_tokens"
    value = _int(body, name)
    room = model.max_model_len - prompt_len
    if value is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
        return min(16, room) if not chat else room
    if value < 1:
        raise bad_request(f"{name} must be >= 1, got {value}", name)
    if value > room:
        raise bad_request(f"{name} is {value}, but the prompt has {prompt_len} tokens and this "
                          f"model's context is {model.max_model_len}: at most {room} can be "
                          f"generated", name)
    return value


def parse_generate(body: dict[str, Any], chat: bool, model: ModelInfo) -> GenerateRequest:
    check_model(body, model)
    for name, harmless in UNSUPPORTED_FIELDS.items():
        if body.get(name) not in harmless:
            raise bad_request(f"{name} is not supported by this server", name)
    n = _int(body, "n")
    if n not in (None, 1):
        raise bad_request(f"only n=1 is supported, got n={n}", "n")
    cache_salt = cache_salt_of(body)
    ids = _prompt_ids(body, chat, model)
    seed = _int(body, "seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, {MAX_SEED}], got {seed}", "seed")
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1, 0 (disabled) or positive, got {top_k}", "top_k")
    params = SamplingParams(
        max_tokens=_max_tokens(body, chat, len(ids), model),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=top_k or 0,
        seed=seed,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = stream and _bool(options or {}, "include_usage", False)
    return GenerateRequest(chat, tuple(ids), params, stream, include_usage, cache_salt)


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        "kv": {"gpu_hit_tokens": out.gpu_hit_tokens, "pool_hit_tokens": out.pool_hit_tokens,
               "computed_tokens": out.computed_tokens},
    }


@dataclass(frozen=True)
class ResponseFormat:
    """Builds the JSON objects of one request's answer (whole or streamed)."""

    chat: bool
    request_id: str
    model: str
    created: int

    def _envelope(self, chunk: bool, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def full(self, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choice.update(token_ids=list(out.token_ids), logprobs=None, finish_reason=out.finish_reason)
        return self._envelope(False, [choice], usage=usage(out))

    def chunk(self, text: str, token_ids: tuple[int, ...], finish_reason: str | None,
              include_usage: bool, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
        else:
            choice["text"] = text
        choice.update(token_ids=list(token_ids), logprobs=None, finish_reason=finish_reason)
        extra = {"usage": None} if include_usage else {}
        return self._envelope(True, [choice], **extra)

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return self._envelope(True, [], usage=usage(out))
