"""Where the AWS calls go: AWS's own configuration, resolved once for every client.

S3 is reached through two clients (the SDK for HEADs, chain markers and the model;
obstore for each task's GET and PUT) and SQS through the SDK. A variable set the
standard AWS way must mean the same to all three, so it is resolved here, the SDK's
way, with the worker's own settings first:

- **region**: `SQSINFER_REGION`, then `AWS_REGION` (what EKS injects into every pod; the
  other AWS SDKs read it first, botocore not at all), then botocore's own order:
  `AWS_DEFAULT_REGION`, the profile's `region`. None: a ConfigError naming them.
- **endpoint**, per service: `SQSINFER_ENDPOINT_URL` (S3 and SQS alike), else what
  botocore configures: `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL_SQS`, `AWS_ENDPOINT_URL`,
  the profile's (none of them under `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`), else AWS's
  own for the region, where `AWS_USE_FIPS_ENDPOINT` and `AWS_USE_DUALSTACK_ENDPOINT` and
  the profile's S3 `addressing_style` apply.
- **CA bundle**: `AWS_CA_BUNDLE` or the profile's `ca_bundle`, else `REQUESTS_CA_BUNDLE`,
  as botocore reads them; checked at start (a readable file of PEM certificates).
- **proxies**: `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` as botocore reads them (urllib's
  rules, judged on each client's endpoint).

The SDK clients are given the region, the `SQSINFER_ENDPOINT_URL` and the CA bundle and
resolve the rest themselves. obstore is not asked to work any of it out again: its
store for a bucket is built from what the SDK's own S3 client does for that bucket
(`Router.route`), namely the URL its request goes to (so the addressing style, a FIPS or
dual-stack host and a custom endpoint's path are the SDK's), the proxy the SDK uses
for it, and the same CA bundle. obstore also reads `AWS_*` and proxy variables itself,
by rules of its own (`AWS_ENDPOINT_URL_S3` even over an explicit endpoint; `NO_PROXY`
with CIDR blocks, which botocore does not know): each one that decides where a call goes
is given explicitly (`s3.DataPath`), so none of them applies on its own.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies

from botocore.exceptions import BotoCoreError, ProfileNotFound
from botocore.httpsession import ProxyConfiguration, mask_proxy_url
from botocore.utils import get_environ_proxies, is_valid_endpoint_url

from sqsinfer.config import AwsConfigError, ConfigError, env_name

SERVICES = ("s3", "sqs")
# botocore's rule for a region name (botocore.utils.validate_region_name).
_REGION_NAME = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?$")
# The key of the request that is built, never sent, to learn where a bucket's calls go.
_PROBE_KEY = "sqsinfer-route"
_AWS_OWN = "AWS's own, or the AWS profile's"


@dataclass(frozen=True)
class AwsTarget:
    """What the clients are given, and where each value came from (for the start-up log
    and for error messages)."""

    region: str
    region_from: str
    endpoint_url: str  # SQSINFER_ENDPOINT_URL; "": the SDK resolves each service's own
    ca_bundle: str  # a file of PEM certificates; "": the SDK's default trust
    ca_bundle_from: str
    ca_pem: bytes = field(default=b"", repr=False)

    # Which setting gave each service its endpoint, named as a person sets it.
    endpoints_from: dict[str, str] = field(default_factory=dict)

    def client_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"region_name": self.region}
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.ca_bundle:
            kwargs["verify"] = self.ca_bundle
        return kwargs


def resolve(session: Any, region: str = "", endpoint_url: str = "") -> AwsTarget:
    """The region, endpoint and CA bundle every client gets, from the worker's settings
    (`region`, `endpoint_url`; "" when unset) and then AWS's configuration as `session`
    (a botocore session) reads it. Raises a ConfigError naming what is wrong."""
    try:
        found_region, region_from = _region(session, region.strip())
        ca_bundle, ca_from = _ca_bundle(session)
        sources = {service: _endpoint_from(session, service, endpoint_url) for service in SERVICES}
    except ProfileNotFound as exc:
        raise AwsConfigError("AWS_PROFILE", str(exc)) from None
    except BotoCoreError as exc:  # e.g. a malformed AWS config file
        raise AwsConfigError("AWS_CONFIG_FILE", str(exc)) from None
    return AwsTarget(
        region=found_region,
        region_from=region_from,
        endpoint_url=endpoint_url,
        ca_bundle=ca_bundle,
        ca_bundle_from=ca_from,
        ca_pem=_read_ca_bundle(ca_bundle, ca_from) if ca_bundle else b"",
        endpoints_from=sources,
    )


def _endpoint_from(session: Any, service: str, given: str) -> str:
    """Where `service`'s endpoint comes from; a variable the SDK would read is checked."""
    if given:
        return env_name("endpoint_url")
    if not session.get_config_variable("ignore_configured_endpoint_urls"):
        for name in (f"AWS_ENDPOINT_URL_{service.upper()}", "AWS_ENDPOINT_URL"):
            value = os.environ.get(name, "")
            if value and not is_valid_endpoint_url(value):
                raise AwsConfigError(name, f"not an endpoint URL: {value!r}")
            if value:
                return name
    return _AWS_OWN


