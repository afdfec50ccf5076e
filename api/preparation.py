"""From the request body to a `JobSpec`: the body BodyGate parsed validated into the contract's request
(`request_body`, the routes' dependency), limits, the prompt compiled and tokenized once, token budgets
checked. Everything here runs before any GPU work, and refuses with a 4xx."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.errors import UnknownModel, invalid
from api.strict_json import PARSED_BODY
from common.calibration import Calibration, question_key
from common.contract import EXAMPLE_REQUEST, ChoiceQuestion, NoulQuestion, ScoreQuestion, SystemOneRequest
from common.jobs import GROUPED_JOB_RECORD_VERSION, JOB_RECORD_VERSION, Branch, JobIds, JobSpec
from common.prompt import CompiledPrompt, PrefixTooLong, PromptCompiler, UnsupportedContent
from common.routing import prefix_key
from common.settings import Settings

INLINE_PREPARE_BYTES = 1024
"""A body of at most this many bytes is prepared on the event loop: rendering and tokenizing it takes 0.1-0.7 ms,
less than a worker thread's hand-off costs (a tenth of the API's CPU per README request, issue 29). A larger one
is prepared in a worker thread, so that the loop never waits on a long state (4,000 characters: ~3 ms)."""

REQUEST_BODY_DOC: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/SystemOneRequest"}, "examples": {"ticket": {"value": EXAMPLE_REQUEST}}}}}}
"""The routes' `openapi_extra`: the body `request_body` reads, as FastAPI would document a body parameter
(api/openapi.py adds the models' schemas to the components)."""


async def request_body(request: Request) -> SystemOneRequest:
    """The route's SystemOneRequest, validated from the value BodyGate already parsed: the body is read as
    JSON once. Validation errors keep FastAPI's shape (a 422 with `loc` under "body")."""
    # BodyGate parses every JSON body and refuses any other non-empty one (415): nothing parsed is no body.
    value = getattr(request.state, PARSED_BODY, None)
    if value is None:  # no body, or `null`: as FastAPI answers a missing body
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        return SystemOneRequest.model_validate(value)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in exc.errors(include_url=False)]) from None


