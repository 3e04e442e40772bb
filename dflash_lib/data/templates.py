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
THINK_START, THINK_END = "<think>", "</think>"  # Qwen3 ids 151667 / 151668
EMPTY_THINK = THINK_START + "\n\n" + THINK_END + "\n\n"  # what Qwen3 puts before a non-thinking answer
THINKING = ("off", "on", "keep")  # DataConfig.thinking values (see Qwen3Template)


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

    def prompt_segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        """The conversation so far plus the header the target's next assistant answer follows."""
        ...


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

    def prompt_segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        return self.segments(turns) + [self._START, Segment(self._ASSISTANT)]


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message the way Qwen3's template splits it: everything before the
    last `</think>` (after its `<think>`) is reasoning; ("", content) when there is no `</think>`."""
    if THINK_END not in content:
        return "", content
    head, answer = content.split(THINK_END)[0], content.split(THINK_END)[-1]
    return head.rstrip("\n").split(THINK_START)[-1].lstrip("\n"), answer.lstrip("\n")


class Qwen3Template:
    """What Qwen3's own chat template renders for a conversation without tools (checked against a Jinja fixture in
    tests/test_templates_qwen3.py):

    - a system message is a ChatML turn wherever it stands; user turns are ChatML turns;
    - an assistant turn BEFORE the last user message is `<|im_start|>assistant\\n{answer}<|im_end|>\\n`: any
      `<think>...</think>` part of its content is dropped (Qwen3 never shows old reasoning again);
    - an assistant turn AFTER the last user message carries `<think>\\n{reasoning}\\n</think>\\n\\n{answer}` when it
      is the last message or has reasoning; with no reasoning that is the empty block Qwen3 prefills in
      non-thinking mode.

    Loss (`thinking`, DataConfig.thinking): the answer and its closing <|im_end|>, never the header. The think
    block is trained when the target wrote it: with "on"/"keep" (thinking-mode serving: the model writes
    `<think>...`), or when it holds reasoning; with "off" an EMPTY block is the prompt's prefill, not trained.
    `<think>`/`</think>` are special segments when the tokenizer has them as special tokens, else plain text
    (a Hugging Face Qwen3 tokenizer matches them as added tokens either way).
    """

    name = "qwen3"

    def __init__(self, tokenizer=None, thinking: str = "off") -> None:
        if thinking not in THINKING:
            raise DataError(f"thinking must be one of {list(THINKING)}, got {thinking!r}")
        self.thinking = thinking
        specials = getattr(tokenizer, "special_strings", frozenset())
        self._think_special = THINK_START in specials and THINK_END in specials
        self.special_tokens = (IM_START, IM_END) + ((THINK_START, THINK_END) if self._think_special else ())

    def _pieces(self, turns: tuple[tuple[str, str], ...]) -> list[tuple[str, bool, bool]]:
        """(text, special, trained) pieces in order."""
        last_query = len(turns) - 1
        for i in range(len(turns) - 1, -1, -1):
            if turns[i][0] == "user":
                last_query = i
                break
        think = self._think_special
        out: list[tuple[str, bool, bool]] = []
        for i, (role, content) in enumerate(turns):
            if role != "assistant":
                out += [(IM_START, True, False), (role + "\n" + content, False, False), (IM_END, True, False),
                        ("\n", False, False)]
                continue
            reasoning, answer = split_reasoning(content)
            out += [(IM_START, True, False), ("assistant\n", False, False)]
            if i > last_query and (i == len(turns) - 1 or reasoning):
                block_trained = self.thinking != "off" or bool(reasoning)
                out += [(THINK_START, think, block_trained), ("\n" + reasoning.strip("\n") + "\n", False, block_trained),
                        (THINK_END, think, block_trained), ("\n\n", False, block_trained)]
                answer = answer.lstrip("\n")
            out += [(answer, False, True), (IM_END, True, True), ("\n", False, False)]
        return out

    @staticmethod
    def _segments(pieces: list[tuple[str, bool, bool]]) -> list[Segment]:
        """Merge neighbouring plain pieces into one text segment (the tokenizer's contract), keeping where the
        trained part of each starts (trained pieces only ever follow untrained ones inside a turn)."""
        out: list[Segment] = []
        text, train_from = "", None
        for piece, special, trained in pieces:
            if special:
                if text:
                    out.append(Segment(text, False, train_from))
                text, train_from = "", None
                out.append(Segment(piece, True, 0 if trained else None))
                continue
            if trained and train_from is None and piece:
                train_from = len(text)
            text += piece
        if text:
            out.append(Segment(text, False, train_from))
        return out

    def segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        return self._segments(self._pieces(turns))

    def prompt_segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        pieces = self._pieces(turns) + [(IM_START, True, False), ("assistant\n", False, False)]
        if self.thinking == "off":  # Qwen3's enable_thinking=False prefill
            pieces += [(THINK_START, self._think_special, False), ("\n\n", False, False),
                       (THINK_END, self._think_special, False), ("\n\n", False, False)]
        return self._segments(pieces)


class HFChatTemplate:
    """The chat template shipped with a local Hugging Face tokenizer (template="hf").

    Each assistant message's span is found by rendering growing prefixes of the conversation; the loss covers
    its content through the end of that span (end-of-turn tokens included; from the span's start when the
    template rewrote the content so that it cannot be found verbatim). Special-token strings in the
    rendered text become special segments, so user text containing them IS parsed as special here, as the
    Hugging Face template itself would do.
    """

    name = "hf"

    def __init__(self, tokenizer, thinking: str = "off") -> None:
        # enable_thinking reaches the template only when set: "keep" leaves the template's own default
        self._thinking_kwargs = {} if thinking == "keep" else {"enable_thinking": thinking == "on"}
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

    def prompt_segments(self, turns: tuple[tuple[str, str], ...]) -> list[Segment]:
        text = self._hf.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False,
                                            add_generation_prompt=True, **self._thinking_kwargs)
        return [Segment(p, p in self.special_tokens) for p in self._split.split(text) if p]

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


TEMPLATES: dict[str, Callable[..., ChatTemplate]] = {  # name -> factory(tokenizer, thinking)
    "chatml": lambda tokenizer, thinking="off": ChatMLTemplate(),
    "qwen3": Qwen3Template,
    "hf": HFChatTemplate,
}


def check_template_name(name: str) -> None:
    if name not in TEMPLATES:
        raise DataError(f"unknown template {name!r}; known: {sorted(TEMPLATES)}")


def get_template(name: str, tokenizer, thinking: str = "off") -> ChatTemplate:
    """The template `name` for `tokenizer`; checks that the tokenizer has every special token it emits.
    `thinking` (DataConfig.thinking) matters to the templates that know Qwen3's think blocks."""
    check_template_name(name)
    if thinking not in THINKING:
        raise DataError(f"thinking must be one of {list(THINKING)}, got {thinking!r}")
    template = TEMPLATES[name](tokenizer, thinking)
    for token in template.special_tokens:
        tokenizer.special_id(token)  # raises a DataError naming the tokenizer and the token
    return template
