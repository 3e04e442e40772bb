"""TokenStore: tokenized conversations on disk, memory-mapped, cached under a hash of every setting.

`build_token_store` tokenizes a corpus once into `<cache_dir>/<key>/` (tokens, loss mask, offsets, per-sample
lengths, dropped samples, the load report, meta.json last), built under a temporary name and renamed when
complete (`publish_folder`); `TokenStore` reads it back, `store[i]` in O(1). The files and what they hold:
docs/data.md, "The token store on disk".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflash_lib.config import ConfigError, DataConfig
from dflash_lib.data.readers import (NO_ASSISTANT_WITHIN_MAX_LEN, OVER_MAX_LEN, TEMPLATE_ERROR, Conversation, DataError,
                                     LoadReport, load_conversations, resolve_source)
from dflash_lib.data.templates import TemplateError, check_template_name, get_template
from dflash_lib.data.tokenizers import ChatTokenizer, EncodedBatch, load_tokenizer, tokenizer_identity
from dflash_lib.rundir import writable

STORE_FORMAT_VERSION = 2  # bump when the on-disk layout or the tokenization semantics change (2: samples with
# no assistant token within max_len dropped, dropped.parquet, skip examples in report.json)
CHUNK_CHARS = 1 << 19  # characters of content per tokenizer job (one tiktoken call; bounds transient memory)
TOKENS_FILE, MASK_FILE, OFFSETS_FILE = "tokens.bin", "loss_mask.bin", "offsets.npy"
LENGTHS_FILE, REPORT_FILE, META_FILE = "lengths.parquet", "report.json", "meta.json"
DROPPED_FILE = "dropped.parquet"


@dataclass(frozen=True)
class StoreSettings:
    """Everything that decides a store's content (all of it is hashed into the key)."""

    source: str  # "sharegpt" or a local .json/.jsonl/.parquet path
    tokenizer: str  # "qwen" or a local Hugging Face tokenizer directory
    template: str  # a name in dflash_lib.data.templates.TEMPLATES
    max_len: int  # tokens per sample after the policy
    policy: str  # "truncate" | "drop"
    limit: int  # records read (0 = all)
    thinking: str = "off"  # DataConfig.thinking: which think blocks the template trains

    def key(self) -> str:
        payload = dict(format=STORE_FORMAT_VERSION, source=resolve_source(self.source).identity,
                       tokenizer=tokenizer_identity(self.tokenizer), template=self.template,
                       max_len=self.max_len, policy=self.policy, limit=self.limit)
        if self.thinking != "off":  # (keys of the stores built before `thinking` existed stay valid)
            payload["thinking"] = self.thinking
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


class TokenStore:
    """Read side of a store: `store[i]` -> (tokens (L,) uint32, loss_mask (L,) uint8) memmap views, O(1)."""

    def __init__(self, path: Path, meta: dict[str, Any], report: LoadReport) -> None:
        self.path = path
        self.meta = meta  # settings, key, tokenizer facts (n_vocab, vocab_size, eos_id, pad_id)
        self.report = report
        self._offsets = np.load(path / OFFSETS_FILE, mmap_mode="r")  # (N+1,) int64
        empty = int(self._offsets[-1]) == 0  # mmap refuses empty files
        self._tokens = np.zeros(0, "<u4") if empty else np.memmap(path / TOKENS_FILE, dtype="<u4", mode="r")  # (T,)
        self._mask = np.zeros(0, np.uint8) if empty else np.memmap(path / MASK_FILE, dtype=np.uint8, mode="r")  # (T,)

    @classmethod
    def open(cls, path: str | Path) -> "TokenStore":
        path = Path(path)
        meta_file = path / META_FILE
        if not meta_file.is_file():
            raise DataError(f"{path}: not a complete token store (no {META_FILE})")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != STORE_FORMAT_VERSION:
            raise DataError(f"{path}: store format {meta.get('format')} != {STORE_FORMAT_VERSION}; rebuild it")
        report = LoadReport.from_dict(json.loads((path / REPORT_FILE).read_text()))
        return cls(path, meta, report)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a store of {n} samples ({self.path})")
        i %= n
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._tokens[a:b], self._mask[a:b]

    @cached_property
    def lengths(self) -> np.ndarray:
        """(N,) int64 tokens per sample (after the max_len policy)."""
        return np.diff(np.asarray(self._offsets)).astype(np.int64)

    def lengths_frame(self):
        """pandas DataFrame of lengths.parquet: record, id, length, raw_length, assistant_tokens, turns."""
        import pandas as pd  # heavy to import; only this frame needs it

        return pd.read_parquet(self.path / LENGTHS_FILE)

    def dropped_frame(self):
        """pandas DataFrame of dropped.parquet: record, id, raw_length of the samples left out of the store for
        having no assistant token within max_len (skip reason NO_ASSISTANT_WITHIN_MAX_LEN)."""
        import pandas as pd  # heavy to import; only this frame needs it

        return pd.read_parquet(self.path / DROPPED_FILE)

    def raw_lengths(self) -> np.ndarray:
        """(N + dropped,) int64 tokens before truncation of every sample tokenized: the store's, then those of
        `dropped_frame` (what the corpus looks like before max_len, not what training sees)."""
        frames = (self.lengths_frame(), self.dropped_frame())
        return np.concatenate([f["raw_length"].to_numpy(np.int64) for f in frames])

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, samples={len(self)}, tokens={self.num_tokens})"


