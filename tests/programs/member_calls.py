"""One call of the growth programs (elastic_spares.py, elastic_rejoin.py):
an all-reduce (direct, op avg) of (member + 1 + call / 1000), each block of
its result checked against the mean over the members its record names."""

import numpy as np


def averaged_call(lc, me: int, call: int, x: np.ndarray, model: np.ndarray, state: dict):
    """The call; state["call"] becomes `call`, state["wrong"] counts the
    blocks that are not the mean over their record's members,
    state["partial"] lists the calls that lost blocks here, and the result
    moves `model` (not where this rank answered the call alone)."""
    state["call"] = call
    state["wrong"] += _checked(lc, me, call, x, model, state)


def _checked(lc, me: int, call: int, x: np.ndarray, model: np.ndarray, state: dict) -> int:
    x[:] = me + 1 + call / 1000
    out = np.empty_like(x)
    members = lc.members            # (the record numbers the ranks of the call's communicator)
    stats = lc.allreduce(x, out, op="avg", algorithm="direct")
    if stats.alone:
        return 0
    if stats.delivered < 1.0:       # (results may differ between ranks from here on)
        state.setdefault("partial", []).append(call)
    wrong = 0
    firsts, lengths = stats.contributors.blocks()
    for first, length, row in zip(firsts, lengths, stats.contributors.members()):
        ranks = [members[r] for r in np.flatnonzero(row)]
        if length and not (ranks and np.allclose(
                out[first:first + length], np.mean([r + 1 + call / 1000 for r in ranks]),
                rtol=0, atol=1e-9)):
            wrong += 1
    model += out
    return wrong
