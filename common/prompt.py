"""The prompt compiler: one request → one shared prefix (the state) and one suffix per question.

The chat template is rendered once with a marker where the question goes; the text before the
marker is the prefix, shared by every question and cached by the engine; each question's suffix is
its text, the rest of the template and the answer marker, after which the label token is scored.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from common.contract import JSON, ChoiceQuestion, NoulQuestion, ScoreQuestion, SystemOneRequest, echo
from common.jobs import FinalRound
from common.labels import Label, LabelAlphabet
from common.settings import PromptStyle
from common.token_floor import TokenFloor

QuestionKind = Literal["noul", "choice", "score"]
AnyQuestion = NoulQuestion | ChoiceQuestion | ScoreQuestion
Loc = tuple[str | int, ...]

ANSWER_MARKER = "Answer:"
# Per style: the text the suffix ends with, and what stands between it and the label's letters.
_ANSWER_FORMS = {PromptStyle.inline: (ANSWER_MARKER, " "), PromptStyle.newline: (ANSWER_MARKER + "\n", "")}
# The prefix ends with this newline and every suffix starts with the fixed word "Question", so the
# split is a token boundary: without the newline Qwen's pre-tokenizer glues "." onto the next word.
QUESTION_INTRO = "Read everything above, then answer the multiple-choice question below about it.\n"
# Where the question would be; it is never rendered into a prompt. The state may contain this
# string too: the last occurrence is ours, since our turn is rendered after the state.
QUESTION_SLOT = "[[openjev:question]]"
DEFAULT_INSTRUCTIONS = "Which option fits best?"

_ROLES = ("system", "user", "assistant", "tool")  # the seed's roles; tool turns go through the template too
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_MEDIA_KINDS = {
    "image": "image",
    "image_url": "image",
    "input_image": "image",
    "audio": "audio",
    "audio_url": "audio",
    "input_audio": "audio",
    "video": "video",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
}


class PrefixTooLong(ValueError):
    """The rendered state needs more tokens than any of its prompts may hold; found before tokenizing it all."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the state needs at least {at_least} tokens, over the {limit} its prompts may hold")
        self.at_least = at_least
        self.limit = limit


class UnsupportedContent(ValueError):
    """The request carries something openjev cannot put in a prompt; `loc` points at it in the body."""

    def __init__(self, message: str, loc: Loc) -> None:
        super().__init__(message)
        self.message = message
        self.loc = loc


class PromptTemplateError(RuntimeError):
    """The chat template did not keep the question slot, so prefix and suffixes cannot be split."""


@dataclass(frozen=True)
class CompiledBranch:
    """One question's branch: the ids after the prefix and the label ids scored after them."""

    question_id: str
    kind: QuestionKind
    suffix_ids: list[int]
    label_ids: list[int]
    option_names: list[str]
    """The keys answers are reported under, in request order: noul true/false, choice names, score "0".."""
    option_order: list[int] | None = None
    """With debiasing: the option (index into `option_names`) shown at each label; None: label i shows option i.
    In a grouped question's first round: the group's options, in the order shown."""
    group: int | None = None
    """A grouped choice question's first round: the group this branch shows (see `PromptCompiler.compile`)."""


@dataclass(frozen=True)
class CompiledPrompt:
    """The shared prefix ids and one branch per question, in request order."""

    prefix_ids: list[int]
    branches: list[CompiledBranch]
    final_rounds: dict[str, FinalRound] = field(default_factory=dict)
    """By question id: the second round of each grouped choice question, assembled by the worker."""


