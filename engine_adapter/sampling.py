"""Next-token choice from one row of logits: greedy at temperature 0, else seeded sampling.

Sampling runs on the CPU with the request's own ``torch.Generator``, so a request's tokens depend
only on its seed and its logits, never on what else runs in the same step or on the device.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """logits [vocab] -> a token id."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu()
    # Shifted so the largest is 0 before dividing: at a tiny temperature the rest go to -inf and the
    # choice to the argmax, where dividing first overflowed to inf and softmax gave NaN.
    probs = ((logits - logits.max()) / temperature).softmax(dim=-1)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))
