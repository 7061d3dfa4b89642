"""A workload both prefix-aware policies are tested on: a document re-read among one-off prompts."""

from kvstore.trace import TraceRequest


def document_among_one_offs(requests: int, document_blocks: int, one_off_blocks: int) -> list[TraceRequest]:
    """Every 4th request re-reads the same ``document_blocks``-block document (block ids 0..);
    the others are one-off prompts of ``one_off_blocks`` fresh blocks."""
    trace, fresh = [], 1000
    for i in range(requests):
        if i % 4 == 0:
            ids = tuple(range(document_blocks))
        else:
            ids = tuple(range(fresh, fresh + one_off_blocks))
            fresh += one_off_blocks
        trace.append(TraceRequest(float(i), len(ids) * 512, 0, ids))
    return trace
