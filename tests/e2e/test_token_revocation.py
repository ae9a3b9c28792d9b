"""A token the API server stops accepting stops working at the gateway within seconds.

Found by an attacker against main: an accepted token stayed accepted 60 s after its service
account was deleted (the reviewer kept every answer a minute). Real TokenReviews here: her
token, made with the engine's audience, is accepted; her account is deleted; the gateway's
reviewer, asked as a mind in use asks, refuses it within `accepted_seconds` (10 s).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from continuum_operator.door.token_review import TokenReviewer, caller_of
from continuum_operator.engine.admission import ServiceAccount, engine_audience
from tests.support.cluster import Cluster

pytestmark = pytest.mark.e2e


def test_a_minds_token_is_refused_within_ten_seconds_of_her_account_being_deleted(
    cluster: Cluster, namespace: str
) -> None:
    audience = engine_audience(namespace, "coder-8b")
    cluster.kubectl("create", "serviceaccount", "mira", "-n", namespace)
    made = cluster.kubectl("create", "token", "mira", "-n", namespace, f"--audience={audience}")
    token = str(made.stdout).strip()
    reviewer = TokenReviewer(audience, kubeconfig=str(cluster.kubeconfig))
    mira = ServiceAccount(namespace, "mira")
    caller = caller_of(token, "10.0.0.7", lambda account: account == mira)
    assert caller.known  # her claims put her in the minds' lane

    async def main() -> float:
        try:
            assert await reviewer(token, caller) == mira
            cluster.kubectl("delete", "serviceaccount", "mira", "-n", namespace)
            deleted = time.monotonic()
            while await reviewer(token, caller) is not None:  # she keeps using it
                assert time.monotonic() - deleted < 60
                await asyncio.sleep(0.25)
            return time.monotonic() - deleted
        finally:
            await reviewer.close()

    refused_after = asyncio.run(main())
    assert refused_after <= reviewer.accepted_seconds + 2.0, refused_after
