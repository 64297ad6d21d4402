"""Settings: environment, flags, defaults that depend on the machine, and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sqsinfer import config
from sqsinfer.config import ConfigError, Settings
from sqsinfer.worker import inflight


@pytest.fixture
def env(model_path: str) -> dict[str, str]:
    return {
        "SQSINFER_QUEUE_URL": "http://127.0.0.1:1/q",
        "SQSINFER_MODEL_PATH": model_path,
        "SQSINFER_ALLOWED_INPUT_PREFIXES": "s3://in-bucket/a/,s3://in-bucket/b",
        "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/scores",
    }


def test_environment_is_read_and_flags_win(env):
    s = Settings.load(env | {"SQSINFER_PREFETCH": "3"}, {"prefetch": "5"})
    assert s.prefetch == 5
    assert [str(p) for p in s.allowed_input_prefixes] == ["s3://in-bucket/a/", "s3://in-bucket/b/"]
    assert [str(p) for p in s.allowed_output_prefixes] == ["s3://out-bucket/scores/"]
    assert s.processes == config.available_cpus() >= 1
    assert inflight.starting(s.processes, s.prefetch, s.max_prefetch) == s.processes * 5


def test_prefetch_is_auto_unless_a_number_pins_it(env):
    auto = Settings.load(env | {"SQSINFER_PROCESSES": "2"})
    assert (auto.prefetch, auto.always_head_output) == ("auto", False)
    assert _limits(auto) == (4, 16)
    pinned = Settings.load(
        env | {"SQSINFER_PROCESSES": "2", "SQSINFER_PREFETCH": "3"},
        {"always_head_output": "true"},
    )
    assert (pinned.prefetch, pinned.always_head_output) == (3, True)
    assert _limits(pinned) == (6, 6)
    assert Settings.load(env | {"SQSINFER_PREFETCH": "AUTO"}).prefetch == config.AUTO


def _limits(s: Settings) -> tuple[int, int]:
    """The in-flight limit a worker with these settings starts at, and the most it reaches."""
    return (
        inflight.starting(s.processes, s.prefetch, s.max_prefetch),
        inflight.most(s.processes, s.prefetch, s.max_prefetch),
    )


def test_every_setting_has_an_environment_name_and_a_flag():
    assert len(config.ENV_NAMES) == len(set(config.ENV_NAMES))
    assert all(name.startswith("SQSINFER_") for name in config.ENV_NAMES)
    assert "SQSINFER_HEARTBEAT_S" in config.ENV_NAMES


def test_available_cpus_respects_affinity():
    assert config.available_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"SQSINFER_QUEUE_URL": ""}, "SQSINFER_QUEUE_URL"),
        ({"SQSINFER_QUEUE_URL": "sqs://nope"}, "SQSINFER_QUEUE_URL"),
        ({"SQSINFER_MODEL_PATH": "/nonexistent/model.ubj"}, "SQSINFER_MODEL_PATH"),
        ({"SQSINFER_ALLOWED_INPUT_PREFIXES": ""}, "SQSINFER_ALLOWED_INPUT_PREFIXES"),
        ({"SQSINFER_ALLOWED_INPUT_PREFIXES": "/local/path"}, "SQSINFER_ALLOWED_INPUT_PREFIXES"),
        ({"SQSINFER_OUTPUT_PREFIX": "s3://UPPER/x"}, "SQSINFER_OUTPUT_PREFIX"),
        ({"SQSINFER_ALLOWED_OUTPUT_PREFIXES": "s3://other/"}, "SQSINFER_ALLOWED_OUTPUT_PREFIXES"),
        (
            {"SQSINFER_HEARTBEAT_S": "60", "SQSINFER_VISIBILITY_TIMEOUT_S": "30"},
            "SQSINFER_HEARTBEAT_S",
        ),
        ({"SQSINFER_VISIBILITY_TIMEOUT_S": "50000"}, "SQSINFER_VISIBILITY_TIMEOUT_S"),
        ({"SQSINFER_PROCESSES": "two"}, "SQSINFER_PROCESSES"),
        ({"SQSINFER_PROCESSES": "-1"}, "SQSINFER_PROCESSES"),
        ({"SQSINFER_PREFETCH": "0"}, "SQSINFER_PREFETCH"),
        ({"SQSINFER_PREFETCH": "often"}, "SQSINFER_PREFETCH"),
        ({"SQSINFER_MAX_PREFETCH": "0"}, "SQSINFER_MAX_PREFETCH"),
        ({"SQSINFER_ALWAYS_HEAD_OUTPUT": "maybe"}, "SQSINFER_ALWAYS_HEAD_OUTPUT"),
        ({"SQSINFER_WAIT_TIME_S": "25"}, "SQSINFER_WAIT_TIME_S"),
        ({"SQSINFER_OUTPUT_FORMAT": "xml"}, "SQSINFER_OUTPUT_FORMAT"),
        ({"SQSINFER_MODEL_SHA256": "abc"}, "SQSINFER_MODEL_SHA256"),
        ({"SQSINFER_HANDLER": "not a path"}, "SQSINFER_HANDLER"),
        ({"SQSINFER_LOG_LEVEL": "LOUD"}, "SQSINFER_LOG_LEVEL"),
        ({"SQSINFER_DRAIN_DEADLINE_S": "-1"}, "SQSINFER_DRAIN_DEADLINE_S"),
        (
            {"SQSINFER_DRAIN_DEADLINE_S": "30", "SQSINFER_TASK_TIME_S": "45"},
            "SQSINFER_DRAIN_DEADLINE_S",
        ),
        ({"SQSINFER_TASK_TIME_S": "0"}, "SQSINFER_TASK_TIME_S"),
        ({"SQSINFER_MAX_TASK_TIME_S": "50000"}, "SQSINFER_MAX_TASK_TIME_S"),
        ({"SQSINFER_MAX_TASK_TIME_S": "30"}, "SQSINFER_MAX_TASK_TIME_S"),
        (  # below the visibility, but no margin left for the extension call itself
            {"SQSINFER_HEARTBEAT_S": "25", "SQSINFER_VISIBILITY_TIMEOUT_S": "30"},
            "SQSINFER_HEARTBEAT_S",
        ),
        ({"SQSINFER_HEALTH_PORT": "70000"}, "SQSINFER_HEALTH_PORT"),
        ({"SQSINFER_EXIT_WHEN_IDLE_S": "-1"}, "SQSINFER_EXIT_WHEN_IDLE_S"),
        ({"SQSINFER_MAX_TASKS": "-5"}, "SQSINFER_MAX_TASKS"),
        ({"SQSINFER_MAX_TASKS": "2.5"}, "SQSINFER_MAX_TASKS"),
        ({"SQSINFER_RETRY_BASE_S": "100", "SQSINFER_RETRY_MAX_S": "10"}, "SQSINFER_RETRY_BASE_S"),
        # What every output's metadata carries must be ASCII of a bounded length.
        ({"SQSINFER_MODEL_VERSION": "v 1"}, "SQSINFER_MODEL_VERSION"),
        ({"SQSINFER_MODEL_VERSION": "v" * 65}, "SQSINFER_MODEL_VERSION"),
        ({"SQSINFER_WORKER_ID": "pod-\u00e9"}, "SQSINFER_WORKER_ID"),
        ({"SQSINFER_WORKER_ID": "w" * 129}, "SQSINFER_WORKER_ID"),
        ({"SQSINFER_HANDLER": "a" * 120 + ".b:Handler"}, "SQSINFER_HANDLER"),
        # A placeholder no one fills, or one that makes the key too long once filled.
        ({"SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/{model_sha}/"}, "SQSINFER_OUTPUT_PREFIX"),
        ({"SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/{model_version}/"}, "SQSINFER_OUTPUT_PREFIX"),
        (
            {
                "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/scores/",
                "SQSINFER_ALLOWED_OUTPUT_PREFIXES": "s3://out-bucket/scores/,s3://out-bucket/{x}/",
            },
            "SQSINFER_ALLOWED_OUTPUT_PREFIXES",
        ),
        (
            {
                "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/" + "k" * 1000 + "{model_version}/",
                "SQSINFER_MODEL_VERSION": "v" * 64,
            },
            "SQSINFER_OUTPUT_PREFIX",
        ),
    ],
)
def test_a_bad_setting_is_named(env, changes, setting):
    with pytest.raises(ConfigError) as caught:
        Settings.load(env | changes)
    assert caught.value.setting == setting
    assert str(caught.value).startswith(setting)


def test_a_chain_settle_the_task_time_limit_would_cut_short_is_refused(env):
    """Waiting out the settle after its own work, a delivery must not pass
    max_task_time_s: the keeper would abandon it, spending a receive, every time."""
    chained = env | {
        "SQSINFER_NEXT_QUEUE_URL": "http://127.0.0.1:1/next",
        "SQSINFER_TASK_TIME_S": "60",
        "SQSINFER_MAX_TASK_TIME_S": "120",
    }
    with pytest.raises(ConfigError) as caught:
        Settings.load(chained | {"SQSINFER_CHAIN_SETTLE_S": "60"})
    assert caught.value.setting == "SQSINFER_CHAIN_SETTLE_S"
    assert "SQSINFER_MAX_TASK_TIME_S (120 s)" in str(caught.value)
    assert "SQSINFER_TASK_TIME_S (60 s)" in str(caught.value)
    assert Settings.load(chained | {"SQSINFER_CHAIN_SETTLE_S": "59"}).chain_settle_s == 59
    # Not chained: the settle is never waited, so it is not held to the limit.
    assert Settings.load(env | {"SQSINFER_CHAIN_SETTLE_S": "5000"}).chain_settle_s == 5000


def test_the_command_refuses_bad_settings_with_the_name_and_exit_code_2(env):
    result = subprocess.run(
        [sys.executable, "-m", "sqsinfer", "worker", "--heartbeat-s", "90"],
        env={**os.environ, **env},
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        "SQSINFER_HEARTBEAT_S (--heartbeat-s): must be above 0 and at most a third of the "
        "visibility timeout (60 s)" in result.stderr
    )


def test_the_drain_is_derived_from_the_task_time_when_unset(env):
    settings = Settings.load(env | {"SQSINFER_TASK_TIME_S": "45"})
    assert settings.drain_deadline_s == 55.0
    assert settings.shutdown_budget_s == 55.0 + config.COMMIT_GRACE_S + config.FORCED_RELEASE_S
    assert Settings.load(env | {"SQSINFER_DRAIN_DEADLINE_S": "80"}).drain_deadline_s == 80.0


def test_the_task_time_limit_is_derived_from_the_task_time_when_unset(env):
    """3 x task_time_s, at least 15 minutes, at most SQS's 12 h: a stage of long tasks
    sets task_time_s alone."""
    for task_s, limit_s in ((60, 900.0), (1200, 3600.0), (20000, 43200.0)):
        settings = Settings.load(env | {"SQSINFER_TASK_TIME_S": str(task_s)})
        assert settings.max_task_time_s == limit_s
    pinned = env | {"SQSINFER_TASK_TIME_S": "1200", "SQSINFER_MAX_TASK_TIME_S": "1500"}
    assert Settings.load(pinned).max_task_time_s == 1500.0
    with pytest.raises(ConfigError) as caught:
        Settings.load(env | {"SQSINFER_TASK_TIME_S": "50000"})
    assert caught.value.setting == "SQSINFER_TASK_TIME_S"


def test_an_output_prefix_may_name_the_model(env):
    s = Settings.load(
        env
        | {
            "SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/scores/{model_version}/{model_sha256_12}",
            "SQSINFER_MODEL_VERSION": "2026-11-a",
        }
    )
    assert str(s.output_prefix) == "s3://out-bucket/scores/{model_version}/{model_sha256_12}/"
    with pytest.raises(ConfigError, match="is not set"):
        Settings.load(env | {"SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/{model_version}/"})
    with pytest.raises(ConfigError, match=r"unknown placeholder \{sha\}"):
        Settings.load(env | {"SQSINFER_OUTPUT_PREFIX": "s3://out-bucket/{sha}/"})


def test_the_shutdown_budget_counts_the_last_long_poll(env):
    """A short drain ends before the long poll out at SIGTERM, which is let end: the
    budget runs from the later of the two."""
    short = Settings.load(env | {"SQSINFER_TASK_TIME_S": "1"})  # drain 11 s, wait 20 s
    after = short.wait_time_s + config.LAST_RECEIVE_GRACE_S
    assert short.shutdown_budget_s == after + config.COMMIT_GRACE_S + config.FORCED_RELEASE_S
    quick = Settings.load(env | {"SQSINFER_TASK_TIME_S": "1", "SQSINFER_WAIT_TIME_S": "2"})
    assert quick.shutdown_budget_s == 11.0 + config.COMMIT_GRACE_S + config.FORCED_RELEASE_S
