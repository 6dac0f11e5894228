"""What the growth programs (elastic_spares.py, elastic_rejoin.py) share:
one call, an all-reduce (direct, op avg) of (member + 1 + call / 1000),
each block of its result checked against the mean over the members its
record names; the record of exclusions and growths; and the state the
ranks in send a newcomer."""

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


def record_membership(lc, state: dict) -> None:
    """Exclusions and growths seen, as (call, members), in state."""
    lc.on_growth(lambda joined, members: state["joined"].append((state["call"], list(joined))))
    lc.on_exclusion(lambda out, members: state["excluded"].append((state["call"], list(out))))


def send_state(lc, model: np.ndarray, state: dict) -> int:
    """Collective over the ranks in and the newcomers: where the run is
    (rank 0's call number and model), recorded in state["sent"] with the
    learned deadlines and the agreed loss rate; returns the call number."""
    step = np.array([state["call"]], dtype=np.int64)
    lc.bcast(step, root=0)
    lc.bcast(model, root=0)
    deadlines = sorted((str(key), t) for key, t in lc.auto_timeouts.items())
    state["sent"].append((int(step[0]), float(model.sum()), deadlines, lc.loss_rate))
    return int(step[0])
