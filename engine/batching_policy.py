"""Fair batching: how many prefill tokens a step may carry next to its decodes (policy ``fair``).

Each step's decodes get their one token each, always. What is left of the step goes to prefill, sized
so that a step carrying decodes stays within an inter-token-latency target:

- A cost model ``seconds = fixed + per_token * tokens`` is fitted online to measured step times
  (least squares with exponential forgetting, so it follows the load and the machine). While the steps
  seen so far are too alike in size to separate the two terms, all the time is charged per token
  (right at the size seen, pessimistic for bigger steps); the next step of another size separates them.
- The step's capacity is the token count the model predicts fits in the target; prefill gets the
  capacity minus the decodes, but never less than a guaranteed share of the step's tokens (and a
  minimum chunk), so long prompts progress however many sequences decode.
- A step with no decodes runs the whole ``max_num_batched_tokens``: nobody waits for a next token.

Which prompts share that allowance is the scheduler's part: new prompts shortest first, then running
ones by fewest tokens left to compute, so one long prompt does not hold back the short ones queued
behind it, and of two long ones the nearer to its first token finishes first (rather than both late).
"""

from __future__ import annotations

# The fit separates fixed from per-token cost once the remembered steps differ by this many tokens
# (standard deviation); below it the slope would be mostly timing noise.
MIN_SPREAD_TOKENS = 4.0


class FairBatching:
    """Sizes each step's prefill allowance from the step times observed so far."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        itl_target_s: float,
        *,
        min_prefill_share: float = 0.25,
        min_prefill_tokens: int = 16,
        memory: float = 0.95,
    ) -> None:
        if itl_target_s <= 0:
            raise ValueError(f"the ITL target must be positive, got {itl_target_s} s")
        if not 0 < min_prefill_share < 1:
            raise ValueError(f"min_prefill_share must be in (0, 1), got {min_prefill_share}")
        if not 0 < memory < 1:
            raise ValueError(f"memory must be in (0, 1), got {memory}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.itl_target_s = itl_target_s
        self.min_prefill_share = min_prefill_share
        self.min_prefill_tokens = min_prefill_tokens
        self.memory = memory
        # Exponentially weighted sums over observed steps: weight, tokens, tokens², seconds, tokens·s.
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one step's size (all scheduled tokens) and its measured duration."""
        if num_tokens <= 0 or seconds < 0:
            return
        m = self.memory
        self._w = self._w * m + 1.0
        self._x = self._x * m + num_tokens
        self._xx = self._xx * m + num_tokens * num_tokens
        self._y = self._y * m + seconds
        self._xy = self._xy * m + num_tokens * seconds

    def cost_model(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a step, or None before any step was observed."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var >= MIN_SPREAD_TOKENS**2:
            per_token = (self._xy / self._w - mx * my) / var
            fixed = my - per_token * mx
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        return 0.0, my / mx  # conservative: a step costs as much per token as the average one

    @property
    def capacity(self) -> int:
        """Tokens a step may carry and (by the model) stay within the ITL target."""
        model = self.cost_model()
        if model is None:
            return self.max_num_batched_tokens
        fixed, per_token = model
        tokens = (self.itl_target_s - fixed) / per_token if per_token > 0 else float("inf")
        return int(min(max(tokens + 1e-6, 0), self.max_num_batched_tokens))  # 1e-6: float fuzz

    def prefill_budget(self, num_decode_tokens: int) -> int:
        """Prefill tokens a step may add to its ``num_decode_tokens`` decodes."""
        room = self.max_num_batched_tokens - num_decode_tokens
        if num_decode_tokens == 0:
            return room
        share = self.min_prefill_share
        guaranteed = max(self.min_prefill_tokens, int(num_decode_tokens * share / (1 - share)))
        return max(0, min(room, max(self.capacity - num_decode_tokens, guaranteed)))
