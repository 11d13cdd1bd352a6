"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from kvshare.engine.block_manager import check_cache_salt
from kvshare.engine.config import EngineConfig
from kvshare.engine.connector import KVConnector
from kvshare.engine.llm_engine import LLMEngine, RequestOutput
from kvshare.engine.sampling_params import SamplingParams
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.transfer import LayerGroups
from kvshare.models.loader import LoadedModel, load_model
from kvshare.spec import DEFAULT_CHUNK_TOKENS

_log = logging.getLogger(__name__)


class KVPoolUnreachable(Exception):
    """A required pool (`require_kv_pool=True`) could not be reached at start."""


class LLM:
    """Load a model and generate. `kv_pool="unix:/path/to.sock"` attaches the shared pool.

    A pool that cannot be reached at start is a logged warning and the engine runs without
    it (reconnecting on later requests); with `require_kv_pool=True` it is KVPoolUnreachable
    instead. A pool lost later is recomputed around, counted, never an error.

    `kv_pool_faults` breaks the pool connector on purpose (checks and tests). Extra keyword
    arguments are EngineConfig fields (block_size, max_num_batched_tokens, kv_cache_memory,
    kv_cache_dtype="fp8", ...). `weights_seed` picks the random weights of a shape:NAME model.
    The constructor's `cache_salt` salts every pool key of this LLM (a deployment-wide
    namespace); `generate(..., cache_salt=...)` isolates one call's requests (a tenant).
    """

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        kv_pool: str | KVConnector | None = None,
        require_kv_pool: bool = False,
        weights_seed: int = 0,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        cache_salt: str = "",
        kv_pool_faults: FaultInjection | None = None,
        **engine_options: object,
    ) -> None:
        self.config = EngineConfig(device=device, dtype=dtype, **engine_options)  # type: ignore[arg-type]
        self.loaded: LoadedModel = load_model(
            model, device=device, dtype=self.config.resolved_dtype, seed=weights_seed
        )
        pool = None
        if isinstance(kv_pool, str):
            pool = PoolConnector.for_model(
                kv_pool,
                self.loaded,
                chunk_tokens=chunk_tokens,
                cache_salt=cache_salt,
                faults=kv_pool_faults,
                kv_cache_dtype=self.config.kv_cache_dtype,
                layer_groups=LayerGroups.at_most(self.config.resolved_pool_load_layer_groups),
            )
        self.engine = LLMEngine(self.loaded, self.config, pool or kv_pool)  # binds the connector
        if pool is not None:
            self._check_pool_reached(pool, str(kv_pool), require_kv_pool)
        self._ids = itertools.count()

    def _check_pool_reached(self, connector: PoolConnector, address: str, required: bool) -> None:
        if (reason := connector.bind_failure) is None:
            return
        if required:
            connector.close()
            raise KVPoolUnreachable(
                f"kv pool {address} unreachable ({reason}) and a pool is required"
            )
        _log.warning(
            "kv pool %s unreachable (%s): running without the pool until it answers; "
            "pass --require-kv-pool (LLM(require_kv_pool=True)) to make this an error",
            address,
            reason,
        )

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.loaded.tokenizer is None:
                raise ValueError(f"model {self.loaded.name!r} has no tokenizer: pass token ids")
            return self.loaded.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def chat(
        self,
        messages: list[dict[str, str]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        if self.loaded.tokenizer is None:
            raise ValueError(f"model {self.loaded.name!r} has no tokenizer or chat template")
        return self.generate(
            [self.loaded.tokenizer.encode_chat(messages)], params, cache_salt=cache_salt
        )[0]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.

        `cache_salt` (a non-empty string, as in vLLM) isolates these prompts' prefix cache,
        GPU blocks and pool pages alike: they reuse only KV computed under the same salt.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        cache_salt = check_cache_salt(cache_salt)  # before any request is queued
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, per_prompt):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, self.encode(prompt), p, cache_salt)
            ids.append(request_id)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        # As a server does when it goes idle: the prompts' chunks are in the pool (for every
        # replica) when this returns.
        self.engine.commit_pool_stores()
        return [done[i] for i in ids]
