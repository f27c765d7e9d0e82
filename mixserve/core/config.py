"""The scheduler's configuration: token budget, concurrency cap and KV cache geometry."""

from __future__ import annotations

from dataclasses import dataclass, fields

# limits where 0 means "no limit"
ZERO_MEANS_NO_LIMIT = frozenset({"max_partial_prefills", "long_prefill_threshold",
                                 "max_long_partial_prefills"})


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step and of the KV cache; every int field must be a positive integer."""

    max_batch_tokens: int
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int = 1024
    # Prompts part-way through their prefill at once, and of those the prompts longer than
    # long_prefill_threshold tokens (core/prefill_limits.py); 0 = no limit, the seed's behaviour.
    max_partial_prefills: int = 0
    long_prefill_threshold: int = 0
    max_long_partial_prefills: int = 0
    # Share the K/V of full blocks between requests with the same prefix (core/prefix_cache.py). Off here
    # so the core's contract is unchanged; the engine turns it on ([engine] enable_prefix_caching).
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"SchedulerConfig.{f.name} must be True or False, got {value!r}")
                continue
            # bool is an int subclass; True as a budget is a mistake, not a 1
            if f.name in ZERO_MEANS_NO_LIMIT:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"SchedulerConfig.{f.name} must be an integer >= 0, got {value!r}")
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SchedulerConfig.{f.name} must be a positive integer, got {value!r}")

    @property
    def num_slots(self) -> int:
        """Token positions the whole KV cache can hold."""
        return self.num_blocks * self.block_size
