"""Shard leases: a run takes a shard's lease before generating it, so a second run of the same
config works on other shards (or waits) instead of generating the same shard again, a cost the
manifest's exactly-once commit would only discover at the end.

A lease is a small object `leases/{run_id}.{shard_id}.{generation}.json` holding its holder and
an expiry. It is taken by a conditional create (S3 If-None-Match, O_EXCL locally): generation 0
when none exists, generation n + 1 once generation n has expired, so one taker wins each
generation. Only the holder writes its generation again, to renew it (a thread, every third of
the lease) or to release it (expiry 0). A SIGKILLed holder's lease expires and the shard is
taken over; the manifest's conditional create still decides which attempt commits, so a lease
only saves compute and never decides correctness. Expiry is wall-clock time: hosts that share
an output need clocks within a fraction of the lease.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from tasks.commit import create_exclusive, read_manifest
from tasks.layout import RunLayout


@dataclass
class Lease:
    layout: RunLayout
    shard_id: str
    generation: int
    holder: str
    seconds: float

    @property
    def path(self) -> str:
        return self.layout.lease(self.shard_id, self.generation)

    def body(self, expires_at: float) -> bytes:
        return json.dumps({"holder": self.holder, "expires_at": expires_at}).encode()

    def renew(self) -> None:
        self.layout.fs.pipe_file(self.path, self.body(time.time() + self.seconds))

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.layout.fs.pipe_file(self.path, self.body(0.0))


def _newest(layout: RunLayout, shard_id: str) -> tuple[int, dict] | None:
    """The shard's newest lease generation and its content, None when it has none."""
    fs = layout.fs
    generations = sorted(
        int(path.rsplit(".", 2)[-2]) for path in fs.glob(layout.lease(shard_id, "*"))
    )
    if not generations:
        return None
    newest = generations[-1]
    try:
        return newest, json.loads(fs.cat_file(layout.lease(shard_id, newest)))
    except (FileNotFoundError, json.JSONDecodeError):  # being written: treat as live
        return newest, {"holder": "?", "expires_at": time.time() + 1}


def take(layout: RunLayout, shard_id: str, seconds: float) -> Lease | None:
    """This process's lease on the shard, or None while another live holder has it."""
    layout.fs.invalidate_cache(layout.lease(shard_id, 0).rsplit("/", 1)[0])
    newest = _newest(layout, shard_id)
    if newest is not None and newest[1]["expires_at"] > time.time():
        return None
    generation = 0 if newest is None else newest[0] + 1
    lease = Lease(layout, shard_id, generation, uuid.uuid4().hex, seconds)
    if create_exclusive(layout.fs, lease.path, lease.body(time.time() + seconds)):
        return lease
    return None  # another run took this generation first


def wait_for(
    layout: RunLayout, shard_id: str, seconds: float, stopping, poll: float
) -> Lease | None:
    """Block until the shard is committed elsewhere (None) or its lease is ours."""
    while not stopping():
        if read_manifest(layout, shard_id) is not None:
            return None
        if (lease := take(layout, shard_id, seconds)) is not None:
            return lease
        time.sleep(poll)
    return None


@contextlib.contextmanager
def held(lease: Lease) -> Iterator[Lease]:
    """Renew the lease every third of its length while the body runs, then release it."""
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease.seconds / 3):
            with contextlib.suppress(OSError):  # a missed renewal only risks duplicate work
                lease.renew()

    renewer = threading.Thread(target=renew, name=f"lease-{lease.shard_id}", daemon=True)
    renewer.start()
    try:
        yield lease
    finally:
        done.set()
        renewer.join()
        lease.release()