class PromptCompiler:
    """Turns requests into token ids with one tokenizer and its verified label alphabet."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, alphabet: LabelAlphabet, prefix_cache_size: int = 1024,
        style: PromptStyle = PromptStyle.inline,
    ) -> None:
        """`prefix_cache_size` prefixes keep their ids, so a repeated state is tokenized once, and as many
        question suffixes theirs (clients ask the same questions of many states); `alphabet` must be
        verified in `style`'s answer context."""
        self._tokenizer = tokenizer
        self._alphabet = alphabet
        self._prefixes = _TokenizedTexts(prefix_cache_size)
        self._suffixes = _TokenizedTexts(prefix_cache_size)
        self._final_rounds = _Memo[FinalRound | None](max(1, prefix_cache_size // 16))
        self._marker = _ANSWER_FORMS[style][0]
        self._floor = TokenFloor(tokenizer)

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, prefix_cache_size: int = 1024,
                      style: PromptStyle = PromptStyle.inline) -> PromptCompiler:
        """A compiler with the label alphabet verified for `tokenizer` in this compiler's answer context."""
        alphabet = LabelAlphabet.build(tokenizer, answer_context(tokenizer, style), spacer=_ANSWER_FORMS[style][1])
        return cls(tokenizer, alphabet, prefix_cache_size, style)

    @property
    def alphabet(self) -> LabelAlphabet:
        """The label alphabet; its `capacity` bounds the options of one question."""
        return self._alphabet

    def compile(self, request: SystemOneRequest, max_rotations: int = 1, group_size: int = 0,
                max_prefix_tokens: int | None = None) -> CompiledPrompt:
        """Render the state once and tokenize the shared prefix and every question's suffix.

        A prefix that needs more than `max_prefix_tokens` raises `PrefixTooLong` before it is tokenized whole.

        `max_rotations` > 1 debiases label order: each choice or score question with n options gets
        min(n, max_rotations) branches, each showing its options cyclically rotated (see `rotation_orders`).

        `group_size` > 0 asks a choice question with more options than that in two rounds, for models that
        lose the thread in a long list: first ⌈n / group_size⌉ groups of consecutive options (in canonical
        order when debiasing), one branch each (or one per rotation of the group), then the worker lists each
        group's winner in a final branch (`FinalRound`). An option's probability is its group's winner's in
        the final round times its own within its group.
        """
        prefix_text, tail = self._render(request.state)
        if max_prefix_tokens is not None:
            at_least = self._floor.at_least(prefix_text, max_prefix_tokens)
            if at_least > max_prefix_tokens:
                raise PrefixTooLong(at_least, max_prefix_tokens)
        prefix_ids = self._prefixes.ids(prefix_text, self._encode)
        branches: list[CompiledBranch] = []
        final_rounds: dict[str, FinalRound] = {}
        for qid, question in request.questions.items():
            grouped = None
            if isinstance(question, ChoiceQuestion) and 0 < group_size < len(question.criteria):
                grouped = self._grouped(qid, question, tail, max_rotations, group_size)
            if grouped is None:
                branches += self._branches(qid, question, tail, max_rotations)
            else:
                branches += grouped[0]
                final_rounds[qid] = grouped[1]
        return CompiledPrompt(prefix_ids=prefix_ids, branches=branches, final_rounds=final_rounds)

    def _render(self, state: JSON) -> tuple[str, str]:
        try:
            prefix_text, tail = render_split(self._tokenizer, state_messages(state))
        except TemplateError as error:
            # Model templates refuse some conversations (e.g. a system message after the first).
            raise UnsupportedContent(
                f"state: the model's chat template cannot render these messages: {error}", ("body", "state")
            ) from None
        _require_unicode(prefix_text, ("body", "state"))
        return prefix_text, tail

    def _branches(self, question_id: str, question: AnyQuestion, tail: str, max_rotations: int
                  ) -> list[CompiledBranch]:
        options = question_options(question)
        labels = self._alphabet.labels_for(len(options))
        rotations = 1 if isinstance(question, NoulQuestion) else min(len(options), max_rotations)
        orders: list[list[int] | None] = [None] if rotations == 1 else rotation_orders(question, rotations)
        return [self._branch(question_id, question, options, labels, tail, order) for order in orders]

    def _branch(self, question_id: str, question: AnyQuestion, options: list[tuple[str, str]], labels: list[Label],
                tail: str, order: list[int] | None, group: int | None = None) -> CompiledBranch:
        shown = options if order is None else [options[i] for i in order]
        suffix_text = question_text(question, shown, labels, in_order=order is None or order[0] == 0) + tail
        suffix_text += self._marker
        _require_unicode(suffix_text, ("body", "questions", question_id))
        return CompiledBranch(
            question_id=question_id,
            kind=question.type,
            suffix_ids=self._suffixes.ids(suffix_text, self._encode),
            label_ids=[label.token_id for label in labels],
            option_names=[name for name, _ in options],
            option_order=order,
            group=group,
        )

    def _grouped(self, question_id: str, question: ChoiceQuestion, tail: str, max_rotations: int,
                 group_size: int) -> tuple[list[CompiledBranch], FinalRound] | None:
        """The first round's branches and the final round's pieces; None where this tokenizer does not join
        the pieces into the question's own ids (the question is then asked in one branch)."""
        options = question_options(question)
        n = len(options)
        names = [name for name, _ in options]
        order = sorted(range(n), key=names.__getitem__) if max_rotations > 1 else list(range(n))
        count = -(-n // group_size)
        groups = [order[(g * n) // count:((g + 1) * n) // count] for g in range(count)]
        final = self._final_round(question_id, question, options, tail, count)
        if final is None:
            return None
        branches = []
        for g, members in enumerate(groups):
            labels = self._alphabet.labels_for(len(members))
            branches += [self._branch(question_id, question, options, labels, tail, order, g)
                         for order in rotated(members, min(len(members), max_rotations))]
        return branches, final

    def _final_round(self, question_id: str, question: ChoiceQuestion, options: list[tuple[str, str]], tail: str,
                     shown: int) -> FinalRound | None:
        labels = self._alphabet.labels_for(shown)
        head, reply = question_frame(question, labels)
        reply += tail + self._marker
        lines = [f": {text}\n" for _, text in options]
        _require_unicode(head + reply + "".join(lines), ("body", "questions", question_id))
        # Clients ask the same long question of many states: its pieces are cut once.
        return self._final_rounds.get(json.dumps([shown, head, reply, lines]),
                                      lambda _: self._cut_final_round(head, reply, lines, labels))

    def _cut_final_round(self, head: str, reply: str, lines: list[str], labels: list[Label]) -> FinalRound | None:
        shown = len(labels)
        list_labels = [label.letters for label in labels]
        encoded = self._tokenizer([head, reply, *list_labels, *lines], add_special_tokens=False)["input_ids"]
        final = FinalRound(groups=shown, head_ids=encoded[0], tail_ids=encoded[1], list_label_ids=encoded[2:2 + shown],
                           line_ids=encoded[2 + shown:], label_ids=[label.token_id for label in labels])
        # Every line once, each after a label and before the next label (or the reply): the joins the final
        # round will make. A tokenizer that merges across them (a leading space, say) cannot use pieces.
        cycled = [i % shown for i in range(len(lines))]
        text = head + "".join(list_labels[k] + line for k, line in zip(cycled, lines, strict=True)) + reply
        joined = list(final.head_ids)
        for k, line in zip(cycled, final.line_ids, strict=True):
            joined += final.list_label_ids[k] + line
        return final if joined + final.tail_ids == self._encode(text) else None

    def _encode(self, text: str) -> list[int]:
        # The rendered template already holds every special token the model needs.
        return self._tokenizer.encode(text, add_special_tokens=False)


def answer_context(tokenizer: PreTrainedTokenizerBase, style: PromptStyle = PromptStyle.inline) -> str:
    """The text every suffix ends with (template tail + answer marker): labels are verified after it."""
    _, tail = render_split(tokenizer, [])
    return tail + _ANSWER_FORMS[style][0]


def render_split(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, str]:
    """Render `messages` plus the question turn; return the text before the question and the tail after."""
    question_turn = {"role": "user", "content": QUESTION_INTRO + QUESTION_SLOT}
    rendered = tokenizer.apply_chat_template(
        [*messages, question_turn], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    prefix, slot, tail = str(rendered).rpartition(QUESTION_SLOT)
    if not slot:
        raise PromptTemplateError("the chat template dropped the question slot from the last user turn")
    return prefix, tail


# --- state → chat messages -------------------------------------------------------------------------


def state_messages(state: JSON) -> list[dict[str, str]]:
    """The chat messages a state stands for: its own messages, or one user message holding it."""
    if isinstance(state, str):
        return [{"role": "user", "content": state}]
    if _is_message_list(state):
        return _text_messages(state, ("body", "state"))
    if isinstance(state, dict) and _is_message_list(state.get("messages")):
        # Checked even when the whole object is serialised: media is refused wherever it is sent.
        messages = _text_messages(state["messages"], ("body", "state", "messages"))
        if state.keys() == {"messages"}:
            return messages
    # Anything else is serialised whole, so no metadata is silently dropped.
    return [{"role": "user", "content": json.dumps(state, ensure_ascii=False)}]


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_message(item) for item in value)


def _is_message(item: Any) -> bool:
    # Any string role makes a message, so an unknown one is refused rather than serialised as data.
    if not isinstance(item, dict) or not isinstance(item.get("role"), str):
        return False
    content = item.get("content")
    if isinstance(content, list):
        return all(isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)
    return isinstance(content, str)


def _text_messages(messages: list[dict[str, Any]], loc: Loc) -> list[dict[str, str]]:
    return [
        {"role": _role(message["role"], (*loc, i, "role")), "content": _message_text(message["content"],
                                                                                      (*loc, i, "content"))}
        for i, message in enumerate(messages)
    ]


def _role(role: str, loc: Loc) -> str:
    if role not in _ROLES:
        raise UnsupportedContent(f"{_path(loc)}: {echo(role)!r} is not a chat role; use one of "
                                 f"{', '.join(_ROLES)}", loc)
    return role


def _message_text(content: str | list[dict[str, Any]], loc: Loc) -> str:
    if isinstance(content, str):
        return content
    # Parts are joined as chat templates join them: back to back.
    return "".join(_part_text(part, (*loc, j)) for j, part in enumerate(content))


def _part_text(part: dict[str, Any], loc: Loc) -> str:
    kind = part["type"]
    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind in _TEXT_PARTS:
        raise UnsupportedContent(f"{_path(loc)}: a {kind} part needs a string `text`", loc)
    shown = _MEDIA_KINDS.get(kind, f"{echo(kind)!r}")
    raise UnsupportedContent(f"{_path(loc)}: {shown} content is not supported; openjev evaluates text only", loc)


def _path(loc: Loc) -> str:
    # ("body", "state", "messages", 0, "content", 1) → "state.messages[0].content[1]"
    path = str(loc[1])
    for step in loc[2:]:
        path += f"[{step}]" if isinstance(step, int) else f".{step}"
    return path


def _require_unicode(text: str, loc: Loc) -> None:
    # JSON may carry unpaired surrogates ("\ud800"), which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UnsupportedContent(
            f"{_path(loc)}: contains an unpaired UTF-16 surrogate ({text[error.start]!r}); send valid Unicode",
            loc,
        ) from None


# --- question → suffix text --------------------------------------------------------------------------


def question_options(question: AnyQuestion) -> list[tuple[str, str]]:
    """(option name, text shown after its label) pairs in label order."""
    if isinstance(question, NoulQuestion):
        criteria = question.criteria
        return [
            ("true", _described("Yes", criteria.true if criteria else None)),
            ("false", _described("No", criteria.false if criteria else None)),
        ]
    if isinstance(question, ChoiceQuestion):
        # The name is shown only when nothing describes the option, so names do not leak into answers.
        return [(name, name if about is None else _json_text(about)) for name, about in question.criteria.items()]
    return [(str(level), _json_text(about)) for level, about in enumerate(question.criteria)]


def rotation_orders(question: ChoiceQuestion | ScoreQuestion, rotations: int) -> list[list[int]]:
    """`rotations` cyclic shifts of the options, spread evenly (as many as options: every shift).

    Choice options are first put in one canonical order (by name), so with every shift the set of
    prompts, and so the averaged answer, is the same whatever order the client sent them in. Score
    levels keep their order: it is what the levels mean.
    """
    names = list(question.criteria) if isinstance(question, ChoiceQuestion) else None
    n = len(question.criteria)
    canonical = sorted(range(n), key=names.__getitem__) if names is not None else list(range(n))
    return rotated(canonical, rotations)


def rotated(order: list[int], rotations: int) -> list[list[int]]:
    """`rotations` cyclic shifts of `order`, spread evenly (as many as its length: every shift)."""
    shifts = sorted({(i * len(order)) // rotations for i in range(rotations)})
    return [order[s:] + order[:s] for s in shifts]


def question_text(question: AnyQuestion, options: list[tuple[str, str]], labels: list[Label],
                  in_order: bool = True) -> str:
    """The question as the model reads it, up to the end of the user turn.

    `in_order` False: a rotated score question, whose levels are not listed lowest first.
    """
    head, reply = question_frame(question, labels, in_order)
    lines = "".join(f"{label.letters}: {shown}\n" for label, (_, shown) in zip(labels, options, strict=True))
    return head + lines + reply


def question_frame(question: AnyQuestion, labels: list[Label], in_order: bool = True) -> tuple[str, str]:
    """The question's text before its first option line and after its last one."""
    instructions = "" if question.instructions is None else _json_text(question.instructions)
    if not instructions.strip():
        instructions = DEFAULT_INSTRUCTIONS
    heading = "Options:"
    if isinstance(question, ScoreQuestion):
        heading = "Levels, lowest first:" if in_order else "Levels, in no particular order:"
    letter = "letter" if len(labels[0].letters) == 1 else "two letters"
    return f"Question: {instructions}\n{heading}\n", f"Reply with the {letter} of the best option only."


def _described(word: str, about: JSON) -> str:
    return word if about is None else f"{word} — {_json_text(about)}"


def _json_text(value: JSON) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


V = TypeVar("V")


class _Memo(Generic[V]):
    """An LRU of values keyed by a hash of the text they are made from; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: OrderedDict[bytes, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str, make: Callable[[str], V]) -> V:
        key = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = make(text)
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value


class _TokenizedTexts:
    """An LRU of token ids keyed by a hash of the text; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self._memo = _Memo[tuple[int, ...]](size)

    def ids(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        return list(self._memo.get(text, lambda t: tuple(encode(t))))
