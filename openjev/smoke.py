"""`openjev smoke URL`: one command that says whether a deployment really answers. It waits out the
startup 503s, runs the contract checks and a few semantic ones, and writes what it saw to a JSON file."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from openjev.client import RETRY_STATUSES, TERMINAL_JOB_STATUSES, retry_after

T = TypeVar("T")

OFFICIAL_MAX_OPTIONS = 255
RETRY_FOR_S = 60.0  # how long one check keeps retrying 429/503/529 once the server has been ready
JOB_WAIT_S = 30  # the longest `wait` the jobs API accepts per poll

REFUND_STATE = "Hi, I was charged twice for my March invoice. Please give me my money back."
BILLING_STATE = "My last invoice charged my card twice for the same subscription. Who can fix my bill?"
NOUL = {"type": "noul", "instructions": "Is the customer asking for money back?"}
TEAM = {"type": "choice", "instructions": "Which team should handle this message?",
        "criteria": {"Billing": "Payments, invoices, refunds and charges",
                     "Technical": "Bugs, outages, error messages and passwords",
                     "Sales": "New plans, quotes and upgrades"}}
SCORE = {"type": "score", "instructions": "How frustrated is the customer?",
         "criteria": ["Calm", "Annoyed", "Furious"]}
TARGET_OPTION = ("Billing", "Payments, invoices, refunds and double charges")
FILLER_TOPICS = ("Gardening", "Astronomy", "Fishing", "Poetry", "Chess", "Pottery", "Sailing", "Knitting",
                 "Volcanoes", "Origami", "Beekeeping", "Archery", "Birdwatching", "Juggling", "Calligraphy")


@dataclass
class CheckResult:
    """What one check saw; `outcome` is "recorded" for a semantic miss under --allow-weak-model."""

    name: str
    passed: bool
    outcome: str  # "pass" | "fail" | "recorded"
    semantic: bool  # carries an expectation about answer quality, not only the contract
    status: int | None = None
    latency_s: float | None = None  # the answering attempt (the async check: submit to result)
    attempts: int = 0
    prefix_tokens: int | None = None  # x-openjev-prefix-tokens; None when the header is absent
    cached_tokens: int | None = None  # x-openjev-cached-tokens; None when absent, never a made-up 0
    request_id: str | None = None
    detail: str = ""


@dataclass
class Exchange:
    """One HTTP answer and how long it took."""

    response: httpx.Response
    latency_s: float
    attempts: int

    def body(self) -> Any:
        try:
            return self.response.json()
        except ValueError:
            return None


@dataclass
class Startup:
    """How the wait for the server's readiness went."""

    ready: bool = False
    wait_s: float = 0.0
    polls: int = 0
    last_status: int | None = None
    last_error: str | None = None
    health: dict[str, Any] | None = None


@dataclass
class Outcome:
    """The problems a check found: contract ones always fail it, semantic ones may only be recorded."""

    contract: list[str] = field(default_factory=list)
    semantic: list[str] = field(default_factory=list)


