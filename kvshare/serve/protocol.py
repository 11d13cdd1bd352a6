"""The OpenAI request and response shapes of /v1/completions and /v1/chat/completions.

Parsing turns a JSON body into a `GenerateRequest` or raises `APIError` (a 4xx naming the
field). Extensions beyond OpenAI: `top_k`, `ignore_eos`, `cache_salt` (vLLM's: a
non-empty string; only requests with the same salt share prefix cache), `token_ids` in
every choice (the generated ids: a model without a tokenizer streams no text), and
`usage.kv`.

Log-probabilities are those of the raw model distribution (before temperature, top-k and
top-p), as vLLM reports them by default; a token of a model without a tokenizer is named
"token_id:<id>". With `n` > 1 each choice is its own sequence; choice i > 0 of a seeded
request draws with a seed derived from (seed, i), and usage counts the prompt once.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvshare.engine.block_manager import check_cache_salt
from kvshare.engine.llm_engine import RequestOutput, TopLogprobs, prompt_array
from kvshare.engine.sampling_params import (
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingParams,
)
from kvshare.models.tokenizer import Tokenizer
from kvshare.serve.errors import APIError, bad_request
from kvshare.serve.prompts import PromptError, request_prompt_ids

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_N = 16
# JSON has no -inf: a token the model rules out is reported with this log-probability (vLLM's).
MIN_LOGPROB = -9999.0
# Fields whose OpenAI meaning this server does not implement, with the values that ask for
# nothing: any other value is refused rather than silently ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "best_of": (None, 1),
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
    prompt_token_ids: np.ndarray  # int32, every id in the vocabulary: converted once
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # None: not asked; else how many top tokens per step
    cache_salt: str | None = None

    def choice_params(self, index: int) -> SamplingParams:
        """Choice `index`'s sampling: a seeded request's other choices get derived seeds."""
        if index == 0 or self.params.seed is None:
            return self.params
        digest = hashlib.blake2b(f"{self.params.seed}:{index}".encode(), digest_size=8).digest()
        return replace(self.params, seed=int.from_bytes(digest, "little") & MAX_SEED)


def _present(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    return value


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
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
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise bad_request(
            f"stop must be a non-empty string or a list of at most "
            f"{MAX_STOP_STRINGS} non-empty strings",
            "stop",
        )
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
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {model.name!r}",
            param="model",
            code="model_not_found",
        )


def _prompt_ids(body: dict[str, Any], chat: bool, model: ModelInfo) -> np.ndarray:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        ids = request_prompt_ids(model.tokenizer, path, body)
    except PromptError as exc:
        raise bad_request(str(exc), exc.param) from None
    array = prompt_array(ids, model.vocab_size)
    if array is None:
        raise bad_request(f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
    param = "messages" if chat else "prompt"
    if len(array) >= model.max_model_len:
        raise bad_request(
            f"the prompt has {len(array)} tokens; this model's context is "
            f"{model.max_model_len} tokens, so at most {model.max_model_len - 1} "
            f"fit with one generated token",
            param,
        )
    return array


def _max_tokens(body: dict[str, Any], chat: bool, prompt_len: int, model: ModelInfo) -> int:
    name = "max_completion_tokens" if _present(body, "max_completion_tokens") else "max_tokens"
    value = _int(body, name)
    room = model.max_model_len - prompt_len
    if value is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
        return min(16, room) if not chat else room
    if value < 1:
        raise bad_request(f"{name} must be >= 1, got {value}", name)
    if value > room:
        raise bad_request(
            f"{name} is {value}, but the prompt has {prompt_len} tokens and this "
            f"model's context is {model.max_model_len}: at most {room} can be "
            f"generated",
            name,
        )
    return value


def _temperature(body: dict[str, Any]) -> float:
    value = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0.0 < value < MIN_TEMPERATURE:
        raise bad_request(
            f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}: a smaller "
            f"one cannot be sampled in float32, got {value}",
            "temperature",
        )
    return value


def _top_p(body: dict[str, Any]) -> float:
    value = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    if value < MIN_TOP_P:
        raise bad_request(
            f"top_p must be at least {MIN_TOP_P:.3g}: a smaller one underflows in "
            f"float32, got {value}",
            "top_p",
        )
    return value


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top tokens to report per step; None when log-probabilities are not asked.
    Completions: `logprobs` is that count. Chat: `logprobs: true`, `top_logprobs` the count."""
    if not chat:
        if body.get("logprobs") is False:
            return None
        count = _int(body, "logprobs")
        name = "logprobs"
    else:
        if not _bool(body, "logprobs", False):
            if _int(body, "top_logprobs"):
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        count = _int(body, "top_logprobs") or 0
        name = "top_logprobs"
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {count}", name)
    return count


