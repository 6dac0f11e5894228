"""Processes started after a loss take the lost ranks' places through a
rendezvous directory: Communicator(elastic=True, rendezvous=DIR) and
Communicator.join(DIR) (docs/elastic.md, "Growing back";
tests/programs/elastic_rejoin.py)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from mpi4py import MPI

import mpilossy
from mpilossy import _core
from mpilossy.control.rendezvous import STALE, Rendezvous
from helpers import (PROGRAMS, all_ranks_raise, clean_subprocess_env, json_reports, mpiexec,
                     run_bounded)
from test_spares import skip_unless_own_job

PROGRAM = PROGRAMS / "elastic_rejoin.py"


def run_rejoin(tmp_path, ranks, channel, losses, calls, newcomers, *, delay=0.0,
               launcher=True, before=None, **env):
    """The job under its own mpiexec, and `newcomers` processes started
    `delay` seconds after it, one after another (each under `mpiexec -n 1`,
    or as a singleton; `before(directory)` called first); every JSON line
    printed, and the output."""
    directory = tmp_path / "rendezvous"
    directory.mkdir()
    environ = clean_subprocess_env(**env)
    job = subprocess.Popen([mpiexec(), "-disable-auto-cleanup", "-n", str(ranks),
                            sys.executable, str(PROGRAM), "job", channel, str(directory), losses,
                            str(calls)], env=environ, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = []
    try:
        time.sleep(delay)
        if before is not None:
            before(directory)
            time.sleep(0.1)
        for _ in range(newcomers):
            start = [mpiexec(), "-n", "1"] if launcher else []
            started.append(subprocess.Popen(
                start + [sys.executable, str(PROGRAM), "new", str(directory), "60"],
                env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
            time.sleep(0.5)
        outputs = [p.communicate(timeout=90) for p in [job] + started]
    finally:
        for p in [job] + started:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = "".join(out + err for out, err in outputs)
    lines = json_reports("".join(out for out, _ in outputs), '{"member"')
    return lines, text, [p.returncode for p in [job] + started]


def models_comparable(lines):
    """No call after the last growth lost blocks on any process: their
    results, and so their models, are the same there (a lossy call's
    result may differ between ranks)."""
    last = max(call for line in lines for call, _ in line["joined"])
    return not any(call > last for line in lines for call in line["partial"])


def check_back_at_full_size(lines, ranks, members, output):
    """Every process in at the end made every call, each block the mean over
    the members its call records; they agree on the members, on each
    growth and on the state sent at it; a newcomer holds the model of the
    rank that sent it (the results differ between ranks only at the calls
    that lost a rank)."""
    assert sorted(line["member"] for line in lines) == members, output
    for line in lines:
        assert line["members"] == members and line["size"] == ranks, line
        assert line["wrong"] == 0 and line["calls"] == lines[0]["calls"], line
        assert line["arrivals"] == (line["role"] == "new"), line
    job = sorted((line for line in lines if line["role"] == "job"), key=lambda l: l["member"])
    if models_comparable(lines):     # (a newcomer's model is the lowest rank's, sent to it)
        for line in lines:
            if line["role"] == "new":
                assert line["model"] == pytest.approx(job[0]["model"], rel=1e-12), line
    assert all(line["joined"] == job[0]["joined"] for line in job), output
    growths = [call for call, _ in job[0]["joined"]]
    for line in lines:
        if line["role"] == "new":
            # (a newcomer sees its own growth and those after it)
            mine = next(i for i, (_, who) in enumerate(job[0]["joined"])
                        if who == [line["member"]])
            assert line["joined"] == job[0]["joined"][mine:], output
            assert line["sent"] == job[0]["sent"][mine:], output
    assert len(growths) == len(members) - len(job), output


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks,channel,losses,newcomers,delay,members,nodes", [
    # one newcomer waiting before the loss: taken in at the grow() after the exclusion
    (4, "ud", "1@10", 1, 0.0, [0, 2, 3, 4], 1),
    # two losses, two newcomers started after them, one after the other
    (3, "ud", "1@5,2@12", 2, 3.0, [0, 3, 4], 1),
    # the job on two (fake) nodes: the membership's messages are datagrams
    (4, "ud", "2@10", 1, 0.0, [0, 1, 3, 4], 2),
])
def test_processes_started_outside_the_job_take_the_lost_ranks_places(
        tmp_path, ranks, channel, losses, newcomers, delay, members, nodes):
    skip_unless_own_job(channel)
    lines, output, codes = run_rejoin(tmp_path, ranks, channel, losses, 30, newcomers,
                                      delay=delay, MPIR_CVAR_NUM_CLIQUES=str(nodes))
    assert codes[1:] == [0] * newcomers, output
    check_back_at_full_size(lines, ranks, members, output)
    assert all(line["datagram_signals"] == (nodes > 1) for line in lines), output
    assert not [p for p in (tmp_path / "rendezvous").iterdir()
                if p.name.startswith(("knock.", "port."))], output


@pytest.mark.timeout(150)
def test_a_newcomer_starts_from_the_learned_deadline_and_loss_rate(tmp_path):
    """timeout="auto", redundancy="auto": rank 1 exits after the first
    agreements; the newcomer starts from the survivors' learned deadlines
    (below the 1 s cap) and agreed loss rate, the same as theirs when the
    state is sent, not from the cap."""
    skip_unless_own_job("ud")
    lines, output, _ = run_rejoin(tmp_path, 4, "ud", "1@40", 60, 1, REJOIN_TIMEOUT="auto",
                                  REJOIN_REDUNDANCY="auto")
    check_back_at_full_size(lines, 4, [0, 2, 3, 4], output)
    sent = [line["sent"] for line in lines]
    assert all(len(s) == 1 and s[0] == sent[0][0] for s in sent), sent
    _, _, deadlines, loss_rate = sent[0][0]
    assert deadlines and all(t < 1.0 for _, t in deadlines), deadlines
    assert loss_rate is not None, sent


class GoneKnock(threading.Thread):
    """A knock whose newcomer is gone once the ranks agree on it: touched
    as a waiting newcomer's, but its port never taken (it died, stalled or
    gave up in the instant after the agreement).  Records whether the
    ranks offered it a port; ends when they remove the knock."""

    def __init__(self, directory):
        super().__init__(daemon=True)
        self.knock = directory / f"knock.{time.time():.6f}.gone.0"
        self.port = directory / ("port." + self.knock.name)
        self.knock.write_text(json.dumps({"size": 1}))
        self.offered = False
        self.start()

    def run(self):
        end = time.monotonic() + 90
        while time.monotonic() < end:
            self.offered = self.offered or self.port.exists()
            try:
                os.utime(self.knock)
            except FileNotFoundError:
                return
            time.sleep(0.005)


@pytest.mark.timeout(150)
def test_a_newcomer_gone_after_the_agreement_is_not_waited_for(tmp_path):
    """The oldest knock's newcomer never takes the port the ranks offer it:
    they withdraw it after a bound (without it they waited in
    MPI_Comm_accept for ever), drop its knock, go on, and take in the next
    newcomer at a later grow()."""
    skip_unless_own_job("ud")
    gone = []
    lines, output, codes = run_rejoin(tmp_path, 4, "ud", "1@10", 30, 1,
                                      before=lambda d: gone.append(GoneKnock(d)),
                                      MPILOSSY_LOG="warning")
    assert codes == [0, 0], output
    assert gone[0].offered and not gone[0].knock.exists(), output
    assert "could not be taken in: it did not take its port" in output, output
    check_back_at_full_size(lines, 4, [0, 2, 3, 4], output)
    assert not [p for p in (tmp_path / "rendezvous").iterdir()
                if p.name.startswith(("knock.", "port.", "taken."))], output


@pytest.mark.timeout(150)
def test_a_second_singleton_is_refused_and_the_job_goes_on(tmp_path):
    """Two newcomers started without a launcher: MPI takes the second for
    the first and cannot accept it; it raises, the ranks in go on without
    it (every result exact) and end at the size they reached."""
    skip_unless_own_job("ud")
    lines, output, codes = run_rejoin(tmp_path, 4, "ud", "1@5,2@8", 20, 2, delay=1.0,
                                      launcher=False, REJOIN_EXTRA="150")
    assert codes[2] != 0 and "two singletons look alike to MPI" in output, output
    assert sorted(line["member"] for line in lines) == [0, 3, 4], output
    for line in lines:
        assert line["wrong"] == 0 and line["calls"] == 170 and line["size"] == 3, line
    models = {line["member"]: line["model"] for line in lines}
    assert models[4] == pytest.approx(models[0], rel=1e-12) or not models_comparable(lines), \
        output


@pytest.mark.timeout(120)
def test_a_newcomer_waiting_when_the_job_ends_is_told_so(tmp_path):
    """Nobody lost: no place is ever free; the newcomer's join() returns
    None when the job frees its communicator, long before its bound."""
    skip_unless_own_job("ud")
    lines, output, codes = run_rejoin(tmp_path, 2, "ud", "", 60, 1, REJOIN_EXTRA="0")
    assert codes == [0, 0], output
    assert [line["member"] for line in lines if line["role"] == "job"].count(0) == 1, output
    ended = json_reports(output, '{"role": "new"')
    assert ended and ended[0]["joined"] is False and ended[0]["seconds"] < 30, output
    assert not list((tmp_path / "rendezvous").glob("knock.*")), output


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_a_rendezvous_needs_elastic_no_spares_the_datagram_channel_and_a_directory(tmp_path):
    """Clear errors on every rank, whatever the suite's size (the directory
    is the same path on every rank: rank 0's)."""
    comm = MPI.COMM_WORLD
    here = comm.bcast(str(tmp_path))
    all_ranks_raise(comm, lambda: mpilossy.Communicator(
        comm, channel="ud", timeout=0.5, rendezvous=here), ValueError)
    if comm.size > 1:
        all_ranks_raise(comm, lambda: mpilossy.Communicator(
            comm, channel="ud", timeout=0.5, elastic=True, spares=1, rendezvous=here),
            ValueError)
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(
        comm, channel="rma", timeout=0.5, elastic=True, rendezvous=here), ValueError)
    assert "channel='ud'" in message
    if _core.HAVE_DATAGRAM_AUTH:
        message = all_ranks_raise(comm, lambda: mpilossy.Communicator(
            comm, channel="ud", timeout=0.5, elastic=True,
            rendezvous=here + "/missing"), ValueError)
        assert "not a directory" in message
    all_ranks_raise(comm, lambda: mpilossy.Communicator(
        comm, channel="ud", timeout=0.5, elastic=True, rendezvous=3), TypeError)


