"""What the schemathesis suite found, each pinned by a fast test against the real app.

Request bodies refuse unknown fields, counts and names are bounded, releasing an
unknown lease is a 404, a segment name that is no file name is a 400 (it was a 500),
and every refusal names the field it is about."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from support.daemons import served

from refitd.wire import MAX_PARTS


async def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/regions", {"nbytes": 64, "colour": "red"}),
        ("/v1/regions/attach", {"handle": "x", "nbytes": 64, "colour": "red"}),
        ("/v1/leases", {"model": "m", "version": 1, "colour": "red"}),
        (
            "/v1/sources",
            {
                "model": "m",
                "version": 1,
                "part": 0,
                "expected_parts": 1,
                "tensors": [],
                "colour": 1,
            },
        ),
        (
            "/v1/pulls",
            {
                "model": "m",
                "version": 1,
                "lease_id": "l",
                "descriptors": {"table": ""},
                "colour": 1,
            },
        ),
    ],
)
async def test_a_request_body_with_an_unknown_field_is_refused_naming_it(
    path: str, body: dict[str, Any]
) -> None:
    async with served(wired=True) as daemon:
        status, reply = await post(daemon.url, path, body)
    assert status == 400, reply
    assert reply["error"] == "ProtocolError" and "unknown field `colour`" in reply["detail"]


async def test_expected_parts_past_the_bound_is_refused_naming_the_field() -> None:
    body = {"model": "m", "version": 1, "part": 0, "expected_parts": MAX_PARTS + 1, "tensors": []}
    async with served(wired=True) as daemon:
        status, reply = await post(daemon.url, "/v1/sources", body)
        assert status == 400 and "$.expected_parts" in reply["detail"], reply
        body["expected_parts"] = MAX_PARTS
        assert (await post(daemon.url, "/v1/sources", body))[0] == 201


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/sources", {"model": "m" * 257, "version": 1, "part": 0, "expected_parts": 1, "tensors": []}, "$.model"),
        ("/v1/sources", {"model": "m", "version": 1, "part": 0, "expected_parts": 1, "tensors": [["t" * 1025, [1], "uint8", []]]}, "$.tensors[0][0]"),
        ("/v1/sources", {"model": "m", "version": 1, "part": 0, "expected_parts": 1, "tensors": [["t", [1], "u" * 33, []]]}, "$.tensors[0][2]"),
        ("/v1/regions", {"nbytes": 64, "label": "l" * 257}, "$.label"),
        ("/v1/leases", {"model": "m", "version": 1, "label": "h" * 257}, "$.label"),
    ],
)  # fmt: skip
async def test_an_overlong_name_or_label_is_refused_naming_the_field(
    path: str, body: dict[str, Any], field: str
) -> None:
    async with served(wired=True) as daemon:
        status, reply = await post(daemon.url, path, body)
    assert status == 400, reply
    assert field in reply["detail"] and "length" in reply["detail"], reply


async def test_a_field_refused_past_the_first_decode_batch_is_named_by_its_index_in_the_manifest() -> (
    None
):
    """Manifests are decoded in batches of about 1 MiB: a refusal deep in a big one
    still names the tensor by its place in the whole body, not in its batch."""
    n = 40_000  # about 1.4 MB of JSON: the last tensor is in the second batch
    tensors: list[list[Any]] = [[f"t{i}", [1], "uint8", []] for i in range(n - 1)]
    tensors.append(["t" * 1025, [1], "uint8", []])
    body = {"model": "m", "version": 1, "part": 0, "expected_parts": 1, "tensors": tensors}
    async with served(wired=True) as daemon:
        status, reply = await post(daemon.url, "/v1/sources", body)
    assert status == 400, reply
    assert f"$.tensors[{n - 1}][0]" in reply["detail"], reply


async def test_releasing_a_lease_the_daemon_does_not_hold_is_404_and_a_held_one_200() -> None:
    async with served(wired=True) as daemon, aiohttp.ClientSession() as s:
        async with s.delete(daemon.url + "/v1/leases/no-such-lease") as r:
            assert r.status == 404
            body = await r.json()
        assert body["error"] == "NotFoundError" and "'no-such-lease'" in body["detail"]
        manifest = {"model": "m", "version": 1, "part": 0, "expected_parts": 1, "tensors": []}
        assert (await post(daemon.url, "/v1/sources", manifest))[0] == 201
        status, grant = await post(daemon.url, "/v1/leases", {"model": "m", "version": 1})
        assert status == 201
        async with s.delete(daemon.url + f"/v1/leases/{grant['lease_id']}") as r:
            assert r.status == 200
        async with s.delete(daemon.url + f"/v1/leases/{grant['lease_id']}") as r:
            assert r.status == 404  # released once only


@pytest.mark.parametrize("handle", ["a\x00b", "\ud800x"])
async def test_a_segment_handle_that_is_no_file_name_is_refused_not_a_server_error(
    handle: str,
) -> None:
    async with served(wired=True) as daemon, aiohttp.ClientSession() as s:
        data = json.dumps({"handle": handle, "nbytes": 64}).encode()  # \u escapes
        headers = {"Content-Type": "application/json"}
        async with s.post(daemon.url + "/v1/regions/attach", data=data, headers=headers) as r:
            status, reply = r.status, await r.json()
    assert status == 400, reply
    # A NUL reaches the segment-name check; a lone surrogate is already bad JSON.
    assert "refused" in reply["detail"] and (
        "\\x00" in reply["detail"] or "JSON" in reply["detail"]
    )


async def test_the_api_document_links_each_creating_post_to_the_operations_on_its_result() -> None:
    async with (
        served(wired=True) as daemon,
        aiohttp.ClientSession() as s,
        s.get(daemon.url + "/v1/openapi.json") as r,
    ):
        doc = await r.json()
    links = {
        path: sorted(doc["paths"][path]["post"]["responses"][status]["links"])
        for path, status in [
            ("/v1/regions", "201"),
            ("/v1/leases", "201"),
            ("/v1/pulls", "202"),
            ("/v1/sources", "201"),
            ("/v1/experts", "201"),
        ]
    }
    assert links["/v1/regions"] == ["deleteRegionsRegionId", "getRegionsRegionId"]
    assert "postLeasesLeaseIdRenew" in links["/v1/leases"]
    assert "getPullsPullIdWait" in links["/v1/pulls"]
    assert "getSourcesModelVersionsVersionManifest" in links["/v1/sources"]
    assert "postExpertsPoolEnsure" in links["/v1/experts"]
    ensure = doc["paths"]["/v1/experts"]["post"]["responses"]["201"]["links"]
    assert ensure["postExpertsPoolEnsure"]["parameters"] == {"pool": "$response.body#/name"}