class SmokeClient:
    """HTTP to the server under test: bearer auth, and bounded retries while it answers 429, 503 or 529."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, follow_redirects=True)

    def send(self, method: str, path: str, retry_for: float = RETRY_FOR_S, **kwargs: Any) -> Exchange:
        """One request, retried on 429/503/529 (after their Retry-After) and connection errors for up to
        `retry_for` seconds."""
        deadline = time.monotonic() + retry_for
        attempts = 0
        while True:
            attempts += 1
            started = time.perf_counter()
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
                continue
            exchange = Exchange(response, time.perf_counter() - started, attempts)
            if response.status_code not in RETRY_STATUSES or time.monotonic() >= deadline:
                return exchange
            time.sleep(_retry_after(response))

    def wait_until_ready(self, timeout: float) -> Startup:
        """Poll /health until it answers 200 or `timeout` seconds pass."""
        startup = Startup()
        started = time.monotonic()
        while True:
            startup.polls += 1
            pause = 1.0
            try:
                response = self.http.get("/health", timeout=min(30.0, max(1.0, timeout)))
                startup.last_status = response.status_code
                if response.status_code == 200:
                    startup.ready, startup.health = True, _json_or_none(response)
                    break
                pause = _retry_after(response)
            except httpx.HTTPError as error:
                startup.last_error = f"{type(error).__name__}: {error}"
            if time.monotonic() - started + pause > timeout:
                break
            time.sleep(pause)
        startup.wait_s = round(time.monotonic() - started, 3)
        return startup

    def close(self) -> None:
        self.http.close()


class SmokeRun:
    """The checks, in order, against one server."""

    def __init__(self, client: SmokeClient, allow_weak_model: bool) -> None:
        self.client = client
        self.allow_weak_model = allow_weak_model
        self.checks: list[CheckResult] = []
        self.model = "jev-latest"
        self.max_options: int | None = None

    def run(self) -> None:
        """Run every check; each records its own result, so one failure never hides the others."""
        for check in (self.check_limits, self.check_models, self.check_question_types, self.check_many_options,
                      self.check_too_many_options, self.check_multi_question, self.check_async_job,
                      self.check_semantics):
            check()

    def check_limits(self) -> None:
        self.max_options = self._read_listing("limits", "max_options", "max_options missing or invalid", "max_options",
                                              lambda value: value if isinstance(value, int) and value >= 2 else None)

    def check_models(self) -> None:
        def first_name(models: Any) -> str | None:
            named = isinstance(models, list) and models and isinstance(models[0], dict) and "name" in models[0]
            return str(models[0]["name"]) if named else None

        self.model = self._read_listing("models", "models", "no models listed", "model", first_name) or self.model

    def check_question_types(self) -> None:
        for name, question in (("noul", NOUL), ("choice", TEAM), ("score", SCORE)):
            self._evaluate(name, REFUND_STATE, {"q": question})

    def check_many_options(self) -> None:
        limit = self.max_options or OFFICIAL_MAX_OPTIONS
        for count in sorted({min(64, limit), min(OFFICIAL_MAX_OPTIONS, limit)}):
            question = {"type": "choice", "instructions": TEAM["instructions"], "criteria": many_options(count)}
            self._evaluate(f"choice_{count}_options", REFUND_STATE, {"q": question},
                           expect=_expect_choice("q", TARGET_OPTION[0]))

    def check_too_many_options(self) -> None:
        name = "too_many_options_rejected"
        if self.max_options is None:
            self._fail(name, "skipped for want of max_options from /v1/limits")
            return
        options = {f"Option {i}": None for i in range(self.max_options + 1)}
        body = self._body(REFUND_STATE, {"q": {"type": "choice", "criteria": options}})
        exchange = self._exchange(name, "POST", "/v1/systemone", json=body)
        if exchange is None:
            return
        problems = _status_problems(exchange, 422)
        rejection = exchange.body()
        if not problems and not (isinstance(rejection, dict) and isinstance(rejection.get("detail"), list)):
            problems.append("a 422 must carry the validation format {detail: [...]}")
        self._record(name, exchange, Outcome(problems), detail=f"{self.max_options + 1} options")

    def check_multi_question(self) -> None:
        self._evaluate("multi_question", REFUND_STATE, {"refund": NOUL, "team": TEAM, "anger": SCORE})

    def check_async_job(self) -> None:
        name = "async_job"
        questions = {"refund": NOUL, "team": TEAM}
        submitted = self._exchange(name, "POST", "/v1/jobs", json=self._body(REFUND_STATE, questions))
        if submitted is None:
            return
        created = submitted.body()
        if submitted.response.status_code != 202 or not isinstance(created, dict) or "id" not in created:
            self._record(name, submitted, Outcome([f"submit answered {submitted.response.status_code}, "
                                                   f"expected 202 with an id: {_excerpt(submitted.response)}"]))
            return
        location = submitted.response.headers.get("location") or f"/v1/jobs/{created['id']}"
        self._poll_job(name, location, questions, started=time.perf_counter() - submitted.latency_s)

    def check_semantics(self) -> None:
        self._evaluate("refund_is_a_money_back_request", REFUND_STATE, {"refund": NOUL}, semantic=True,
                       expect=_expect_noul("refund"))
        self._evaluate("billing_complaint_routes_to_billing", BILLING_STATE, {"team": TEAM}, semantic=True,
                       expect=_expect_choice("team", "Billing"))

    def _poll_job(self, name: str, location: str, questions: dict[str, Any], started: float) -> None:
        deadline = time.monotonic() + 10 * JOB_WAIT_S
        while True:
            exchange = self._exchange(name, "GET", location, params={"wait": JOB_WAIT_S},
                                      timeout=JOB_WAIT_S + 30)
            if exchange is None:
                return
            job = exchange.body()
            status = job.get("status") if isinstance(job, dict) else None
            if exchange.response.status_code != 200 or status in TERMINAL_JOB_STATUSES or time.monotonic() > deadline:
                break
        exchange.latency_s = time.perf_counter() - started
        problems = _status_problems(exchange, 200)
        if not problems and status != "succeeded":
            problems.append(f"job ended {status!r}: {job.get('error') if isinstance(job, dict) else job}")
        if not problems:
            problems += response_problems(job.get("result"), questions)
        self._record(name, exchange, Outcome(problems), detail=f"job status {status}")

    def _evaluate(self, name: str, state: str, questions: dict[str, Any], semantic: bool = False,
                  expect: Callable[[dict[str, Any]], list[str]] | None = None) -> None:
        exchange = self._exchange(name, "POST", "/v1/systemone", json=self._body(state, questions))
        if exchange is None:
            return
        outcome = Outcome(_status_problems(exchange, 200))
        body = exchange.body()
        if not outcome.contract:
            outcome.contract += response_problems(body, questions)
        if not outcome.contract and expect is not None:
            outcome.semantic += expect(body)
        self._record(name, exchange, outcome, semantic=semantic or expect is not None)

    def _read_listing(self, name: str, key: str, problem: str, label: str, pick: Callable[[Any], T | None]) -> T | None:
        """GET /v1/`name` as the check `name`: it passes when the status is 200 and `pick` finds what it wants in
        the body's `key`; returns what it found (None where it found nothing)."""
        exchange = self._exchange(name, "GET", f"/v1/{name}")
        if exchange is None:
            return None
        body = exchange.body()
        value = body.get(key) if isinstance(body, dict) else None
        found = pick(value)
        problems = _status_problems(exchange, 200)
        if found is None:
            problems.append(f"{problem}: {value!r}"[:300])
        self._record(name, exchange, Outcome(problems), detail=f"{label}={found if found is not None else value}")
        return found

    def _exchange(self, name: str, method: str, path: str, **kwargs: Any) -> Exchange | None:
        try:
            return self.client.send(method, path, **kwargs)
        except httpx.HTTPError as error:
            self._fail(name, f"{method} {path}: {type(error).__name__}: {error}")
            return None

    def _body(self, state: str, questions: dict[str, Any]) -> dict[str, Any]:
        return {"model": self.model, "state": state, "questions": questions}

    def _record(self, name: str, exchange: Exchange, outcome: Outcome, semantic: bool = False,
                detail: str = "") -> None:
        headers = exchange.response.headers
        result = CheckResult(
            name=name, passed=not outcome.contract and not outcome.semantic,
            outcome=self._verdict(outcome), semantic=semantic, status=exchange.response.status_code,
            latency_s=round(exchange.latency_s, 4), attempts=exchange.attempts,
            prefix_tokens=_int_header(headers, "x-openjev-prefix-tokens"),
            cached_tokens=_int_header(headers, "x-openjev-cached-tokens"),
            request_id=headers.get("x-typesafe-request-id"),
            detail="; ".join(filter(None, [*outcome.contract, *outcome.semantic, detail])))
        self._add(result)

    def _verdict(self, outcome: Outcome) -> str:
        if outcome.contract or (outcome.semantic and not self.allow_weak_model):
            return "fail"
        return "recorded" if outcome.semantic else "pass"

    def _fail(self, name: str, detail: str) -> None:
        self._add(CheckResult(name=name, passed=False, outcome="fail", semantic=False, detail=detail))

    def _add(self, result: CheckResult) -> None:
        self.checks.append(result)
        tokens = f"prefix={result.prefix_tokens} cached={result.cached_tokens}"
        latency = f"{result.latency_s:.3f} s" if result.latency_s is not None else "-"
        print(f"{result.outcome.upper():8} {result.name:40} {latency:>10}  {tokens}  {result.detail}", flush=True)


