"""Service regression: greedy answers with the pool on (restored on another replica) equal
the answers with the pool off, token for token.

Through the router: the pool is switched off on every replica and each prompt is answered
on replica 1 (GPU-local caches reset first); then the pool is switched on and cleared,
each prompt is first sent to replica 0 (which stores its chunks), the GPU-local caches
are reset, and the same prompt is answered on replica 1, which can only reuse the pool.
Multi-turn chats alternate replicas turn by turn and reuse the pool-off answers as their
history, so both runs send identical prompts. The report names the first differing token.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx

from kvshare.validate.result import CheckResult

PIN = "x-kvshare-replica"
_WORDS = ("harbor lamp winter storm ledger river orchard copper lantern meadow signal "
          "engine valley market bridge archive garden compass thunder island").split()


@dataclass(frozen=True)
class Prompt:
    name: str
    turns: tuple[str, ...]  # one for a completion; several user turns for a chat


def default_prompts(seed: int = 0) -> list[Prompt]:
    """Mixed lengths (words ~ 1.3 tokens), incl. ones past several pool chunks, and chats."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words))

    prompts = [Prompt(f"completion-{n}w", (text(n),)) for n in (12, 150, 420, 900, 1500)]
    prompts += [Prompt(f"chat-{i}", tuple(text(n) + " Summarize that." for n in (300, 60, 120)))
                for i in range(2)]
    return prompts


class _Service:
    def __init__(self, url: str, model: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.http = httpx.Client(timeout=timeout)

    def admin_all(self, path: str, body: dict | None = None) -> None:
        self.http.post(f"{self.url}/admin/all/{path}", json=body or {}).raise_for_status()

    def clear_pool(self, attempts: int = 10) -> None:
        """Clear the shared pool; a replica whose pool client is reconnecting answers 503."""
        for _ in range(attempts - 1):
            if self.http.post(f"{self.url}/admin/all/clear_pool").status_code < 500:
                return
            time.sleep(1.0)
        self.admin_all("clear_pool")

    def complete(self, prompt: str, replica: int, max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        return self._post("/v1/completions", body, replica)

    def chat(self, messages: list[dict], replica: int, max_tokens: int) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        return self._post("/v1/chat/completions", body, replica)

    def _post(self, path: str, body: dict, replica: int) -> dict:
        reply = self.http.post(f"{self.url}{path}", json=body, headers={PIN: str(replica)})
        reply.raise_for_status()
        return reply.json()


def _answer(reply: dict) -> tuple[list[int], str]:
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return list(choice.get("token_ids") or []), text


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_regression_check(url: str, *, model: str = "", prompts: list[Prompt] | None = None,
                         max_tokens: int = 24) -> CheckResult:
    result = CheckResult("regression")
    service = _Service(url, model or _served_model(url))
    prompts = prompts or default_prompts()
    replicas = service.http.get(f"{service.url}/admin/replicas").json()
    if len(replicas) < 2:
        result.skipped = "needs a router with at least two replicas"
        return result
    service.admin_all("kv_pool", {"enabled": False})
    reference: dict[str, list[tuple[list[int], str, int]]] = {}
    for prompt in prompts:
        reference[prompt.name] = _run(service, prompt, max_tokens, None, pool_on=False)
    service.admin_all("kv_pool", {"enabled": True})
    service.clear_pool()
    compared = equal = pool_hits = 0
    for prompt in prompts:
        answers = _run(service, prompt, max_tokens, reference[prompt.name], pool_on=True)
        for turn, ((ids, text, hit), (ref_ids, ref_text, _)) in enumerate(
                zip(answers, reference[prompt.name])):
            compared += 1
            pool_hits += hit
            same = ids == ref_ids if ids or ref_ids else text == ref_text
            equal += same
            if not same:
                at = _first_difference(ids, ref_ids)
                result.fail(f"{prompt.name} turn {turn}: first differing token at {at}: "
                            f"{ids[at:at + 3] if at is not None else ids} vs "
                            f"{ref_ids[at:at + 3] if at is not None else ref_ids}")
    result.expect(pool_hits > 0, "no prompt was restored from the pool: the check compared nothing shared")
    result.counts = {"prompts": len(prompts), "answers_compared": compared, "answers_equal": equal,
                     "pool_hit_tokens": pool_hits}
    return result


def _run(service: _Service, prompt: Prompt, max_tokens: int,
         history: list[tuple[list[int], str, int]] | None, pool_on: bool) -> list[tuple[list[int], str, int]]:
    """Answers of each turn; with the pool on, each turn is prefilled on the other replica first."""
    answers = []
    messages: list[dict] = []
    for turn, question in enumerate(prompt.turns):
        target = 1 if len(prompt.turns) == 1 else turn % 2
        service.admin_all("reset_prefix_cache")
        if len(prompt.turns) == 1:
            if pool_on:
                service.complete(question, 1 - target, 1)
                service.admin_all("reset_prefix_cache")
            reply = service.complete(question, target, max_tokens)
        else:
            messages.append({"role": "user", "content": question})
            if pool_on and turn == 0:
                service.chat(messages, 1 - target, 1)
                service.admin_all("reset_prefix_cache")
            reply = service.chat(messages, target, max_tokens)
        ids, text = _answer(reply)
        hit = reply.get("usage", {}).get("kv", {}).get("pool_hit_tokens", 0)
        answers.append((ids, text, hit))
        if len(prompt.turns) > 1:
            # Both runs continue from the pool-off answer: identical prompts turn by turn.
            messages.append({"role": "assistant", "content": (history or answers)[turn][1]})
    return answers


def _served_model(url: str) -> str:
    models = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=30).json()["data"]
    return models[0]["id"]
