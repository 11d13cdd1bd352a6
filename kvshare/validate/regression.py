"""Service regression: greedy answers with the pool on (restored on another replica) equal
the answers with the pool off, token for token.

Through the router: the pool is switched off on every replica and each prompt is answered
on replica 1 (GPU-local caches reset first); then the pool is switched on and cleared,
each prompt is first sent to replica 0 (which stores its chunks), the GPU-local caches
are reset, and the same prompt is answered on replica 1, which can only reuse the pool.
Multi-turn chats alternate replicas turn by turn and reuse the pool-off answers as their
history, so both runs send identical prompts. The report names the first differing token.

A model without a tokenizer or chat template (a `shape:NAME` preset) takes token-id
prompts only. Its prompts are seeded random ids below its vocab (past a 512-token sliding
window and several 256-token pool chunks), and its chats are token-id histories: each turn
sends the previous turn's prompt, the pool-off answer's ids and a new question's ids.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import httpx

from kvshare.serve.auth import AccessKeys
from kvshare.serve.replica_admin import pool_switch, pool_switch_calls
from kvshare.validate.result import CheckResult

PIN = "x-kvshare-replica"
_WORDS = (
    "harbor lamp winter storm ledger river orchard copper lantern meadow signal "
    "engine valley market bridge archive garden compass thunder island"
).split()
# Token-id prompts: lengths in tokens, and the ids they draw from (low ids are often special).
TOKEN_LENGTHS = (20, 300, 700, 1500, 3000)
CHAT_TURN_TOKENS = (600, 80, 150)
FIRST_TOKEN_ID = 10
TOKEN_ID_CEILING = 1000  # ids stay below this, and below the vocab when it is smaller

Turn = str | tuple[int, ...]  # a text turn, or a token-id turn


@dataclass(frozen=True)
class Prompt:
    name: str
    turns: tuple[Turn, ...]  # one for a completion; several user turns for a chat

    @property
    def chat(self) -> bool:
        return len(self.turns) > 1


@dataclass(frozen=True)
class Answer:
    ids: list[int]
    text: str
    pool_hit_tokens: int


def default_prompts(seed: int = 0) -> list[Prompt]:
    """Mixed lengths (words ~ 1.3 tokens), incl. ones past several pool chunks, and chats."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words))

    prompts = [Prompt(f"completion-{n}w", (text(n),)) for n in (12, 150, 420, 900, 1500)]
    prompts += [
        Prompt(f"chat-{i}", tuple(text(n) + " Summarize that." for n in (300, 60, 120)))
        for i in range(2)
    ]
    return prompts


def default_token_prompts(
    seed: int = 0,
    vocab_size: int | None = None,
    lengths: tuple[int, ...] = TOKEN_LENGTHS,
    chat_turns: tuple[int, ...] = CHAT_TURN_TOKENS,
    chats: int = 2,
) -> list[Prompt]:
    """Token-id prompts for a model without a tokenizer: seeded ids, the same lengths and
    chats as the text set has (a chat turn here is a question's ids)."""
    rng = random.Random(seed)
    high = min(vocab_size or TOKEN_ID_CEILING, TOKEN_ID_CEILING)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_TOKEN_ID, high) for _ in range(n))

    prompts = [Prompt(f"tokens-{n}", (ids(n),)) for n in lengths]
    prompts += [Prompt(f"token-chat-{i}", tuple(ids(n) for n in chat_turns)) for i in range(chats)]
    return prompts


