"""The operator commands read AWS's own configuration as the worker does (the region, the
endpoint), and every command that reads settings warns of a `SQSINFER_*` variable that is
no setting."""

from __future__ import annotations

import json

from sqsinfer import cli
from sqsinfer.lab import standin
from tests.conftest import make_stage


def test_status_with_only_aws_region_and_aws_endpoint_url_set(moto, aws_env, capsys):
    aws_env.setenv("AWS_REGION", "eu-west-1")
    aws_env.setenv("AWS_ENDPOINT_URL", moto.url)
    stage = make_stage(moto.url, "eu-west-1")  # the stand-in keeps its queues per region
    for i in range(3):
        stage.send({"task_id": f"t{i}"})
    argv = ["status", "--queue-url", stage.queue_url, "--interval-s", "0", "--json"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    queue, _dlq = json.loads(capsys.readouterr().out)["queues"]
    assert (queue["url"], queue["visible"]) == (stage.queue_url, 3)


def test_a_command_without_a_region_stops_naming_where_to_set_one(moto, aws_env, capsys):
    url = f"{moto.url}/123456789012/q"
    argv = ["status", "--queue-url", url, "--endpoint-url", moto.url, "--interval-s", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "sqsinfer status: invalid setting: SQSINFER_REGION (--region)" in err
    assert "AWS_REGION" in err and "AWS_DEFAULT_REGION" in err


def test_an_unknown_variable_is_named_with_the_closest_setting(moto, stage, aws_env, capsys):
    aws_env.setenv("SQSINFER_REGOIN", "eu-west-1")
    aws_env.setenv("SQSINFER_NOTHING_LIKE_IT", "1")
    argv = ["status", "--queue-url", stage.queue_url, "--endpoint-url", moto.url]
    assert cli.main([*argv, "--region", standin.REGION, "--interval-s", "0", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert (
        "sqsinfer status: warning: SQSINFER_REGOIN is not a setting, ignored; "
        "did you mean SQSINFER_REGION?"
    ) in err
    assert "sqsinfer status: warning: SQSINFER_NOTHING_LIKE_IT is not a setting, ignored" in err