@pytest.mark.timeout(60)
def test_join_checks_its_arguments_and_gives_up_after_its_timeout(tmp_path, monkeypatch):
    """On one process (COMM_SELF): clear errors for a bad directory,
    timeout or environment, before any knock (once taken in, the ranks in
    would wait for it); with nobody there, None after the timeout and no
    knock left."""
    with pytest.raises(ValueError, match="not a directory"):
        mpilossy.Communicator.join(tmp_path / "missing")
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="timeout"):
            mpilossy.Communicator.join(tmp_path, timeout=bad)
    with pytest.raises(TypeError):
        mpilossy.Communicator.join(tmp_path, comm="world")
    with monkeypatch.context() as patched:
        patched.setenv("MPILOSSY_BLOCK_BYTES", "a lot")
        with pytest.raises(ValueError, match="MPILOSSY_BLOCK_BYTES"):
            mpilossy.Communicator.join(tmp_path, timeout=30)
    assert list(tmp_path.iterdir()) == []
    began = time.monotonic()
    assert mpilossy.Communicator.join(tmp_path, timeout=0.3) is None
    assert 0.3 <= time.monotonic() - began < 5
    assert list(tmp_path.iterdir()) == []


def test_the_ranks_in_see_waiting_newcomers_oldest_first_and_drop_the_gone(tmp_path):
    """Rendezvous.knocks: knocks in the order they came (their names), a
    knock not touched for STALE seconds removed (its newcomer is gone),
    files half written or not knocks ignored."""
    (tmp_path / "knock.2.0.h.2").write_text('{"size": 1}')
    (tmp_path / "knock.1.0.h.1").write_text('{"size": 2}')
    gone = tmp_path / "knock.0.5.h.3"
    gone.write_text('{"size": 1}')
    old = time.time() - STALE - 1
    os.utime(gone, (old, old))
    (tmp_path / "knock.3.0.h.4.tmp").write_text('{"si')
    (tmp_path / "knock.4.0.h.5").write_text('{"si')
    (tmp_path / "run.json").write_text("{}")
    assert Rendezvous(str(tmp_path)).knocks() == [("knock.1.0.h.1", 2), ("knock.2.0.h.2", 1)]
    assert not gone.exists()
