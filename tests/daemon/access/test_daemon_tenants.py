"""Two tenants against one daemon, driven by random API call sequences (Hypothesis).

Each tenant is a principal (its own bearer token) with a model, a published READY
version in its own source region, an engine destination region, a lease and an
expert pool. Steps are random calls — pulls, leases, publishes, deletes, staging
releases, attaching segments, listing and cancelling pulls, drains, publishing from
staging, from a pool, during a pull and into the other tenant's model — with the
tenant's own ids, the other tenant's, stale ones and made-up ones. After every step:
no source byte changed, a tenant's destination changed only through that tenant's
own accepted pull (and then holds exactly the bytes it read), each tenant's version
1 is still its model's READY latest, no tenant sees the other's pulls or segment
names, and every refusal was a 4xx in the ``{"error", "detail"}`` shape.

Each example runs against a daemon of its own, started by the example's first step and
stopped by its teardown, so what an example does and checks depends on its own steps
alone: the ids the daemon gives, the regions and leases it holds, the pulls it lists.
With one daemon for every example, an id a step made up could name a region an earlier
example left behind, so whether a step was refused depended on which examples ran
before; Hypothesis, replaying a choice sequence that now failed at another step, stopped
with ``FlakyStrategyDefinition``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.daemons import daemon_config, served_in_a_thread, token_file

from refitd.config import ServerConfig
from refitd.daemon.app.node import Daemon
from transports.segments import SHM_DIR, SharedSegment

pytestmark = pytest.mark.timeout(120)

NBYTES = 256
"""Bytes of each tenant's source tensor (uint8 [256]) and destination region."""
TOKENS = {"a": "token-of-a", "b": "token-of-b"}
MSGPACK = "application/msgpack"


