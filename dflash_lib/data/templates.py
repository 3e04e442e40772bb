"""Chat templates: a conversation -> a list of Segments (special tokens and plain text) with the trained spans.

A template never tokenizes. It says which pieces are special tokens, which are plain text (user text is never
parsed for special tokens), and from which character of a text piece the loss starts. Two text segments are
never adjacent: a special token always separates them, so tokenizing segment by segment gives the same ids as
tokenizing the whole rendered string with those special tokens allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol

from dflash_lib.data.readers import DataError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


class TemplateError(DataError):
    """The template cannot render this conversation (counted as a skip, not raised to the caller)."""


@dataclass(frozen=True, slots=True)
class Segment:
    text: str  # plain text, or the special token's string when `special`
    special: bool = False  # one special token id, looked up by its string
    train_from: int | None = None  # characters: tokens holding any character at index >= this are trained


class ChatTemplate(Protocol):
    name: str
    special_tokens: tuple[str, ...]  # special token strings this template emits (the tokenizer must have them)

    def segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]: ...


def render(segments: list[Segment]) -> str:
    """The template's output as one string (special tokens written out)."""
    return "".join(s.text for s in segments)


class ChatMLTemplate:
    """Qwen ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per turn, no system prompt added.

    Loss: the assistant's content and its closing <|im_end|> (the drafter learns to stop); not the
    "assistant\\n" header, not the "\\n" after <|im_end|>, not other roles.
    """

    name = "chatml"
    special_tokens = (IM_START, IM_END)

    # Shared immutable segments: only the per-turn text segment is allocated per call.
    _START, _END, _NEWLINE = Segment(IM_START, True), Segment(IM_END, True), Segment("\n")
    _TRAINED_END = Segment(IM_END, True, 0)
    _ASSISTANT = "assistant\n"

    def segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        start, end, trained_end, newline = self._START, self._END, self._TRAINED_END, self._NEWLINE
        out = []
        for role, content in turns:
            if role == "assistant":
                out += (start, Segment(self._ASSISTANT + content, False, len(self._ASSISTANT)), trained_end, newline)
            else:
                out += (start, Segment(role + "\n" + content), end, newline)
        return out


class HFChatTemplate:
    """The chat template shipped with a local Hugging Face tokenizer (template="hf").

    Each assistant message's span is found by rendering growing prefixes of the conversation; the loss covers
    its content through the end of that span (end-of-turn tokens included; from the span's start when the
    template rewrote the content so that it cannot be found verbatim). Special-token strings in the
    rendered text become special segments, so user text containing them IS parsed as special here, as the
    Hugging Face template itself would do.
    """

    name = "hf"

    def __init__(self, tokenizer) -> None:
        hf = getattr(tokenizer, "hf", None)
        if hf is None or not getattr(hf, "chat_template", None):
            raise DataError(f"template 'hf' needs a local Hugging Face tokenizer directory with a chat_template; "
                            f"tokenizer {tokenizer.name!r} has none (use template='chatml')")
        self._hf = hf
        self.special_tokens = tuple(sorted(tokenizer.special_strings, key=len, reverse=True))
        if not self.special_tokens:
            raise DataError(f"template 'hf': tokenizer {tokenizer.name!r} declares no special tokens")
        self._split = re.compile("(" + "|".join(map(re.escape, self.special_tokens)) + ")")

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not messages:
            return ""
        try:
            return self._hf.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja raises for conversations the template refuses (roles out of order, ...)
            raise TemplateError(f"chat template refused the conversation: {e}") from None

    def segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        messages = [{"role": r, "content": c} for r, c in turns]
        full = self._render(messages)
        spans = []  # trained character intervals [a, b) of `full`
        for i, (role, content) in enumerate(turns):
            if role != "assistant":
                continue
            a, b = len(self._render(messages[:i])), len(self._render(messages[: i + 1]))
            if not full.startswith(self._render(messages[: i + 1])):
                raise TemplateError("chat template output is not prefix-stable; cannot locate assistant turns")
            found = full.find(content, a, b)
            spans.append((found if found >= 0 else a, b))
        out, pos = [], 0
        for piece in self._split.split(full):
            if not piece:
                continue
            lo, hi = pos, pos + len(piece)
            starts = [max(a, lo) for a, b in spans if a < hi and b > lo]  # spans overlapping this piece
            train_from = min(starts) - lo if starts else None
            out.append(Segment(piece, piece in self.special_tokens, train_from))
            pos = hi
        return out


TEMPLATES: dict[str, Callable[..., ChatTemplate]] = {
    "chatml": lambda tokenizer: ChatMLTemplate(),
    "hf": HFChatTemplate,
}


def check_template_name(name: str) -> None:
    if name not in TEMPLATES:
        raise DataError(f"unknown template {name!r}; known: {sorted(TEMPLATES)}")


def get_template(name: str, tokenizer) -> ChatTemplate:
    """The template `name` for `tokenizer`; checks that the tokenizer has every special token it emits."""
    check_template_name(name)
    template = TEMPLATES[name](tokenizer)
    for token in template.special_tokens:
        tokenizer.special_id(token)  # raises a DataError naming the tokenizer and the token
    return template
