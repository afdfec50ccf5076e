"""Every knob of openjev, read once from `OPENJEV_*` environment variables and passed down."""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Frontend(StrEnum):
    rust = "rust"  # SGLANG_RUST_SERVER=1: the faster HTTP frontend (reports cached_tokens from 0.5.23)
    python = "python"  # the explicit fallback


class SglangDevice(StrEnum):
    cuda = "cuda"  # GPUs (production)
    cpu = "cpu"  # SGLang's CPU engine, torch-native attention, float32 (the `sglang` test tier, laptops)


class RoutingPolicy(StrEnum):
    hash = "hash"  # rendezvous hashing of the prefix key with a bounded-load fallback (production)
    round_robin = "round_robin"  # each live worker in turn, prefixes ignored (a benchmark baseline)


class ConfidenceMode(StrEnum):
    typesafe = "typesafe"  # the official formulas of the contract
    entropy = "entropy"  # clamp(1 - H(p) / ln n, 0, 1)


class PromptStyle(StrEnum):
    inline = "inline"  # "Answer:" then the label with its leading space (" A"): the default
    newline = "newline"  # "Answer:", a newline, then the bare label ("A"): the alternative measured against it


class Settings(BaseSettings):
    """The whole configuration. Build it once (`get_settings()`) and pass it down."""

    model_config = SettingsConfigDict(env_prefix="OPENJEV_", extra="ignore")

    # The model and how SGLang serves it (the original design's settings).
    model: str = "nvidia/Qwen3.6-35B-A3B-NVFP4"
    served_model_name: str = "Qwen/Qwen3.6-35B-A3B"
    revision: str | None = None
    frontend: Frontend = Frontend.rust
    sglang_device: SglangDevice = Field(
        default=SglangDevice.cuda, description="Where a launched SGLang computes; cpu adds the CPU engine's flags.")
    sglang_max_total_tokens: int | None = Field(
        default=None, ge=16, description="A launched SGLang's KV cache pool in tokens (--max-total-tokens). Unset: "
        "SGLang sizes it from free memory on a GPU; on the cpu device, 2 x the context length.")
    tokenizer: str | None = Field(
        default=None, description="Tokenizer path or hub id; defaults to `model`. Must match the engine's."
    )
    model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["jev-*"],
        description="Model names a request may send besides the served one, comma-separated; a trailing `*` "
        "accepts every name it begins (the default `jev-*`: jev-latest and every pinned jev-1.13.0, jev-preview…).")
    model_release_date: str = Field(default="2026-04-16", description="`release_date` reported by /v1/models.")

    # The front door: limits the API server enforces on every connection (`openjev api`), in nginx's spirit.
    max_header_bytes: int = Field(default=32768, ge=1024, description="Request line and headers; beyond: 431.")
    header_timeout: float = Field(default=10.0, gt=0, description="Seconds for a request's headers to arrive; "
                                  "beyond: 408 and the connection is closed.")
    body_timeout: float = Field(default=30.0, gt=0, description="Seconds for a request's whole body to arrive; "
                                "beyond: 408.")
    keep_alive_timeout: int = Field(default=75, ge=1, description="Seconds an idle keep-alive connection is kept.")
    max_connections: int = Field(default=1024, ge=1, description="Open connections; one more is answered 503.")

    # Admission limits, enforced in the API before any GPU work.
    max_input_tokens: int = Field(default=32768, ge=16, description="Per branch, including the output token.")
    max_total_input_tokens: int = Field(default=262144, ge=16, description="All tokens sent, warm + branches.")
    max_concurrent_requests: int = Field(default=16, ge=1, description="Jobs a worker runs at once.")
    max_concurrent_branches: int = Field(default=64, ge=1, description="Branch calls a worker has in flight.")
    max_questions: int = Field(default=64, ge=1)
    max_options: int = Field(default=255, ge=2)
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024, description="After decompression.")
    request_timeout: float = Field(default=120.0, gt=0, description="Seconds, end to end, for a sync request.")
    job_timeout: float = Field(default=600.0, gt=0, description="Seconds from submission for an async job.")
    job_result_ttl: int = Field(default=3600, ge=1, description="Seconds a finished job's record is kept.")

    # Answers.
    temperature: float = Field(default=1.0, gt=0)
    confidence: ConfidenceMode = ConfidenceMode.typesafe

    # Answer quality (bench/quality.py measures both).
    debias: bool = Field(default=False, description="Average each choice/score answer over cyclic rotations of its "
                         "options (label-order debiasing); a request's `x_debias` overrides it.")
    debias_max_rotations: int = Field(default=8, ge=2, description="Rotations per question when debiasing: "
                                      "min(options, this); below the option count invariance is approximate.")
    option_group_size: int = Field(
        default=0, ge=0, description="Ask a choice question with more options than this in two rounds: groups of "
        "this many, then the groups' winners (for models that lose the thread in a long list); 0: one branch "
        "per question. `openjev serve --model qwen2.5-1.5b` sets 64.")
    prompt_style: PromptStyle = Field(default=PromptStyle.inline, description="How the answer label follows the "
                                      "answer marker; bench/quality.py measures either.")
    calibration: Path | None = Field(default=None, description="A file from `openjev calibrate`: fitted "
                                     "temperatures (per type, option count or question) applied to each answer's "
                                     "distribution.")

    # Secrets: never logged.
    api_key: SecretStr | None = Field(default=None, description="One tenant's Bearer key (the `default` tenant).")
    api_keys_file: Path | None = Field(
        default=None, description="A TOML file of tenants (`[tenants.NAME]` with `key` or `key_sha256`, limits and "
        "weight; common/tenants.py), re-read when it changes or on SIGHUP. Instead of OPENJEV_API_KEY.")
    backend_api_key: SecretStr | None = None
    job_id_secret: SecretStr | None = Field(
        default=None, description="Key of the tag in job ids (common/jobs.py), the same on every API replica; "
        "unset: derived from the Redis URL and OPENJEV_REDIS_PASSWORD, which every replica shares and which hold the "
        "Redis password.")

    # Routing jobs to workers (common/routing.py).
    route_prefix_tokens: int | None = Field(
        default=None, ge=1, description="Hash only the first K prefix tokens, so states that share a long system "
        "prompt land together; None hashes the whole prefix. K must exceed the template's fixed opening.")
    route_load_factor: float = Field(
        default=1.25, ge=1.0,
        description="c: a worker whose jobs waiting for a slot, with the new job, would exceed ⌈c × the average⌉ "
        "is passed over for the next in the prefix's ranking.")
    routing: RoutingPolicy = Field(default=RoutingPolicy.hash, description="round_robin: a baseline for benchmarks.")

    # Plumbing.
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: SecretStr | None = Field(
        default=None, description="Redis's password when OPENJEV_REDIS_URL carries none (e.g. from a Kubernetes "
        "Secret); a password in the URL wins. With Sentinels it opens the Sentinels too.")
    redis_sentinels: Annotated[list[tuple[str, int]], NoDecode] = Field(
        default_factory=list, description="host:port,... of the Sentinels that name the Redis master; when set, "
        "OPENJEV_REDIS_URL gives only the password and database, and every process follows a failover.")
    redis_sentinel_master: str = Field(default="openjev", description="The master's name at the Sentinels.")
    redis_maxmemory: str | None = Field(
        default=None, pattern=r"^[0-9]+([kKmMgG][bB]?|[bB])?$", description="`serve`'s embedded Redis's maxmemory, "
        "as Redis reads it (bytes, or 512mb, 4gb; 0: no limit); unset: 1gb. compose's Redis reads the same "
        "variable (its default: 4gb); a Redis the project does not start keeps its own.")
    redis_headroom: float = Field(
        default=0.1, ge=0, lt=1, description="The share of Redis's maxmemory kept for the jobs already accepted to "
        "start and end: past the rest the API takes no new async job (503, the queue is full), and sync requests may "
        "use half of it. 0: new jobs until Redis refuses a write, when accepted jobs wait for keys to expire or the "
        "limit to be raised.")
    api_presence_ttl: float = Field(
        default=20.0, ge=1, le=600, description="Seconds an API process stays counted as live without renewing "
        "its presence in Redis (it renews five times within this). A worker does not start a sync job that waited "
        "longer than four fifths of this and whose API is no longer live (crashed, or cut off from Redis): nobody "
        "is left to answer it. A live API's presence never lapses whatever the workers' value, so a value that "
        "differs between them only moves when a job is looked at.")
    engine_url: str = "http://127.0.0.1:30000"
    worker_id: str | None = Field(default=None, description="Defaults to hostname-pid.")
    worker_poll_delay: float = Field(
        default=4.0, gt=0, le=5.0, description="Seconds between a worker's looks at its queue (worker/wakeups.py) "
        "and at aborts (arq's poll_delay), the fallback for wake-ups it missed: new and cancelled jobs reach it at "
        "once; see bench/RESULTS-cpu.md for its cost at rest.")
    worker_wakeups: bool = Field(
        default=True, description="Listen on the queue's wake channel (Redis pub/sub) so new and cancelled jobs "
        "reach the worker at once; false for a Redis that refuses SUBSCRIBE (jobs then start on the look at the "
        "queue alone), and then set a short poll delay.")
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "openjev")
    cpu_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        default="auto", description="The CPU engine's dtype; auto: bfloat16 where the CPU has bf16 instructions, "
        "else float32; int8: most linear layers dynamically quantized, faster on AVX2 at a measured cost in answers.")
    redis_dir: Path | None = Field(
        default=None, description="Where `serve`'s embedded Redis keeps its append-only file and password; "
        "defaults to <cache_dir>/redis. One Redis per directory.")
    branch_max_new_tokens: int = Field(default=1, ge=0, le=1, description="0 = prefill-only where supported.")
    branch_batch_size: int = Field(
        default=64, ge=1, description="The most branches a worker sends in one batched /generate call (SGLang's "
        "list form); 1 sends one call per branch.")
    engine_max_answer_bytes: int = Field(
        default=1024 * 1024, ge=4096, description="The most response bytes the worker reads per prompt of an "
        "engine call; a bigger answer fails the job with 502 engine_error.")
    engine_call_limit: float = Field(
        default=300.0, gt=0, description="Seconds one engine call may go unanswered before the worker counts the "
        "engine as hung and runs the job again (elsewhere, or once the engine answers); the job's deadline still "
        "bounds it.")
    sglang_version: str | None = Field(default=None, description="e.g. 0.5.19 enables the #34719 workaround.")
    engine_health_interval: float = Field(default=2.0, gt=0, description="Seconds between engine health probes.")
    engine_health_timeout: float = Field(
        default=30.0, gt=0, description="Seconds a health probe waits; SGLang's /health may take 20 s under load.")

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _split_aliases(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [a.strip() for a in text.split(",") if a.strip()]
        return value

    @field_validator("redis_sentinels", mode="before")
    @classmethod
    def _split_sentinels(cls, value: object) -> object:
        if isinstance(value, str):
            pairs = [item.strip().rsplit(":", 1) for item in value.split(",") if item.strip()]
            if any(len(pair) != 2 or not pair[1].isdigit() for pair in pairs):
                raise ValueError("Sentinels are host:port pairs separated by commas")
            return [(host, int(port)) for host, port in pairs]
        return value

    @field_validator("option_group_size")
    @classmethod
    def _group_of_two_or_more(cls, value: int) -> int:
        if value == 1:
            raise ValueError("a group needs at least 2 options (0 turns grouping off)")
        return value

    def accepts_model(self, name: str) -> bool:
        """Whether a request may name `name`: the served model, an alias, or a name an alias pattern begins."""
        if name == self.served_model_name or name in self.model_aliases:
            return True
        return any(a.endswith("*") and name.startswith(a[:-1]) for a in self.model_aliases)

    def describe_accepted_models(self) -> str:
        """The names a request may send, in words: the exact ones, then each `prefix*` pattern as a rule."""
        rules = [f"any name beginning `{a[:-1]}` (a pinned version such as `{a[:-1]}1.13.0` too)"
                 if a == "jev-*" else f"any name beginning `{a[:-1]}`" for a in self.model_aliases if a.endswith("*")]
        return ", ".join(f"`{name}`" for name in self.listed_model_names) + "".join(f"; {rule}" for rule in rules)

    @property
    def listed_model_names(self) -> list[str]:
        """The names /v1/models lists: the served model, then `jev-latest` and every exact alias accepted."""
        names = [self.served_model_name]
        for name in ["jev-latest", *self.model_aliases]:
            if not name.endswith("*") and name not in names and self.accepts_model(name):
                names.append(name)
        return names

    @property
    def longest_job_seconds(self) -> float:
        """No job, sync or async, can live longer than this from submission to deadline."""
        return max(self.request_timeout, self.job_timeout)

    @property
    def job_id_key(self) -> bytes:
        """The key that tags job ids: `job_id_secret`, or one derived from `redis_url`."""
        if self.job_id_secret is not None:
            return self.job_id_secret.get_secret_value().encode()
        password = self.redis_password.get_secret_value() if self.redis_password is not None else ""
        return hashlib.sha256(b"openjev job ids\0" + self.redis_url.encode() + b"\0" + password.encode()).digest()

    @property
    def tokenizer_source(self) -> str:
        return self.tokenizer or self.model

    @property
    def embedded_redis_dir(self) -> Path:
        return self.redis_dir or self.cache_dir / "redis"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    return Settings()