class _Service:
    """The router, as the check drives it: admin calls and pinned greedy requests."""

    def __init__(self, url: str, model: str = "", timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        keys = AccessKeys.from_environment()  # KVSHARE_API_KEY and KVSHARE_ADMIN_KEY
        self.http = httpx.Client(timeout=timeout, headers=keys.authorization(False))
        self.admin = keys.authorization(True)

    def admin_all(self, path: str, body: dict | None = None) -> None:
        self.http.post(
            f"{self.url}/admin/all/{path}", json=body or {}, headers=self.admin
        ).raise_for_status()

    def pool_switches(self) -> list[bool | None]:
        answer = self.http.get(f"{self.url}/admin/all/stats", headers=self.admin)
        answer.raise_for_status()
        return [pool_switch(replica["body"]) for replica in answer.json()["replicas"]]

    def set_pool_switches(self, switches: list[bool | None], urls: list[str]) -> None:
        """Each replica's switch as pool_switches read it; `urls` for differing ones."""
        for index, enabled in pool_switch_calls(switches):
            url = f"{self.url}/admin/all" if index is None else urls[index].rstrip("/") + "/admin"
            self.http.post(
                f"{url}/kv_pool", json={"enabled": enabled}, headers=self.admin
            ).raise_for_status()

    def clear_pool(self, attempts: int = 10) -> None:
        """Clear the shared pool; a replica whose pool client is reconnecting answers 503."""
        for _ in range(attempts - 1):
            if (
                self.http.post(f"{self.url}/admin/all/clear_pool", headers=self.admin).status_code
                < 500
            ):
                return
            time.sleep(1.0)
        self.admin_all("clear_pool")

    def model_entry(self) -> dict:
        """The served model's /v1/models entry; names the model when none was given."""
        entry = self.http.get(f"{self.url}/v1/models").json()["data"][0]
        self.model = self.model or entry["id"]
        return entry

    def generate(self, path: str, request: dict, replica: int, max_tokens: int) -> Answer:
        body = {
            "model": self.model,
            **request,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = self.http.post(f"{self.url}{path}", json=body, headers={PIN: str(replica)})
        reply.raise_for_status()
        return _answer(reply.json())


def _answer(reply: dict) -> Answer:
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    usage = reply.get("usage") or {}
    hits = (usage.get("kv") or {}).get("pool_hit_tokens")
    if hits is None:
        # A vLLM replica counts every cached prompt token (`--enable-prompt-tokens-details`);
        # its GPU prefix cache was reset just before, so they all came from the pool.
        hits = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(list(choice.get("token_ids") or []), text, hits)


# ------------------------------------------------------------ what the model accepts


def prompts_for(entry: dict, max_tokens: int) -> list[Prompt]:
    """The default set the served model accepts (its /v1/models entry says): text with a
    tokenizer and chat template, else token ids below its vocab that fit its context."""
    if entry.get("tokenizer") and entry.get("chat_template"):
        return default_prompts()
    prompts = default_token_prompts(vocab_size=entry.get("vocab_size"))
    limit = entry.get("max_model_len") or 1 << 62
    return [p for p in prompts if sum(map(len, p.turns)) + max_tokens * len(p.turns) < limit]


# ------------------------------------------------------------ the check


def run_regression_check(
    url: str, *, model: str = "", prompts: list[Prompt] | None = None, max_tokens: int = 24
) -> CheckResult:
    result = CheckResult("regression")
    service = _Service(url, model)
    replicas = service.http.get(f"{service.url}/admin/replicas", headers=service.admin).json()
    if len(replicas) < 2:
        result.skipped = "needs a router with at least two replicas"
        return result
    entry = service.model_entry()
    prompts = prompts or prompts_for(entry, max_tokens)
    # The check switches the pool off and on; it leaves each replica's switch as it found it.
    switches = service.pool_switches()
    try:
        _compare(service, entry, prompts, max_tokens, result)
    finally:
        try:
            service.set_pool_switches(switches, [r["url"] for r in replicas])
        except httpx.HTTPError as exc:
            result.fail(
                f"could not set the pool switches back to {switches} (per replica): {exc}; "
                "set them with POST /admin/all/kv_pool"
            )
    return result


def _compare(
    service: _Service, entry: dict, prompts: list[Prompt], max_tokens: int, result: CheckResult
) -> None:
    """Every prompt's answers with the pool on against its answers with the pool off."""
    service.admin_all("kv_pool", {"enabled": False})
    reference = {p.name: _run(service, p, max_tokens, None) for p in prompts}
    service.admin_all("kv_pool", {"enabled": True})
    service.clear_pool()
    compared = equal = pool_hits = 0
    for prompt in prompts:
        answers = _run(service, prompt, max_tokens, reference[prompt.name])
        for turn, (answer, ref) in enumerate(zip(answers, reference[prompt.name])):
            difference = _difference(answer, ref)
            if difference is not None:
                result.fail(f"{prompt.name} turn {turn}: {difference}")
            compared, equal = compared + 1, equal + (difference is None)
            pool_hits += answer.pool_hit_tokens
    result.expect(
        pool_hits > 0, "no prompt was restored from the pool: the check compared nothing shared"
    )
    if equal < compared and entry.get("dtype") not in (None, "float32"):
        # Seen on the H200 and the CPU: bf16 answers restored byte-exactly still part from
        # recomputed ones, because the suffix is computed in a different batch shape.
        result.fail(
            f"the replicas run {entry['dtype']}: a near-tied greedy token can flip with the "
            "batch shape even when the restored bytes are exact (see the bytes check); "
            "rerun this check with replicas started with --dtype float32"
        )
    token_prompts = sum(not isinstance(p.turns[0], str) for p in prompts)
    result.counts = {
        "prompts": len(prompts),
        "token_id_prompts": token_prompts,
        "answers_compared": compared,
        "answers_equal": equal,
        "pool_hit_tokens": pool_hits,
    }


def _run(
    service: _Service, prompt: Prompt, max_tokens: int, reference: list[Answer] | None
) -> list[Answer]:
    """Answers of each turn. With a reference (the pool on), the first turn is prefilled on
    the other replica first; both runs continue from the reference (pool-off) answers."""
    answers: list[Answer] = []
    conversation = _Conversation()
    for turn, question in enumerate(prompt.turns):
        target = turn % 2 if prompt.chat else 1
        path, request = conversation.ask(question, prompt.chat)
        service.admin_all("reset_prefix_cache")
        if reference is not None and turn == 0:
            service.generate(path, request, 1 - target, 1)
            service.admin_all("reset_prefix_cache")
        answers.append(service.generate(path, request, target, max_tokens))
        conversation.answered((reference or answers)[turn])
    return answers


class _Conversation:
    """The request of each turn: the whole history so far plus the new question."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.ids: list[int] = []

    def ask(self, question: Turn, chat: bool) -> tuple[str, dict]:
        if isinstance(question, str) and not chat:
            return "/v1/completions", {"prompt": question}
        if isinstance(question, str):
            self.messages.append({"role": "user", "content": question})
            return "/v1/chat/completions", {"messages": list(self.messages)}
        # Token ids: every answer runs to max_tokens, so an early EOS hides no difference.
        self.ids += question
        return "/v1/completions", {"prompt": list(self.ids), "ignore_eos": True}

    def answered(self, answer: Answer) -> None:
        if self.messages:
            self.messages.append({"role": "assistant", "content": answer.text})
        else:
            self.ids += answer.ids


def _difference(answer: Answer, reference: Answer) -> str | None:
    """None when equal, else where the answers part."""
    if not (answer.ids or reference.ids):
        same = answer.text == reference.text
        return None if same else f"texts differ: {answer.text!r} vs {reference.text!r}"
    at = _first_difference(answer.ids, reference.ids)
    if at is None:
        return None
    return (
        f"first differing token at {at}: {answer.ids[at : at + 3]} vs {reference.ids[at : at + 3]}"
    )


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
