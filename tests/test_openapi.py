"""The OpenAPI schema says what the server with these settings accepts and answers (no processes:
the schema is built from the app as `openjev schema` builds it)."""

from __future__ import annotations

import re
from pathlib import Path

from api.app import create_app
from common.settings import Settings

README = Path(__file__).resolve().parent.parent / "README.md"


def schema(**settings) -> dict:
    return create_app(Settings(**settings)).openapi()


def operations(doc: dict):
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            yield method, path, op


def test_bearer_security_is_declared_exactly_when_a_key_is_set() -> None:
    keyed = schema(api_key="k")
    assert keyed["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for method, path, op in operations(keyed):
        protected = path.startswith("/v1/") or path == "/metrics"
        assert (op.get("security") == [{"bearer": []}]) == protected, (method, path)
        assert {"401", "403"} <= set(op["responses"]) if protected else not {"401", "403"} & set(op["responses"])
    open_doc = schema()
    assert "securitySchemes" not in open_doc["components"]
    assert all("security" not in op for _, _, op in operations(open_doc))


def test_every_status_a_route_answers_is_declared() -> None:
    ops = {(m, p): set(op["responses"]) for m, p, op in operations(schema(api_key="k"))}
    assert {"200", "400", "401", "403", "408", "413", "415", "422", "502", "503", "504", "529"} <= ops[
        ("post", "/v1/systemone")]
    assert {"200", "202", "400", "409", "413", "415", "422", "503", "529"} <= ops[("post", "/v1/jobs")]
    assert {"200", "404", "503"} <= ops[("get", "/v1/jobs/{job_id}")]
    assert {"200", "404", "503"} <= ops[("delete", "/v1/jobs/{job_id}")]
    assert {"200", "503"} <= ops[("get", "/health")]


def test_the_idempotent_replay_is_a_declared_200_with_the_job() -> None:
    replay = schema()["paths"]["/v1/jobs"]["post"]["responses"]["200"]
    assert replay["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobView"}


def test_request_constraints_match_validation() -> None:
    components = schema(max_questions=7, max_options=9)["components"]["schemas"]
    request = components["SystemOneRequest"]["properties"]
    assert {"type": "null"} not in request["state"]["anyOf"]
    assert {c["type"] for c in request["state"]["anyOf"]} == {"string", "object", "array"}
    assert request["questions"]["minProperties"] == 1 and request["questions"]["maxProperties"] == 7
    choice = components["ChoiceQuestion"]["properties"]["criteria"]
    assert choice["minProperties"] == 1 and choice["maxProperties"] == 9
    score = components["ScoreQuestion"]["properties"]["criteria"]
    assert score["minItems"] == 2 and score["maxItems"] == 9
    level = components["ScoreLevel"]["anyOf"]
    assert {"type": "null"} not in level
    assert {"maximum": 2**64 - 1, "minimum": -(2**63), "type": "integer"} in level


def test_model_names_follow_the_aliases_setting() -> None:
    default = schema()["components"]["schemas"]["SystemOneRequest"]["properties"]["model"]["anyOf"]
    assert {"type": "string", "pattern": "^jev-"} in default
    narrowed = schema(model_aliases="jev-latest,jev-1.13.0")["components"]["schemas"]["SystemOneRequest"]
    choices = narrowed["properties"]["model"]["anyOf"]
    assert choices == [{"type": "string", "enum": sorted(["Qwen/Qwen3.6-35B-A3B", "jev-latest", "jev-1.13.0"])}]


def test_every_response_declares_the_request_id_header() -> None:
    for _, _, op in operations(schema(api_key="k")):
        for response in op["responses"].values():
            assert "x-typesafe-request-id" in response["headers"]


def test_readme_documents_every_setting_exactly_once() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `OPENJEV_")]
    documented = [name for row in rows for name in re.findall(r"`(OPENJEV_[A-Z0-9_]+)`", row.split("|")[1])]
    settings = sorted(f"OPENJEV_{name.upper()}" for name in Settings.model_fields)
    assert sorted(documented) == settings


def test_api_help_names_the_front_door_settings_it_enforces() -> None:
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "openjev", "api", "--help"], capture_output=True, text=True,
                           check=True).stdout
    names = ("max_header_bytes", "header_timeout", "body_timeout", "keep_alive_timeout", "max_connections")
    for name in names:
        assert name in Settings.model_fields
        assert f"OPENJEV_{name.upper()}" in " ".join(shown.split()), name


def test_a_keys_file_declares_bearer_security_and_the_tenants_429(tmp_path) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text('[tenants.a]\nkey = "k-0123456789abcdef"\nrequests_per_minute = 5\n')
    paths = schema(api_keys_file=keys_file)["paths"]
    for path in ("/v1/systemone", "/v1/jobs"):
        assert "429" in paths[path]["post"]["responses"] and paths[path]["post"]["security"]
    assert "429" not in schema()["paths"]["/v1/systemone"]["post"]["responses"]


def test_every_field_an_answer_carries_is_declared_in_the_schema() -> None:
    """The answers the worker builds (common/scoring.py) are what the schema says, field for field:
    `x_label_mass`, openjev's extension, included."""
    from common.contract import ChoiceAnswer, NoulAnswer, ScoreAnswer
    from common.scoring import choice_answer, label_distribution, noul_answer, score_answer
    from common.settings import ConfidenceMode

    dist = label_distribution([-0.5, -1.5, -2.5])
    built = {NoulAnswer: noul_answer(label_distribution([-0.2, -2.0])),
             ChoiceAnswer: choice_answer(dist, ["a", "b", "c"], ConfidenceMode.typesafe),
             ScoreAnswer: score_answer(dist, ["low", "mid", "high"], ConfidenceMode.typesafe)}
    components = schema()["components"]["schemas"]
    for model, answer in built.items():
        assert type(answer) is model
        body = answer.model_dump()
        declared = set(components[model.__name__]["properties"])
        assert set(body) == declared, (model.__name__, set(body) ^ declared)
        assert body["x_label_mass"] is not None
    assert 0 < built[NoulAnswer].x_label_mass <= 1


def test_a_response_body_the_worker_builds_validates_against_the_served_schema() -> None:
    """The worker builds the body through SystemOneResponse (worker/evaluation.py): every key it stores is
    declared by the schema /openapi.json serves, the answers' `x_label_mass` included, and nothing is extra."""
    from common.contract import SystemOneResponse
    from common.jobs import Branch
    from common.scoring import question_answers
    from common.settings import ConfidenceMode

    branches = [Branch(question_id="n", kind="noul", suffix_ids=[], label_ids=[1, 2], option_names=["true", "false"]),
                Branch(question_id="c", kind="choice", suffix_ids=[], label_ids=[1, 2], option_names=["x", "y"]),
                Branch(question_id="s", kind="score", suffix_ids=[], label_ids=[1, 2, 3], option_names=["0", "1", "2"],
                       legend=["lo", "mid", "hi"])]
    answers = question_answers(branches, [[-0.1, -2.5], [-1.0, -0.6], [-3.0, -0.2, -2.0]], 1.0,
                               ConfidenceMode.typesafe)
    body = SystemOneResponse(model="jev-latest", answers=answers,
                             usage={"input_tokens": 10, "output_tokens": 4}).model_dump()
    components = schema()["components"]["schemas"]
    assert set(body) == set(components["SystemOneResponse"]["properties"])
    for answer in body["answers"].values():
        model = {"noul": "NoulAnswer", "choice": "ChoiceAnswer", "score": "ScoreAnswer"}[answer["type"]]
        assert set(answer) == set(components[model]["properties"]), model
        assert 0 < answer["x_label_mass"] <= 1
    assert body["answers"]["s"]["legend"] == {"0": "lo", "1": "mid", "2": "hi"}
    assert SystemOneResponse.model_validate(body).model_dump() == body
