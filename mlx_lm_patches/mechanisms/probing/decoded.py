"""What a decoding gave, compared with the reference, and the deterministic prompts.

The reference is single-sequence greedy decoding with a cold prefill. "Exact" means the same
greedy tokens and log-probabilities within :data:`LOGPROB_TOLERANCE` (CPU, float32).
"""

from dataclasses import dataclass
from typing import List, Optional

LOGPROB_TOLERANCE = 1e-4


@dataclass
class Decoded:
    tokens: List[int]
    logprobs: list  # mx.array rows, one per generated token

    def compare(self, other: "Decoded") -> Optional[str]:
        """``None`` if ``other`` is exact against this reference, else what differs."""
        import mlx.core as mx

        if self.tokens != other.tokens:
            return f"tokens differ: reference {self.tokens}, got {other.tokens}"
        worst = 0.0
        for ref, got in zip(self.logprobs, other.logprobs):
            worst = max(worst, mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item())
        if worst > LOGPROB_TOLERANCE:
            return f"log-probabilities differ by {worst:.3g} (> {LOGPROB_TOLERANCE})"
        return None


def prompt_tokens(n=12, vocab=256, seed=0) -> List[int]:
    """A deterministic prompt of ``n`` token ids below ``vocab``."""
    return [(seed * 7919 + i * 37 + 11) % (vocab - 4) + 1 for i in range(n)]
