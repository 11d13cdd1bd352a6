"""Per-request sampling parameters, validated at construction (bad values are user errors)."""

from __future__ import annotations

from dataclasses import dataclass

# The sampler divides float32 logits by the temperature: below this a positive temperature
# overflows them to inf (vLLM treats temperatures under 1e-5 as greedy; we refuse them).
MIN_TEMPERATURE = 1e-5
# The sampler compares top_p with float32 probabilities: a smaller top_p is zero or subnormal
# there (float32's smallest normal number).
MIN_TOP_P = 1.1754943508222875e-38
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. `seed` makes sampling of
    this request reproducible regardless of what else is batched with it. `stop` strings
    end the output before the string (unless `include_stop_str_in_output`). `logprobs`
    reports each generated token's log-probability under the model (the raw distribution:
    before temperature, top-k and top-p), and `top_logprobs` that many of the most likely
    tokens of that same distribution at each step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: bool = False  # report the log-probability of each generated token
    top_logprobs: int = 0  # with logprobs: also this many of the most likely tokens per step

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(
                f"top_p must be at least {MIN_TOP_P:.3g} (float32's smallest normal "
                f"number), got {self.top_p}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