class JobPreparer:
    """Checks a request against the limits in force and compiles it into a job record."""

    def __init__(self, settings: Settings, compiler: PromptCompiler) -> None:
        """Reads the calibration file named by the settings, if any (CalibrationError if unusable)."""
        self.settings = settings
        self.compiler = compiler
        self.job_ids = JobIds(settings.job_id_key)
        self.calibration = Calibration.load(settings.calibration) if settings.calibration else Calibration()

    @property
    def max_options(self) -> int:
        """Options a question may have: the configured limit, or fewer if the tokenizer has fewer labels."""
        return min(self.settings.max_options, self.compiler.alphabet.capacity)

    def check_request(self, request: SystemOneRequest) -> None:
        """Model name and size limits; cheap, so run before tokenizing anything."""
        if not self.settings.accepts_model(request.model):
            raise UnknownModel(request.model, self.settings.describe_accepted_models())
        if len(request.questions) > self.settings.max_questions:
            raise invalid(["questions"], f"{len(request.questions)} questions exceed the limit of "
                          f"{self.settings.max_questions} per request; split the request")
        for qid, question in request.questions.items():
            options = _option_count(question)
            if options > self.max_options:
                raise invalid(["questions", qid, "criteria"], f"{options} options exceed the limit of "
                              f"{self.max_options} per question")

    async def prepare_for(self, http: Request, request: SystemOneRequest, timeout: float) -> JobSpec:
        """`prepare` the request `http` carried, on the event loop for a body of at most INLINE_PREPARE_BYTES
        (by its Content-Length), otherwise in a worker thread."""
        size = http.headers.get("content-length", "")
        if size.isdigit() and int(size) <= INLINE_PREPARE_BYTES:
            return self.prepare(request, http.state.request_id, timeout)
        return await run_in_threadpool(self.prepare, request, http.state.request_id, timeout)

    def prepare(self, request: SystemOneRequest, request_id: str, timeout: float) -> JobSpec:
        """Compile, tokenize and budget the request; raises a 422 for anything over a limit."""
        try:
            compiled = self.compiler.compile(request, self._rotations(request), self._group_size(request),
                                             self._max_prefix_tokens(request))
        except UnsupportedContent as exc:
            raise invalid(list(exc.loc[1:]), exc.message, "unsupported_content") from exc  # loc starts at "body"
        except PrefixTooLong as exc:
            raise invalid(["state"], f"{exc}: each question's prompt holds the state, the question and 1 answer "
                          f"token within {self.settings.max_input_tokens}, and all {len(request.questions) + 1} "
                          f"calls within {self.settings.max_total_input_tokens}; shorten the state or send fewer "
                          "questions", "token_budget") from exc
        self._check_budgets(compiled)
        now = time.time()
        levels = {qid: q.criteria for qid, q in request.questions.items() if isinstance(q, ScoreQuestion)}
        # Questions calibrated on their own are found by their key; no digest is computed when none are.
        keys = {qid: question_key(q) for qid, q in request.questions.items()} if self.calibration.questions else {}
        return JobSpec(
            version=GROUPED_JOB_RECORD_VERSION if compiled.final_rounds else JOB_RECORD_VERSION,
            id=self.job_ids.new(now),
            request_id=request_id,
            model=self.settings.served_model_name,
            prefix_ids=compiled.prefix_ids,
            prefix_hash=prefix_key(compiled.prefix_ids, self.settings.route_prefix_tokens),
            branches=[Branch(question_id=b.question_id, kind=b.kind, suffix_ids=b.suffix_ids, label_ids=b.label_ids,
                             option_names=b.option_names, legend=levels.get(b.question_id), option_order=b.option_order,
                             calibrated_temperature=self.calibration.temperature(b.kind, len(b.option_names),
                                                                                 keys.get(b.question_id)),
                             calibrated_log_odds_offset=self.calibration.log_odds_offset(b.kind,
                                                                                        keys.get(b.question_id)),
                             group=b.group)
                      for b in compiled.branches],
            final_rounds=compiled.final_rounds,
            created_at=now,
            deadline_at=now + timeout,
            temperature=self.settings.temperature,
            confidence=self.settings.confidence,
        )

    def _max_prefix_tokens(self, request: SystemOneRequest) -> int:
        # The most prefix tokens that can pass `_check_budgets`: each branch adds at least one suffix token
        # and the answer token, and there is a warm call plus at least one branch per question.
        questions = len(request.questions)
        return min(self.settings.max_input_tokens - 2,
                   (self.settings.max_total_input_tokens - questions) // (questions + 1))

    def _rotations(self, request: SystemOneRequest) -> int:
        debias = self.settings.debias if request.x_debias is None else request.x_debias
        return self.settings.debias_max_rotations if debias else 1

    def _group_size(self, request: SystemOneRequest) -> int:
        return self.settings.option_group_size if request.x_option_group_size is None else request.x_option_group_size

    def _check_budgets(self, compiled: CompiledPrompt) -> None:
        prefix = len(compiled.prefix_ids)
        per_branch = self.settings.max_input_tokens
        # A grouped question's final round is charged at its longest: one line per group, the longest lines.
        suffixes = [(b.question_id, len(b.suffix_ids)) for b in compiled.branches]
        suffixes += [(qid, final.most_tokens) for qid, final in compiled.final_rounds.items()]
        for qid, suffix in suffixes:
            needed = prefix + suffix + 1  # the answer token counts too
            if needed > per_branch:
                raise invalid(["questions", qid],
                              f"this question needs {needed} tokens (state {prefix} + question "
                              f"{suffix} + 1 answer), over the limit of {per_branch}; "
                              "shorten the state or the question", "token_budget")
        total = prefix + sum(prefix + suffix for _, suffix in suffixes)
        if total > self.settings.max_total_input_tokens:
            raise invalid(["questions"], f"the request needs {total} input tokens across its "
                          f"{len(suffixes)} branch calls (one per question, one per rotation when "
                          f"debiasing, one per group and a final round for grouped options), over the limit of "
                          f"{self.settings.max_total_input_tokens}; send fewer questions or a shorter state",
                          "token_budget")


def _option_count(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> int:
    if isinstance(question, NoulQuestion):
        return 2
    return len(question.criteria)