def run_smoke(url: str, *, key_env: str | None = None, allow_weak_model: bool = False,
              out: Path | str = "smoke-result.json", startup_timeout: float = 600.0,
              request_timeout: float = 180.0) -> int:
    """Check the openjev server at `url` and write the result to `out`; 0 iff every enforced check passed.

    `key_env`: the environment variable that holds the API key. `allow_weak_model`: semantic checks are
    recorded but never fail the run. `startup_timeout`: seconds to wait for /health to answer 200.
    """
    api_key = os.environ.get(key_env) if key_env else None
    if key_env and not api_key:
        print(f"openjev smoke: the environment variable {key_env} is not set", file=sys.stderr)
        return 2
    started_at = datetime.now(UTC)
    client = SmokeClient(url, api_key, request_timeout)
    try:
        startup = client.wait_until_ready(startup_timeout)
        run = SmokeRun(client, allow_weak_model)
        if startup.ready:
            run.run()
        else:
            print(f"FAIL     not ready within {startup_timeout:g} s (last status {startup.last_status}, "
                  f"{startup.last_error or 'no connection error'})", flush=True)
    finally:
        client.close()
    report = smoke_report(url, started_at, startup, run, allow_weak_model)
    Path(out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"{'PASSED' if report['passed'] else 'FAILED'}: {report['summary']} in {report['duration_s']:.1f} s "
          f"(startup wait {startup.wait_s:.1f} s); wrote {out}", flush=True)
    return report["exit_code"]