class Http:
    """One tenant's HTTP connection: msgpack bodies, JSON answers."""

    def __init__(self, url: str, token: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    def call(self, method: str, path: str, value: Any = None) -> tuple[int, Any]:
        headers = dict(self.headers)
        data = None
        if value is not None:
            data = msgspec.msgpack.encode(value)
            headers["Content-Type"] = MSGPACK
        self.conn.request(method, "/v1" + path, body=data, headers=headers)
        r = self.conn.getresponse()
        raw = r.read()
        return r.status, (msgspec.json.decode(raw) if raw else None)

    def ok(self, method: str, path: str, value: Any = None) -> Any:
        status, res = self.call(method, path, value)
        assert 200 <= status < 300, (method, path, status, res)
        return res


def refused(status: int, res: Any, what: str) -> None:
    assert 400 <= status < 500, (what, status, res)
    assert isinstance(res, dict) and set(res) == {"error", "detail"}, (what, res)
    assert isinstance(res["error"], str) and res["error"], (what, res)
    assert isinstance(res["detail"], str) and res["detail"], (what, res)


class Tenant:
    def __init__(self, name: str, http: Http, model: str) -> None:
        self.name = name
        self.http = http
        self.model = model
        # source: a READY version 1 of `model`, bytes fixed for the whole run
        src = http.ok("POST", "/regions", {"nbytes": NBYTES, "label": "src"})
        self.src: int = src["region_id"]
        self.src_handle: str = src["handle"]
        self.src_seg = SharedSegment.attach(src["handle"], NBYTES)
        self.src_bytes = np.random.default_rng(list(name.encode())).integers(
            0, 256, NBYTES, dtype=np.uint8
        )
        self.src_seg.numpy(np.uint8)[:] = self.src_bytes
        shard = [[0], [NBYTES], self.src, 0]
        http.ok("POST", "/sources", {
            "model": model, "version": 1, "part": 0, "expected_parts": 1,
            "tensors": [["w", [NBYTES], "uint8", [shard]]],
        })  # fmt: skip
        # destination: the engine's region, zero until this tenant pulls into it
        dst = http.ok("POST", "/regions", {"nbytes": NBYTES, "label": "dst"})
        self.dst: int = dst["region_id"]
        self.dst_seg = SharedSegment.attach(dst["handle"], NBYTES)
        self.dst_model = np.zeros(NBYTES, dtype=np.uint8)
        self.lease: str = self.acquire()
        self.stale: list[str] = []
        self.staging: list[int] = []
        self.pulls: list[str] = []
        pool = http.ok("POST", "/experts", {
            "name": f"{model}-pool", "layers": 1, "experts": 2, "slots": 2, "row_bytes": [16],
        })  # fmt: skip
        self.pool: list[int] = [pool["host_region"], pool["slot_region"]]
        self.published = 0  # models published from the destination (each retired again)
        # a segment of the tenant's own (its file), attached: the one it may shrink
        self.own_seg = SharedSegment.create(NBYTES, "own")
        self.own: int = http.ok(
            "POST", "/regions/attach", {"handle": self.own_seg.name, "nbytes": NBYTES}
        )["region_id"]

    def acquire(self) -> str:
        res = self.http.ok("POST", "/leases", {"model": self.model, "version": 1, "ttl_s": 600})
        return str(res["lease_id"])

    def close(self) -> None:
        self.http.conn.close()
        self.src_seg.close()
        self.dst_seg.close()
        self.own_seg.close()


# Mostly in bounds, so that accepted calls are frequent; sometimes past the edges.
_offset = st.one_of(st.integers(0, 64), st.integers(0, NBYTES), st.sampled_from([-1, 2**62]))
_size = st.one_of(st.integers(0, 64), st.integers(0, NBYTES), st.sampled_from([-8, NBYTES * 2]))
# Index 0 (the tenant's own id) half the time, the others (foreign, stale, made up) else.
_pick = st.one_of(st.just(0), st.integers(0, 20))
_region = st.one_of(st.integers(0, 3), st.integers(0, 20))
MADE_UP_FROM = 1 << 20
"""Made-up region ids are this or more, or 0 and below: never an id of the example's
daemon, whose ids count up from 1 (an example makes a few dozen regions)."""
_made_up = st.one_of(st.integers(-2, 0), st.integers(MADE_UP_FROM, MADE_UP_FROM + 10_000))
_model = st.sampled_from(["own", "own", "own", "other", "made-up"])


class TwoTenants(RuleBasedStateMachine):
    tokens = ""  # the token file, set by the test before running

    @initialize()
    def start(self) -> None:
        """A daemon of this example's own, and both tenants' objects in it."""
        self.running = contextlib.ExitStack()
        opts = daemon_config(node_id="tenants", transport="shm", shutdown_grace_s=0.5)
        access = ServerConfig(port=0, token_file=self.tokens)
        self.url = self.running.enter_context(
            served_in_a_thread(lambda: Daemon(opts), access=access)
        ).url
        self.t = {n: Tenant(n, Http(self.url, TOKENS[n]), f"{n}-model") for n in ("a", "b")}
        #: every pull the daemon accepted, by tenant
        self.pulls_of: dict[str, set[str]] = {"a": set(), "b": set()}

    def teardown(self) -> None:
        for t in getattr(self, "t", {}).values():
            t.close()
        if hasattr(self, "running"):
            self.running.close()

    def _pick_region(self, who: str, pick: int, raw: int) -> int:
        me, other = self.t[who], self.t["b" if who == "a" else "a"]
        choices = [
            me.src, me.dst, other.src, other.dst, *me.staging, *other.staging, raw,
            *me.pool, *other.pool,
        ]  # fmt: skip
        return choices[pick % len(choices)]

    def _pick_lease(self, who: str, pick: int) -> str:
        me, other = self.t[who], self.t["b" if who == "a" else "a"]
        choices = [me.lease, other.lease, *me.stale, *other.stale, "l9-made-up", ""]
        return choices[pick % len(choices)]

    @rule(
        who=st.sampled_from("ab"),
        lease=_pick,
        model_of=_model,
        src=_region,
        dst=_region,
        raw=_made_up,
        so=_offset,
        do=_offset,
        n=_size,
    )
    def pull(
        self, who: str, lease: int, model_of: str, src: int, dst: int, raw: int,
        so: int, do: int, n: int,
    ) -> None:  # fmt: skip
        me = self.t[who]
        model = {"own": me.model, "other": self.t["b" if who == "a" else "a"].model}.get(
            model_of, "nobody"
        )
        s, d = self._pick_region(who, src, raw), self._pick_region(who, dst, raw)
        table = np.array([[s, so, d, do, n]], dtype="<i8").tobytes()
        body = {
            "model": model,
            "version": 1,
            "lease_id": self._pick_lease(who, lease),
            "descriptors": {"table": table},
        }
        status, res = me.http.call("POST", "/pulls", body)
        if status >= 400:
            refused(status, res, f"pull {body}")
            return
        # Accepted: it must be this tenant's write into memory of its own that a pull
        # may write: its destination, its attached segment or its pool's host rows
        # (never a pool's slots, a staging region or a published source).
        assert d in (me.dst, me.own, me.pool[0]), (
            f"{who}'s pull into region {d} was accepted: {body}"
        )
        me.pulls.append(res["pull_id"])
        self.pulls_of[who].add(res["pull_id"])
        done = me.http.ok("GET", f"/pulls/{res['pull_id']}/wait?timeout=20")
        assert done["state"] == "done", done
        source = self.t["a"] if s == self.t["a"].src else self.t["b"]
        assert s == source.src, f"read region {s} under a lease: {body}"
        if d == me.dst:
            me.dst_model[do : do + n] = source.src_bytes[so : so + n]

    @rule(who=st.sampled_from("ab"), pick=_pick)
    def release_lease(self, who: str, pick: int) -> None:
        me = self.t[who]
        lease = self._pick_lease(who, pick)
        status, res = me.http.call("DELETE", f"/leases/{lease}")
        if status >= 400:
            refused(status, res, f"release {lease}")
            return
        for t in self.t.values():
            if lease == t.lease:
                t.stale.append(t.lease)
                t.lease = t.acquire()

    @rule(who=st.sampled_from("ab"), pick=_region, raw=_made_up)
    def delete_a_region(self, who: str, pick: int, raw: int) -> None:
        me = self.t[who]
        rid = self._pick_region(who, pick, raw)
        if rid == me.dst:
            return  # a tenant may delete its own destination; that is not under test
        status, res = me.http.call("DELETE", f"/regions/{rid}")
        refused(status, res, f"{who} deletes region {rid}")

    @rule(
        who=st.sampled_from("ab"),
        pick=_region,
        raw=_made_up,
        version=st.sampled_from([0, 1]),
        whose=st.sampled_from("ab"),
    )
    def publish(self, who: str, pick: int, raw: int, version: int, whose: str) -> None:
        """Publish into a version that exists or is older (never forward): refused."""
        me = self.t[who]
        rid = self._pick_region(who, pick, raw)
        shard = [[0], [8], rid, 0]
        body = {
            "model": self.t[whose].model,
            "version": version,
            "part": 0,
            "expected_parts": 1,
            "tensors": [["w", [8], "uint8", [shard]]],
        }
        status, res = me.http.call("POST", "/sources", body)
        refused(status, res, f"publish {body}")

    @rule(who=st.sampled_from("ab"), lease=_pick, n=st.integers(1, 4))
    def pack(self, who: str, lease: int, n: int) -> None:
        """A source-side pack under some lease; only the tenant's own lease succeeds."""
        me = self.t[who]
        lid = self._pick_lease(who, lease)
        spec = [me.src, 0, [n], [1], 1, 0, 0]
        status, res = me.http.call(
            "POST",
            "/peer/pack",
            {"model": me.model, "version": 1, "lease_id": lid, "specs": [spec]},
        )
        if status >= 400:
            refused(status, res, f"pack under {lid}")
            return
        assert lid == me.lease, f"pack under another's lease {lid} accepted"
        me.staging.append(res["region"]["region_id"])

    @rule(who=st.sampled_from("ab"), pick=st.integers(0, 20), lease=_pick)
    def drop_staging(self, who: str, pick: int, lease: int) -> None:
        me = self.t[who]
        staging = [*self.t["a"].staging, *self.t["b"].staging]
        if not staging:
            return
        rid = staging[pick % len(staging)]
        lid = self._pick_lease(who, lease)
        status, res = me.http.call("DELETE", f"/peer/staging/{rid}?lease={lid}")
        if status >= 400:
            refused(status, res, f"drop staging {rid} under {lid}")

    @rule(who=st.sampled_from("ab"), whose=st.sampled_from("ab"), daemon_made=st.booleans())
    def attach_a_segment_already_held(self, who: str, whose: str, daemon_made: bool) -> None:
        """Attaching memory the daemon holds (any tenant's) never makes a second id."""
        target = self.t[whose]
        handle = target.src_handle if daemon_made else target.dst_seg.name
        status, res = self.t[who].http.call(
            "POST", "/regions/attach", {"handle": handle, "nbytes": NBYTES}
        )
        refused(status, res, f"{who} attaches {whose}'s segment {handle}")
        assert status == 409, res

    @rule(who=st.sampled_from("ab"), pick=st.integers(0, 20))
    def list_and_cancel_pulls(self, who: str, pick: int) -> None:
        me, other = self.t[who], self.t["b" if who == "a" else "a"]
        listed = {p["pull_id"] for p in me.http.ok("GET", "/pulls")}
        assert listed == self.pulls_of[who], (listed, self.pulls_of[who])
        if not other.pulls:
            return
        victim = other.pulls[pick % len(other.pulls)]
        for method, path in (("GET", f"/pulls/{victim}"), ("DELETE", f"/pulls/{victim}")):
            status, res = me.http.call(method, path)
            refused(status, res, f"{who} {method} {path}")

    @rule(who=st.sampled_from("ab"), retire=st.booleans())
    def drain_the_other_tenants_model(self, who: str, retire: bool) -> None:
        other = self.t["b" if who == "a" else "a"]
        path = f"/sources/{other.model}/versions/1/drain?timeout=0&retire={int(retire)}"
        status, res = self.t[who].http.call("POST", path)
        refused(status, res, f"{who} drains {other.model}")
        assert status == 403, res

    @rule(who=st.sampled_from("ab"), whose=st.sampled_from("ab"), pick=st.integers(0, 20))
    def publish_from_staging_or_a_pool(self, who: str, whose: str, pick: int) -> None:
        """A version is never published from memory the daemon rewrites."""
        me, target = self.t[who], self.t[whose]
        choices = [*target.staging, *target.pool]
        rid = choices[pick % len(choices)]
        me.published += 1
        body = {
            "model": f"{me.model}-from-{rid}-{me.published}", "version": 1, "part": 0,
            "expected_parts": 1, "tensors": [["w", [8], "uint8", [[[0], [8], rid, 0]]]],
        }  # fmt: skip
        status, res = me.http.call("POST", "/sources", body)
        refused(status, res, f"{who} publishes from {whose}'s region {rid}")

    @rule(who=st.sampled_from("ab"), version=st.sampled_from([2, 3, 99]), parts=st.integers(1, 2))
    def publish_into_the_other_tenants_model(self, who: str, version: int, parts: int) -> None:
        me, other = self.t[who], self.t["b" if who == "a" else "a"]
        body = {
            "model": other.model, "version": version, "part": 0, "expected_parts": parts,
            "tensors": [["w", [8], "uint8", [[[0], [8], me.src, 0]]]],
        }  # fmt: skip
        status, res = me.http.call("POST", "/sources", body)
        refused(status, res, f"{who} publishes into {other.model}")
        assert status == 403, res

    @rule(who=st.sampled_from("ab"), n=st.integers(1, NBYTES))
    def publish_from_a_destination_during_its_pull(self, who: str, n: int) -> None:
        """Refused while the pull writes it; accepted only once it ended, and then its
        model is retired again (by its owner) so the destination stays the tenant's."""
        me = self.t[who]
        table = np.array([[me.src, 0, me.dst, 0, n]], dtype="<i8").tobytes()
        pull = {
            "model": me.model,
            "version": 1,
            "lease_id": me.lease,
            "descriptors": {"table": table},
        }
        started = me.http.ok("POST", "/pulls", pull)
        me.pulls.append(started["pull_id"])
        self.pulls_of[who].add(started["pull_id"])
        me.published += 1
        model = f"{me.model}-dst-{me.published}"
        body = {
            "model": model, "version": 1, "part": 0, "expected_parts": 1,
            "tensors": [["w", [8], "uint8", [[[0], [8], me.dst, 0]]]],
        }  # fmt: skip
        status, res = me.http.call("POST", "/sources", body)
        done = me.http.ok("GET", f"/pulls/{started['pull_id']}/wait?timeout=20")
        assert done["state"] == "done", done
        me.dst_model[:n] = me.src_bytes[:n]
        if status >= 400:
            refused(status, res, f"publish from {me.dst} during a pull")
            assert status == 409 and "running pull" in res["detail"], res
            return
        me.http.ok("POST", f"/sources/{model}/versions/1/drain?timeout=5&retire=1")

    @rule(who=st.sampled_from("ab"))
    def list_regions(self, who: str) -> None:
        me = self.t[who]
        for r in me.http.ok("GET", "/regions"):
            if r["owner"] != who:
                assert r["handle"] == "" and r["process"] == "", r

    @invariant()
    def each_tenants_version_1_stays_its_models_ready_latest(self) -> None:
        for t in getattr(self, "t", {}).values():
            latest = t.http.ok("GET", f"/sources/{t.model}/versions/latest")
            assert (latest["version"], latest["state"]) == (1, "ready"), latest

    @rule(who=st.sampled_from("ab"), keep=st.sampled_from([0, 1, 4096, NBYTES // 2]), n=_size)
    def truncate_own_segment_then_pull_into_it(self, who: str, keep: int, n: int) -> None:
        """A tenant shrinks its own attached segment and pulls into it: the pull is
        refused or fails (its ranges suspect); the daemon serves on (the invariant
        checks both tenants' bytes, and later steps its answers)."""
        me = self.t[who]
        path = SHM_DIR / me.own_seg.name
        os.truncate(path, keep)
        try:
            table = np.array([[me.src, 0, me.own, 0, n]], dtype="<i8").tobytes()
            body = {
                "model": me.model,
                "version": 1,
                "lease_id": me.lease,
                "descriptors": {"table": table},
            }
            status, res = me.http.call("POST", "/pulls", body)
            if status >= 400:
                refused(status, res, f"pull into a shrunk segment {body}")
                return
            me.pulls.append(res["pull_id"])
            self.pulls_of[who].add(res["pull_id"])
            done = me.http.ok("GET", f"/pulls/{res['pull_id']}/wait?timeout=20")
            assert done["state"] in ("done", "failed"), done
            if done["state"] == "failed":
                assert done["suspect"] == [[me.own, 0, n]], done
        finally:
            os.truncate(path, NBYTES)  # whole again for the next step
        assert me.http.ok("GET", "/health")["status"] == "ok"

    @invariant()
    def bytes_change_only_through_own_pulls(self) -> None:
        for t in getattr(self, "t", {}).values():
            assert np.array_equal(t.src_seg.numpy(np.uint8), t.src_bytes), f"{t.name}'s source"
            assert np.array_equal(t.dst_seg.numpy(np.uint8), t.dst_model), f"{t.name}'s dst"


def test_two_tenants_random_calls_change_no_bytes_but_through_their_own_pulls(
    tmp_path: Path,
) -> None:
    TwoTenants.tokens = token_file(tmp_path, TOKENS)
    run = TwoTenants.TestCase
    run.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    run().runTest()


def test_every_example_meets_the_same_daemon_whatever_examples_ran_before(
    tmp_path: Path,
) -> None:
    """The cause of the flake this module once had, pinned: an example's steps meet a
    daemon of their own, so two examples in a row get the same ids and each lists only
    its own pulls; and no made-up id is one of those ids."""
    TwoTenants.tokens = token_file(tmp_path, TOKENS)
    seen = []
    for _ in range(2):
        machine = TwoTenants()
        try:
            machine.start()
            machine.publish_from_a_destination_during_its_pull("a", NBYTES)
            machine.list_and_cancel_pulls("a", 0)
            machine.bytes_change_only_through_own_pulls()
            ids = [(t.src, t.dst, t.own, *t.pool) for t in machine.t.values()]
            assert machine.pulls_of["a"] and not machine.pulls_of["b"]
        finally:
            machine.teardown()
        assert all(0 < i < MADE_UP_FROM for tenant in ids for i in tenant), ids
        seen.append(ids)
    assert seen[0] == seen[1], seen


def test_a_tenant_may_pull_into_its_pools_host_rows_but_never_into_its_slots(
    tmp_path: Path,
) -> None:
    """The step CI once met: a pull into the tenant's own pool's host region was
    accepted (rightly: a refit writes expert rows there) and the machine called it a
    write outside the tenant's destination. A pull into the pool's slot region is
    refused: only the pool's copies write slots."""
    TwoTenants.tokens = token_file(tmp_path, TOKENS)
    machine = TwoTenants()
    try:
        machine.start()
        me = machine.t["a"]
        host, slots = me.pool
        for dst, accepted in ((host, True), (slots, False)):
            pick = machine._pick_region("a", 0, 0)
            assert pick == me.src
            index = [machine._pick_region("a", i, 0) for i in range(9)].index(dst)
            before = len(me.pulls)
            machine.pull("a", 0, "own", 0, index, 0, 0, 0, 16)
            assert (len(me.pulls) == before + 1) is accepted, (dst, me.pulls)
            machine.bytes_change_only_through_own_pulls()
    finally:
        machine.teardown()
