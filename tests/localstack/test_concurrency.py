"""LocalStack under concurrent calls: the same tests as moto's stand-in passes."""

from __future__ import annotations

import pytest

from proving.localstack import LocalStackServer
from tests.lab.test_standin import (
    test_concurrent_compare_and_swaps_of_one_version_let_one_through,
    test_concurrent_creates_of_one_key_let_one_through,
    test_concurrent_deletes_bring_no_message_back,
    test_concurrent_receives_never_hand_one_message_to_two,
)

__all__ = [
    "test_concurrent_compare_and_swaps_of_one_version_let_one_through",
    "test_concurrent_creates_of_one_key_let_one_through",
    "test_concurrent_deletes_bring_no_message_back",
    "test_concurrent_receives_never_hand_one_message_to_two",
]


@pytest.fixture
def endpoint(localstack_server: LocalStackServer) -> str:
    return localstack_server.url
