"""Where the region comes from: the worker's setting, then the SDK's order (AWS_REGION,
AWS_DEFAULT_REGION, the profile), read by botocore's own session; and what is refused
at start, named."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiobotocore.session import AioSession

from sqsinfer.aws.endpoints import resolve
from sqsinfer.config import ConfigError

PROFILE = "[default]\nregion = ap-south-1\n\n[profile other]\nregion = sa-east-1\n"


@pytest.fixture
def profile(aws_env: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    (tmp_path / "config").write_text(PROFILE)
    aws_env.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    return aws_env


@pytest.mark.parametrize(
    ("given", "variables", "region", "source"),
    [
        ("us-west-2", {"AWS_REGION": "eu-west-1"}, "us-west-2", "SQSINFER_REGION"),
        (
            "",
            {"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "eu-north-1"},
            "eu-west-1",
            "AWS_REGION",
        ),
        ("", {"AWS_DEFAULT_REGION": "eu-north-1"}, "eu-north-1", "AWS_DEFAULT_REGION"),
        ("", {}, "ap-south-1", "the AWS profile"),
        ("", {"AWS_PROFILE": "other"}, "sa-east-1", "the AWS profile"),
    ],
)
def test_the_region_in_the_sdks_order_after_the_workers_setting(
    profile, given, variables, region, source
):
    for name, value in variables.items():
        profile.setenv(name, value)
    target = resolve(AioSession(), given)
    assert (target.region, target.region_from) == (region, source)
    assert target.client_kwargs()["region_name"] == region


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("AWS_REGION", "eu west 1", "AWS_REGION"),
        ("AWS_PROFILE", "missing", "AWS_PROFILE"),
        ("AWS_ENDPOINT_URL", "localhost:4566", "AWS_ENDPOINT_URL"),
        ("AWS_ENDPOINT_URL_SQS", "not a url", "AWS_ENDPOINT_URL_SQS"),
    ],
)
def test_what_cannot_be_used_is_refused_by_name(profile, variable, value, named):
    profile.setenv(variable, value)
    with pytest.raises(ConfigError) as refused:
        resolve(AioSession())
    assert refused.value.setting == named
    assert str(refused.value).startswith(f"{named}: ")


def test_configured_endpoints_are_ignored_when_aws_says_so(profile):
    profile.setenv("AWS_ENDPOINT_URL", "localhost:4566")  # not even read
    profile.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert resolve(AioSession()).endpoints_from == {
        "s3": "AWS's own, or the AWS profile's",
        "sqs": "AWS's own, or the AWS profile's",
    }