def _region(session: Any, given: str) -> tuple[str, str]:
    if given:
        found, source = given, env_name("region")
    elif os.environ.get("AWS_REGION", "").strip():
        found, source = os.environ["AWS_REGION"].strip(), "AWS_REGION"
    else:
        found = (session.get_config_variable("region") or "").strip()
        source = "AWS_DEFAULT_REGION" if os.environ.get("AWS_DEFAULT_REGION") else "the AWS profile"
    if not found:
        raise ConfigError(
            "region",
            "no region is set: set it, or AWS_REGION or AWS_DEFAULT_REGION, or region in "
            "the AWS profile (the region of the queues and buckets)",
        )
    if not _REGION_NAME.match(found):
        problem = f"not a region name: {found!r}"
        raise ConfigError("region", problem) if given else AwsConfigError(source, problem)
    return found, source


def _ca_bundle(session: Any) -> tuple[str, str]:
    """botocore's CA bundle: its `ca_bundle` (AWS_CA_BUNDLE, then the profile's), else
    REQUESTS_CA_BUNDLE, which its endpoints fall back on."""
    configured = session.get_config_variable("ca_bundle")
    if configured:
        from_env = os.environ.get("AWS_CA_BUNDLE") == configured
        return str(configured), "AWS_CA_BUNDLE" if from_env else "ca_bundle of the AWS profile"
    fallback = os.environ.get("REQUESTS_CA_BUNDLE", "")
    return fallback, "REQUESTS_CA_BUNDLE" if fallback else ""


def _read_ca_bundle(path: str, source: str) -> bytes:
    """The bundle's PEM text, once it is known to be one TLS can use (as the SDK will)."""
    try:
        ssl.create_default_context(cafile=path)
        with open(path, "rb") as fh:
            return fh.read()
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise AwsConfigError(source, f"cannot use {path!r} as a CA bundle: {exc}") from None


@dataclass(frozen=True)
class BucketRoute:
    """How the SDK reaches one bucket, in the terms obstore's store is built from."""

    bucket: str
    url: str  # the SDK's URL of the bucket: its endpoint, and the bucket in host or path
    endpoint: str  # what obstore is given: with the bucket in the host when virtual-hosted
    virtual_hosted: bool
    region: str
    proxy_url: str = ""
    proxy_excludes: str = ""  # hosts that bypass proxy_url
    root_certificate: bytes = b""

    def describe(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "url": self.url,
            "addressing": "virtual" if self.virtual_hosted else "path",
            "proxy": mask_proxy_url(self.proxy_url)
            if self.proxy_url and not self.proxy_excludes
            else "",
        }


class _Built(Exception):
    """The request a probe call built, stopped before it was signed or sent."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


def _stop_before_sending(params: dict[str, Any], **_: Any) -> None:
    raise _Built(str(params["url"]))


class Router:
    """Where the SDK's S3 client sends a bucket's requests, asked of the SDK itself.

    `probe` is an S3 client made exactly as the worker's own (same session, region,
    endpoint and CA bundle) whose calls are built, never sent: its `before-call` hook
    stops each one with the URL the SDK resolved for it. No credentials are needed,
    nothing leaves the process.
    """

    def __init__(self, probe: Any, target: AwsTarget) -> None:
        self._probe = probe
        self._target = target
        probe.meta.events.register_first("before-call.s3.HeadObject", _stop_before_sending)
        # botocore picks a client's proxies once, judging NO_PROXY on its endpoint.
        self._proxies = ProxyConfiguration(proxies=get_environ_proxies(probe.meta.endpoint_url))

    async def route(self, bucket: str) -> BucketRoute:
        try:
            await self._probe.head_object(Bucket=bucket, Key=_PROBE_KEY)
        except _Built as built:
            url = built.url.split("?", 1)[0]
        else:  # pragma: no cover - the hook stops every call
            raise AssertionError("the probe's request was sent")
        base = url.removesuffix("/" + _PROBE_KEY)
        parts = urlsplit(base)
        if parts.path.endswith("/" + bucket):
            endpoint, virtual = base.removesuffix("/" + bucket), False
        elif (parts.hostname or "").startswith(bucket + "."):
            endpoint, virtual = base, True
        else:  # not for a bucket name messages.parse_s3_uri accepts
            raise ValueError(f"the SDK addresses bucket {bucket} as {url}: neither style")
        proxy, excludes = self._proxy_for(base, parts.hostname or "")
        return BucketRoute(
            bucket=bucket,
            url=base,
            endpoint=endpoint,
            virtual_hosted=virtual,
            region=self._target.region,
            proxy_url=proxy,
            proxy_excludes=excludes,
            root_certificate=self._target.ca_pem,
        )

    def _proxy_for(self, url: str, host: str) -> tuple[str, str]:
        """The SDK's proxy for `url`, for obstore: it, or (when the SDK uses none but
        obstore would read one from the environment by its own rules) a proxy with this
        host excluded, which obstore takes instead of the environment's: none."""
        chosen = self._proxies.proxy_url_for(url)
        if chosen:
            return _with_scheme(chosen), ""
        others = [p for scheme, p in getproxies().items() if scheme != "no" and p]
        return (_with_scheme(others[0]), host) if others else ("", "")


def _with_scheme(proxy: str) -> str:
    return proxy if "://" in proxy else "http://" + proxy


def proxies_of(client: Any) -> str:
    """The proxy a client's calls go through ("" for none), credentials masked."""
    endpoint = client.meta.endpoint_url
    chosen = ProxyConfiguration(proxies=get_environ_proxies(endpoint)).proxy_url_for(endpoint)
    return mask_proxy_url(_with_scheme(chosen)) if chosen else ""
