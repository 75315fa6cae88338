"""The ingress's section of the config (``cluster/config.py``): HTTP mode and transport, request
bounds, timeouts and slowloris limits, API keys, and what one ingress replica admits at once
(``AdmissionConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from cluster.serve_options import DeploymentOptions
from cluster.serve_options import StrictModel as _Strict


class AdmissionConfig(_Strict):
    """Per ingress replica: what it takes in at once, by count and by cost (router/routing/admission.py).

    A request costs 1, plus ``media_cost`` per media item, plus 1 per ``text_chars_per_cost``
    characters of text; past either bound the client gets 503 ``overloaded`` with ``Retry-After``.
    Before that, the bytes of the request bodies it holds (being read, or their requests served) are
    bounded by ``max_body_bytes_in_flight``: a body's ``Content-Length`` is reserved before it is read.
    """

    max_concurrent_requests: int = Field(256, ge=1)
    max_concurrent_cost: int = Field(1024, ge=1)
    media_cost: dict[str, int] = Field(default_factory=lambda: {"image": 4, "video": 16, "audio": 4})
    text_chars_per_cost: int = Field(4096, ge=1)
    retry_after_s: int = Field(1, ge=1)
    # Request bodies held at once per ingress replica, in bytes (4 bodies at the 64 MiB request bound);
    # one larger than this is let in only alone. Past it: 503 before the body is read.
    max_body_bytes_in_flight: int = Field(256 * 1024 * 1024, ge=1)


class IngressConfig(_Strict):
    http_mode: Literal["proxy", "direct"] = Field(
        "proxy",
        description="proxy: HTTP through Serve's proxy (what a Kubernetes Service targets); direct: each "
        "ingress replica serves HTTP itself on host:port (SO_REUSEPORT), no proxy — `mmserve serve`'s default",
    )
    transport: Literal["auto", "serve"] = Field(
        "auto",
        description="how the ingress calls a pool (prepare, submit): auto sends them as frames on a plain "
        "long-lived socket to a pool that runs exactly one replica (mmcore/link/direct_link.py) and through "
        "Serve's handles to any other, and the encoder-cache shards' hot calls on such links too; serve: "
        "always through Serve's handles and actor calls, no side channel listens",
    )
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1)
    max_messages: int = Field(256, ge=1)
    max_content_parts: int = Field(64, ge=1)
    max_json_values: int = Field(
        16_384,
        ge=16,
        description="array elements + object members a request body may hold (counted before parsing)",
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0,
        description="end to end per request; past it a 504 and its reservations and KV blocks are freed",
    )
    # direct HTTP (router/http/listener.py ConnectionLimits), against slowloris: a request's head within
    # header_timeout_s and max_header_bytes of its first byte, else the connection is closed; past
    # max_connections open connections (or requests running) a 503
    header_timeout_s: float = Field(10.0, gt=0)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    max_connections: int = Field(4096, ge=1)
    api_key: SecretStr | None = Field(
        None, description="one API key (tenant `default`), as `vllm serve --api-key`; also MMSERVE_API_KEY"
    )
    api_keys_file: str | None = Field(
        None, description="YAML/JSON mapping API key -> tenant name, read by each ingress replica at start"
    )
    operator_api_key: SecretStr | None = Field(
        None,
        description="the key that alone sees /stats (counters across tenants) where API keys are on; "
        "also MMSERVE_OPERATOR_API_KEY",
    )
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