def _n(body: dict[str, Any]) -> int:
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {n}", "n")
    return n or 1


def parse_generate(body: dict[str, Any], chat: bool, model: ModelInfo) -> GenerateRequest:
    check_model(body, model)
    for name, harmless in UNSUPPORTED_FIELDS.items():
        if body.get(name) not in harmless:
            raise bad_request(f"{name} is not supported by this server", name)
    n = _n(body)
    logprobs = _logprobs(body, chat)
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
        temperature=_temperature(body),
        top_p=_top_p(body),
        top_k=top_k or 0,
        seed=seed,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = stream and _bool(options or {}, "include_usage", False)
    return GenerateRequest(chat, ids, params, stream, include_usage, n, logprobs, cache_salt)


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """One request's usage: the prompt counted once, the completions of every choice; the
    prompt's KV sources are those of the first choice."""
    first = outs[0]
    prompt, completion = len(first.prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
        "kv": {
            "gpu_hit_tokens": first.gpu_hit_tokens,
            "pool_hit_tokens": first.pool_hit_tokens,
            "pool_remote_hit_tokens": first.pool_remote_hit_tokens,
            "computed_tokens": first.computed_tokens,
        },
    }


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


@dataclass(frozen=True)
class ResponseFormat:
    """Builds the JSON objects of one request's answer (whole or streamed)."""

    chat: bool
    request_id: str
    model: str
    created: int
    tokenizer: Tokenizer | None = None
    logprobs: int | None = None  # as in GenerateRequest

    def _envelope(self, chunk: bool, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs_of(
        self, out: RequestOutput, start: int, text_offset: int
    ) -> dict[str, Any] | None:
        """Log-probabilities of out.token_ids[start:]; `text_offset` is where their text starts
        (completions only)."""
        if self.logprobs is None:
            return None
        ids = out.token_ids[start:]
        values = [_logprob(v) for v in out.logprobs[start:]]
        tops: list[TopLogprobs] = list(out.top_logprobs[start:])
        if self.chat:
            return {
                "content": [
                    {
                        **self._chat_token(token, value),
                        "top_logprobs": [self._chat_token(t, v) for t, v in top],
                    }
                    for token, value, top in zip(ids, values, tops)
                ]
            }
        texts = [self.token_text(t) for t in ids]
        offsets = [text_offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {
            "tokens": texts,
            "token_logprobs": values,
            "text_offset": offsets,
            "top_logprobs": [{self.token_text(t): _logprob(v) for t, v in top} for top in tops],
        }

    def _chat_token(self, token_id: int, value: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {
            "token": text,
            "logprob": _logprob(value),
            "bytes": list(text.encode("utf-8", errors="replace")),
        }

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, out in enumerate(outs):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choice.update(
                token_ids=list(out.token_ids),
                logprobs=self._logprobs_of(out, 0, 0),
                finish_reason=out.finish_reason,
            )
            choices.append(choice)
        return self._envelope(False, choices, usage=usage(outs))

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "token_ids": [],
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(True, [choice], **({"usage": None} if include_usage else {}))

    def chunk(
        self, index: int, out: RequestOutput, text_offset: int, include_usage: bool
    ) -> dict[str, Any]:
        """The delta of `out` as choice `index`; `text_offset`: characters streamed before it."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": out.new_text}
        else:
            choice["text"] = out.new_text
        start = len(out.token_ids) - len(out.new_token_ids)
        choice.update(
            token_ids=list(out.new_token_ids),
            logprobs=self._logprobs_of(out, start, text_offset) if out.new_token_ids else None,
            finish_reason=out.finish_reason,
        )
        extra = {"usage": None} if include_usage else {}
        return self._envelope(True, [choice], **extra)

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        return self._envelope(True, [], usage=usage(outs))