def smoke_report(url: str, started_at: datetime, startup: Startup, run: SmokeRun,
                 allow_weak_model: bool) -> dict[str, Any]:
    """The JSON document `run_smoke` writes."""
    outcomes = [check.outcome for check in run.checks]
    passed = startup.ready and bool(outcomes) and "fail" not in outcomes
    finished_at = datetime.now(UTC)
    return {
        "url": url,
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round((finished_at - started_at).total_seconds(), 3),
        "allow_weak_model": allow_weak_model,
        "ready": startup.ready,
        "startup_wait_s": startup.wait_s,
        "startup": asdict(startup),
        "model": run.model if startup.ready else None,
        "max_options": run.max_options,
        "passed": passed,
        "exit_code": 0 if passed else 1,
        "summary": {kind: outcomes.count(kind) for kind in ("pass", "fail", "recorded")},
        "checks": [asdict(check) for check in run.checks],
    }


def many_options(count: int) -> dict[str, str | None]:
    """`count` options where one (`TARGET_OPTION`, in the middle) clearly fits the refund request."""
    fillers = (f"{FILLER_TOPICS[i % len(FILLER_TOPICS)]} club {i // len(FILLER_TOPICS) + 1}"
               for i in range(count - 1))
    options: dict[str, str | None] = dict.fromkeys(fillers)
    names = list(options)
    names.insert(count // 2, TARGET_OPTION[0])
    return {name: TARGET_OPTION[1] if name == TARGET_OPTION[0] else None for name in names}


def response_problems(body: Any, questions: dict[str, Any]) -> list[str]:
    """Where a /v1/systemone body breaks the contract for `questions`; empty when it holds."""
    if not isinstance(body, dict):
        return ["the body is not a JSON object"]
    problems = [f"unexpected top-level field {key!r}" for key in body
                if key not in ("model", "answers", "usage") and not key.startswith("x_")]
    usage = body.get("usage")
    if not (isinstance(usage, dict) and all(type(usage.get(k)) is int for k in ("input_tokens", "output_tokens"))):
        problems.append(f"usage must hold integer input_tokens and output_tokens: {usage!r}")
    answers = body.get("answers")
    if not isinstance(answers, dict) or set(answers) != set(questions):
        return [*problems, f"answers {sorted(answers) if isinstance(answers, dict) else answers!r} "
                           f"do not match the questions {sorted(questions)}"]
    for qid, question in questions.items():
        problems += [f"{qid}: {p}" for p in answer_problems(answers[qid], question)]
    return problems


def answer_problems(answer: Any, question: dict[str, Any]) -> list[str]:
    """Where one answer breaks the contract for its question type."""
    if not isinstance(answer, dict):
        return ["the answer is not an object"]
    kind = question["type"]
    keys = {key for key in answer if not key.startswith("x_")}
    expected = {"noul": {"type", "noul"}, "choice": {"type", "choice", "probabilities", "confidence"},
                "score": {"type", "score", "legend", "probabilities", "confidence"}}[kind]
    if keys != expected or answer["type"] != kind:
        return [f"keys {sorted(keys)} (type {answer.get('type')!r}), expected {sorted(expected)}"]
    if kind == "noul":
        return [] if _unit(answer["noul"]) else [f"noul {answer['noul']!r} is not in [0, 1]"]
    problems = [] if _unit(answer["confidence"]) else [f"confidence {answer['confidence']!r} is not in [0, 1]"]
    if kind == "choice":
        return problems + _choice_problems(answer, list(question["criteria"]))
    return problems + _score_problems(answer, list(question["criteria"]))


def _choice_problems(answer: dict[str, Any], options: list[str]) -> list[str]:
    probabilities = answer["probabilities"]
    if not isinstance(probabilities, dict) or set(probabilities) != set(options):
        return ["probabilities are not keyed by exactly the option names"]
    problems = _distribution_problems(probabilities)
    if not problems and answer["choice"] != max(probabilities, key=probabilities.__getitem__):
        problems.append(f"choice {answer['choice']!r} is not the most probable option")
    return problems


def _score_problems(answer: dict[str, Any], levels: list[Any]) -> list[str]:
    probabilities = answer["probabilities"]
    keys = [str(i) for i in range(len(levels))]
    if not isinstance(probabilities, dict) or sorted(probabilities, key=int) != keys:
        return [f"probabilities must be keyed {keys}"]
    problems = _distribution_problems(probabilities)
    if answer["legend"] != dict(zip(keys, levels, strict=True)):
        problems.append("legend does not echo the levels")
    expected = sum(i * p for i, p in enumerate(probabilities[k] for k in keys)) if not problems else None
    if expected is not None and not math.isclose(answer["score"], expected, abs_tol=1e-6):
        problems.append(f"score {answer['score']!r} is not the expected level {expected:.6f}")
    return problems


def _distribution_problems(probabilities: dict[str, Any]) -> list[str]:
    values = list(probabilities.values())
    if not all(_unit(p) for p in values):
        return ["a probability is not a number in [0, 1]"]
    total = sum(values)
    return [] if math.isclose(total, 1.0, abs_tol=1e-6) else [f"probabilities sum to {total:.6f}, not 1"]


def _expect_noul(qid: str) -> Callable[[dict[str, Any]], list[str]]:
    def expect(body: dict[str, Any]) -> list[str]:
        noul = body["answers"][qid]["noul"]
        return [] if noul > 0.5 else [f"semantic: noul {noul:.3f} should be > 0.5"]

    return expect


def _expect_choice(qid: str, target: str) -> Callable[[dict[str, Any]], list[str]]:
    def expect(body: dict[str, Any]) -> list[str]:
        answer = body["answers"][qid]
        if answer["choice"] == target:
            return []
        chosen = answer["choice"]
        return [f"semantic: chose {chosen!r} (p={answer['probabilities'][chosen]:.3f}) over {target!r} "
                f"(p={answer['probabilities'][target]:.3f})"]

    return expect


def _status_problems(exchange: Exchange, expected: int) -> list[str]:
    status = exchange.response.status_code
    return [] if status == expected else [f"status {status}, expected {expected}: {_excerpt(exchange.response)}"]


def _unit(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0


def _int_header(headers: httpx.Headers, name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _retry_after(response: httpx.Response) -> float:
    return retry_after(response, default=1.0, floor=0.2, ceiling=5.0)


def _json_or_none(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _excerpt(response: httpx.Response) -> str:
    return response.text[:300].replace("\n", " ")
