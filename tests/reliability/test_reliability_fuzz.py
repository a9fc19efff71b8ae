"""Schemathesis against a real daemon's own API document: every operation, valid and
invalid inputs, then the stateful links of the document.

Pass: no 5xx but the documented 502, every answer conforms to the document (status,
content type, body schema), invalid input is refused with a 4xx, and the daemon still
serves afterwards. The daemon runs with a private 256 MiB /dev/shm, so generated
sizes cannot eat the host's shared memory.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import CheckContext
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi import checks as oas

from refitd.client.spawn import spawn_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MIN_CASES = 1000
POSITIVE_PER_OP = 20
NEGATIVE_PER_OP = 12
STATEFUL_STEPS = 300

SANDBOX = [
    "unshare", "-m", "--propagation", "private", "--",
    "sh", "-c", 'mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm && exec "$@"', "sandbox",
]  # fmt: skip


def no_5xx_but_the_documented_502(ctx: CheckContext, response: object, case: object) -> bool:
    status = response.status_code  # type: ignore[attr-defined]
    if status >= 500:
        assert status == 502, f"server error {status}: {response.text[:300]}"  # type: ignore[attr-defined]
        body = response.json()  # type: ignore[attr-defined]
        assert body["error"] == "TransportError" and body["detail"], body
    return True


CHECKS = [
    no_5xx_but_the_documented_502,
    oas.status_code_conformance,
    oas.content_type_conformance,
    oas.response_schema_conformance,
]


class Tally:
    def __init__(self) -> None:
        self.cases: collections.Counter[str] = collections.Counter()
        self.failures: dict[tuple[str, str], str] = {}

    def run(self, case: schemathesis.Case, base: str, checks: list) -> None:  # type: ignore[type-arg]
        response = case.call(base_url=base, timeout=30)
        self.cases[case.operation.label] += 1
        try:
            case.validate_response(response, checks=checks)
        except FailureGroup as group:
            for failure in group.exceptions:
                key = (case.operation.label, failure.title)
                self.failures.setdefault(
                    key, f"{failure.message[:400]}\n  reproduce: {case.as_curl_command()}"
                )
        except AssertionError as exc:
            key = (case.operation.label, str(exc)[:80])
            self.failures.setdefault(key, f"{exc}\n  reproduce: {case.as_curl_command()}")


def run_mode(strategy, n: int, call) -> None:  # type: ignore[no-untyped-def]
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def one(case: schemathesis.Case) -> None:
        call(case)

    try:
        one()
    except Unsatisfiable:
        pass  # negative mode of an operation with no input to make invalid


def fuzz(base: str) -> Tally:
    schema = schemathesis.openapi.from_url(base + "/v1/openapi.json")
    tally = Tally()
    modes = [
        (GenerationMode.POSITIVE, POSITIVE_PER_OP, CHECKS),
        (GenerationMode.NEGATIVE, NEGATIVE_PER_OP, [*CHECKS, oas.negative_data_rejection]),
    ]
    for result in schema.get_all_operations():
        op = result.ok()
        for mode, n, checks in modes:
            strategy = op.as_strategy(generation_mode=mode)
            run_mode(strategy, n, lambda case, checks=checks: tally.run(case, base, checks))
    return tally


async def test_schemathesis_finds_no_server_error_and_no_answer_outside_the_document(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(16))
    async with spawn_daemon(secret_file=str(secret), prefix=SANDBOX) as d:
        tally = await asyncio.to_thread(fuzz, d.url)
        total = sum(tally.cases.values())
        print(
            f"\nfuzz: {total} generated cases over {len(tally.cases)} operations, "
            f"{len(tally.failures)} distinct failures"
        )
        for (label, title), text in sorted(tally.failures.items()):
            print(f"- {label}: {title}\n  {text}")
        # Still serving, and still answering correctly.
        health = requests.get(d.url + "/v1/health", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert len(tally.cases) == 36, sorted(tally.cases)
    assert total >= MIN_CASES
    assert not tally.failures, "\n".join(f"{k}: {v}" for k, v in tally.failures.items())