def build_token_store(source: str = "sharegpt", tokenizer: str = "qwen", template: str = "chatml",
                      max_len: int = 3072, policy: str = "truncate", limit: int = 0,
                      cache_dir: str | Path = ".cache/token_stores", workers: int = 2,
                      progress: bool = True, thinking: str = "off") -> TokenStore:
    """Tokenize `source` into a TokenStore under `cache_dir`, or open the cached one with the same settings.

    max_len: tokens per sample; longer samples are cut (policy="truncate") or skipped and counted
    (policy="drop"); a sample left with no assistant token within max_len is dropped and counted too
    (NO_ASSISTANT_WITHIN_MAX_LEN). limit: records read (0 = all). workers: tokenizer threads.
    """
    DataConfig(source=source, tokenizer=tokenizer, template=template, max_len=max_len, policy=policy,
               limit=limit, cache_dir=str(cache_dir), workers=workers, thinking=thinking)  # validates, ConfigError naming the field
    check_template_name(template)
    settings = StoreSettings(source, tokenizer, template, max_len, policy, limit, thinking)
    key = settings.key()
    final = Path(cache_dir) / key
    if (final / META_FILE).is_file():
        return TokenStore.open(final)
    with writable("the token store cache (-p cache_dir)", final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
    publish_folder(tmp, final, lambda out: _build(settings, key, out, workers, progress),
                   lambda folder: (folder / META_FILE).is_file())
    return TokenStore.open(final)


def publish_folder(tmp: Path, final: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> None:
    """Fill the empty folder `tmp` with build(tmp), then rename it to `final` (on the same file system), so that a
    reader never meets a half-built cache folder. Of two processes racing for one key the loser drops its copy,
    but only when the winner's `is_complete`; on any failure `tmp` is removed and the error raised."""
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # lost a race only if the winner is complete
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_token_store_from_config(cfg: DataConfig, progress: bool = True) -> TokenStore:
    """build_token_store with the settings of a DataConfig section."""
    if not isinstance(cfg, DataConfig):
        raise ConfigError(f"expected a DataConfig, got {type(cfg).__name__}")
    return build_token_store(cfg.source, cfg.tokenizer, cfg.template, cfg.max_len, cfg.policy, cfg.limit,
                             cfg.cache_dir, cfg.workers, progress, cfg.thinking)


@dataclass
class _SampleTable:
    """Per-sample columns collected while building (N small ints; tokens never pass through Python)."""

    record: list[np.ndarray] = field(default_factory=list)
    id: list[str] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)
    raw_length: list[np.ndarray] = field(default_factory=list)
    assistant_tokens: list[np.ndarray] = field(default_factory=list)
    turns: list[np.ndarray] = field(default_factory=list)

    dropped_record: list[int] = field(default_factory=list)  # samples dropped: no assistant token within max_len
    dropped_id: list[str] = field(default_factory=list)
    dropped_raw_length: list[int] = field(default_factory=list)

    def write(self, path: Path, dropped_path: Path) -> None:
        import pyarrow as pa  # heavy to import; only parquet needs it
        import pyarrow.parquet as pq

        cols = {name: np.concatenate(getattr(self, name)) for name in
                ("record", "length", "raw_length", "assistant_tokens", "turns")}
        table = pa.table(dict(record=cols["record"], id=pa.array(self.id, pa.string()), length=cols["length"],
                              raw_length=cols["raw_length"], assistant_tokens=cols["assistant_tokens"],
                              turns=cols["turns"]))
        pq.write_table(table, path)
        pq.write_table(pa.table(dict(record=pa.array(self.dropped_record, pa.int64()),
                                     id=pa.array(self.dropped_id, pa.string()),
                                     raw_length=pa.array(self.dropped_raw_length, pa.int64()))), dropped_path)


def _progress_bar(**kwargs):
    """tqdm.auto (a widget in notebooks) when ipywidgets is there, else the text bar without tqdm's warning."""
    try:
        import ipywidgets  # noqa: F401
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm(mininterval=1.0, **kwargs)


def _build(settings: StoreSettings, key: str, out: Path, workers: int, progress: bool) -> None:
    tok = load_tokenizer(settings.tokenizer)
    template = get_template(settings.template, tok, settings.thinking)
    stream = load_conversations(settings.source, settings.limit)
    table = _SampleTable()
    report_extra = dict(truncated=0, raw=0, stored=0)
    store_skips = LoadReport(source=settings.source)  # records the reader kept and the store leaves out
    bar = _progress_bar(total=settings.limit or None, unit="record", desc=f"tokenizing {settings.source}",
               disable=not progress)
    pending: deque[tuple[Future, list[Conversation]]] = deque()
    t0 = time.perf_counter()
    with open(out / TOKENS_FILE, "wb") as f_tok, open(out / MASK_FILE, "wb") as f_mask, \
            ThreadPoolExecutor(workers, thread_name_prefix="tokenize") as pool:

        def drain(until: int) -> None:
            while len(pending) > until:
                future, convs = pending.popleft()
                _write_chunk(future.result(), convs, settings, f_tok, f_mask, table, report_extra, store_skips)
                bar.update(stream.report.records_seen - bar.n)
                bar.set_postfix(Mtok=f"{report_extra['stored'] / 1e6:.1f}", refresh=False)

        chunk, segments, chars = [], [], 0
        try:
            for conv in stream:
                turns = tuple((role, tok.prepare(content)) for role, content in conv.turns)
                try:
                    segs = template.segments(turns)
                except TemplateError:
                    store_skips.skip(TEMPLATE_ERROR, conv.where)
                    continue
                chunk.append(conv)
                segments.append(segs)
                chars += sum(len(c) for _, c in turns)
                if chars >= CHUNK_CHARS:
                    pending.append((pool.submit(tok.encode_conversations, segments), chunk))
                    chunk, segments, chars = [], [], 0
                    drain(2 * workers)  # bounded: at most 2*workers chunks in flight
            if chunk:
                pending.append((pool.submit(tok.encode_conversations, segments), chunk))
            drain(0)
        finally:
            for future, _ in pending:
                future.cancel()
            bar.close()
    report = stream.report
    _finish_report(report, table, report_extra, store_skips, settings)
    lengths = np.concatenate(table.length)
    np.save(out / OFFSETS_FILE, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    table.write(out / LENGTHS_FILE, out / DROPPED_FILE)
    (out / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=1))
    meta = dict(format=STORE_FORMAT_VERSION, key=key, settings=asdict(settings), samples=len(lengths),
                tokens=int(lengths.sum()), build_seconds=round(time.perf_counter() - t0, 3),
                tokenizer=_tokenizer_facts(tok), template=template.name)
    (out / META_FILE).write_text(json.dumps(meta, indent=1))  # last: its presence marks the store complete


def _write_chunk(batch: EncodedBatch, convs: list[Conversation], settings: StoreSettings, f_tok, f_mask,
                 table: _SampleTable, extra: dict[str, int], skips: LoadReport) -> None:
    """Apply the max_len policy to one encoded chunk and append it to the store files. A sample the policy
    leaves with no assistant token (all of them past max_len) is dropped here, counted in `skips`, so that it
    never reaches a sampler."""
    raw = batch.lengths  # (n,)
    starts = np.cumsum(raw) - raw  # (n,)
    allowed = raw <= settings.max_len if settings.policy == "drop" else np.ones(len(raw), bool)  # (n,)
    sample_of, keep = None, None  # (T,) sample index of each token; (T,) token kept (None: all)
    if raw.max(initial=0) <= settings.max_len and raw.min(initial=1) > 0:  # common case: nothing to cut
        length = raw
        assistant = np.add.reduceat(batch.mask, starts, dtype=np.int64) if len(raw) else np.zeros(0, np.int64)
    else:
        sample_of = np.repeat(np.arange(len(raw)), raw)
        if settings.policy == "truncate":
            keep = np.arange(len(batch.ids)) - starts[sample_of] < settings.max_len  # position < max_len
        else:
            keep = allowed[sample_of]
        kept_of = sample_of[keep]  # (T',)
        length = np.bincount(kept_of, minlength=len(raw))  # (n,) after the policy (0 when dropped)
        assistant = np.bincount(kept_of, weights=batch.mask[keep], minlength=len(raw)).astype(np.int64)  # (n,)
    unlearnable = allowed & (assistant == 0)  # (n,)
    keep_sample = allowed & ~unlearnable  # (n,)
    if unlearnable.any():
        sample_of = np.repeat(np.arange(len(raw)), raw) if sample_of is None else sample_of
        keep = keep_sample[sample_of] if keep is None else keep & keep_sample[sample_of]
    ids, mask = (batch.ids, batch.mask) if keep is None else (batch.ids[keep], batch.mask[keep])  # (T',)
    extra["truncated"] += int(np.sum(keep_sample & (raw > settings.max_len)))  # (policy "truncate" only)
    for i in np.flatnonzero(~allowed):
        skips.skip(OVER_MAX_LEN, convs[i].where)
    for i in np.flatnonzero(unlearnable):
        skips.skip(NO_ASSISTANT_WITHIN_MAX_LEN, convs[i].where)
        table.dropped_record.append(convs[i].record)
        table.dropped_id.append(convs[i].id)
        table.dropped_raw_length.append(int(raw[i]))
    length, assistant = length[keep_sample], assistant[keep_sample]
    f_tok.write(np.ascontiguousarray(ids, "<u4").data)  # no copy
    f_mask.write(np.ascontiguousarray(mask, np.uint8).data)
    kept = [c for c, k in zip(convs, keep_sample) if k]
    extra["raw"] += int(raw[keep_sample].sum())
    extra["stored"] += len(ids)
    table.record.append(np.array([c.record for c in kept], np.int64))
    table.id.extend(c.id for c in kept)
    table.length.append(length.astype(np.int64))
    table.raw_length.append(raw[keep_sample].astype(np.int64))
    table.assistant_tokens.append(assistant)
    table.turns.append(np.array([len(c.turns) for c in kept], np.int64))


def _finish_report(report: LoadReport, table: _SampleTable, extra: dict[str, int], store_skips: LoadReport,
                   s: StoreSettings) -> None:
    report.absorb(store_skips)
    samples = int(sum(len(x) for x in table.length))
    if samples == 0:
        raise DataError(f"source {s.source!r}: no sample left after templating and max_len={s.max_len} "
                        f"policy={s.policy!r} (skipped by reason: {report.skipped})")
    report.truncated_max_len = extra["truncated"]
    report.raw_tokens = extra["raw"]
    report.total_tokens = int(sum(int(x.sum()) for x in table.length))
    report.assistant_tokens = int(sum(int(x.sum()) for x in table.assistant_tokens))


def _tokenizer_facts(tok: ChatTokenizer) -> dict[str, Any]:
    return dict(name=tok.name, n_vocab=tok.n_vocab, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                pad_id=tok.pad_id)
