"""FIFO queues on LocalStack: the moto tests of tests/worker/test_fifo.py, but one.

Not here: a group's later messages handed back (visibility 0) while an earlier one waits
out its retry delay. AWS keeps the group locked while any of its messages is in flight
(moto too); LocalStack unlocks it as soon as any received message of the group is
visible again, and hands the later one out first.
"""

from __future__ import annotations

import pytest

from proving import localstack
from tests.worker.test_fifo import (  # noqa: F401 (collected here, against LocalStack)
    test_a_group_runs_one_message_at_a_time_in_its_order,
    test_a_rejected_message_of_a_group_goes_to_the_fifo_dlq_and_the_group_goes_on,
    test_lost_send_answers_to_a_fifo_next_stage_add_no_message,
    test_sends_outside_the_dedup_window_are_counted_possible,
)


@pytest.fixture
def stand_in(localstack_server: localstack.LocalStackServer) -> str:
    return localstack_server.url
