"""Requests from a running job: a job asks the cluster that runs it to
change its conditions (drops, bursts, Gilbert-Elliott, none), to stop one
of its processes for a while, or for the counters, and waits for the
answer.  Requests and answers are files in the folder named by
$CLUSTER_CONTROL (the cluster's state folder), not packets on the emulated
network:

    job      writes tmp-ID.json, renames it req-ID.json; waits for ack-ID.json
    cluster  reads req-ID.json, carries it out (Requests.answer), writes
             ack-ID.tmp, renames it ack-ID.json, removes req-ID.json

request() is the job's side; Requests, a part of Cluster, the cluster's."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

from .conditions import Conditions
from .jobs import Jobs


def request(timeout: float = 30, **what: Any) -> Any:
    """From inside a job: ask the cluster that runs it for something (see
    Cluster.answer) and wait for the answer (request(drop=0.05),
    request(stop=os.getpid(), seconds=1), request(counters=True))."""
    folder = Path(os.environ["CLUSTER_CONTROL"])
    name = f"{os.getpid()}-{time.monotonic_ns()}.json"
    tmp = folder / f"tmp-{name}"
    tmp.write_text(json.dumps(what))
    tmp.rename(folder / f"req-{name}")
    ack = folder / f"ack-{name}"
    deadline = time.monotonic() + timeout
    while not ack.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not answer {what} in {timeout} s")
        time.sleep(0.002)
    answer = json.loads(ack.read_text())
    ack.unlink(missing_ok=True)
    if not answer["ok"]:
        raise RuntimeError(answer["error"])
    return answer["result"]


class Requests(Conditions, Jobs):
    """The cluster's side (a part of Cluster): a thread that answers the
    job's requests while a job runs (Jobs.run), until close()."""

    def __init__(self) -> None:
        self._server: Optional[threading.Thread] = None
        self._serving = threading.Event()

    def serve(self) -> None:
        """Answer requests from the job (request()) in a thread, until close()."""
        if self._server is None:
            self._server = threading.Thread(target=self._serve, daemon=True)
            self._server.start()

    def clear_requests(self) -> None:
        for f in self.control.glob("*"):
            f.unlink(missing_ok=True)

    def _stop_serving(self) -> None:
        self._serving.set()

    def _serve(self) -> None:
        while not self._serving.wait(0.005):
            for req in sorted(self.control.glob("req-*.json")):
                try:
                    what = json.loads(req.read_text())
                except (OSError, ValueError):
                    continue            # still being written
                try:
                    answer: Any = {"ok": True, "result": self.answer(what)}
                except Exception as exc:            # the job gets the error, not us
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                ack = self.control / ("ack-" + req.name[4:])
                tmp = ack.with_suffix(".tmp")
                tmp.write_text(json.dumps(answer))
                tmp.rename(ack)
                req.unlink(missing_ok=True)

    def answer(self, what: Dict[str, Any]) -> Any:
        """Carry out one request: {"drop": p}, {"bursts": [ms, every_ms]},
        {"gilbert": [good_ms, bad_ms, loss_bad]}, {"clear": true},
        {"stop": pid, "seconds": s}, {"counters": true}."""
        if "drop" in what:
            self.set_drop(float(what["drop"]))
        elif "bursts" in what:
            ms, every = what["bursts"]
            self.start_bursts(ms / 1e3, every / 1e3)
        elif "gilbert" in what:
            good, bad, loss = what["gilbert"]
            self.start_gilbert(good / 1e3, bad / 1e3, loss)
        elif "clear" in what:
            self.clear()
        elif "stop" in what:
            self.stop_process(int(what["stop"]), float(what["seconds"]))
        elif "counters" in what:
            return self.counters()
        else:
            raise ValueError(f"unknown request {what}")
        return None
