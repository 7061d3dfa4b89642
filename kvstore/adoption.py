"""The blocks a persistent tier already holds at start-up, in the order a store adopts them.

Parents come before their children, so each policy learns the chains as they were. Blocks that
are their own ancestors (written before ``TieredStore.put`` refused loops) are removed from the
tier, not adopted: none of them would ever be a leaf, so none could ever be evicted.
"""

from __future__ import annotations

import logging
from typing import Iterator

from kvstore.tiers.base import BlockMeta, Tier

log = logging.getLogger("kvstore.store")


def parents_first(tier: Tier) -> Iterator[tuple[bytes, BlockMeta]]:
    """``(key, meta)`` of every block ``tier`` holds, each after its parent where the tier holds
    that too; removes the blocks of any loop first."""
    metas = dict(tier.items())
    done: set[bytes] = set()
    for key in metas:
        chain = []  # from key up towards its root, as far as not yet done
        while key in metas and key not in done:
            chain.append(key)
            done.add(key)
            key = metas[key].parent
        if key in chain:  # the walk came back into its own chain: chain[at:] is a loop
            at = chain.index(key)
            for k in chain[at:]:
                tier.remove(k)
            log.warning("%s tier: removed %d blocks that were their own ancestors", tier.name, len(chain) - at)
            chain = chain[:at]
        for k in reversed(chain):
            yield k, metas[k]
