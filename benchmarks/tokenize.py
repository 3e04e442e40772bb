"""Tokenize the whole bundled corpus into a fresh token store; measure throughput, cached reload and memory.

Targets (2-core machine): cold build >= 3M tokens/s, cached reload <= 1 s, peak RSS <= 2x the store on disk.
Each measurement runs in a fresh Python process so that peak RSS and the reload time are honest. Also prints
a stage breakdown (JSON parse, template, tokenizer) to show where the time goes.

    .venv/bin/python benchmarks/tokenize.py [--workers 2] [--max-len 3072] [--source sharegpt]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

TARGET_TOKENS_PER_S = 3e6
TARGET_RELOAD_S = 1.0
TARGET_RSS_OVER_STORE = 2.0

COLD = """
import json, resource, time
from dflash_lib.data import build_token_store, load_tokenizer
t0 = time.perf_counter()
store = build_token_store({source!r}, max_len={max_len}, cache_dir={cache!r}, workers={workers}, progress=False)
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(dict(wall=wall, cpu=ru.ru_utime + ru.ru_stime, tokens=store.num_tokens, raw_tokens=store.report.raw_tokens, samples=len(store),
                      disk=store.disk_bytes(), rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""

BASELINE = """
import json, resource
from dflash_lib.data import load_tokenizer, build_token_store
tok = load_tokenizer("qwen")
print(json.dumps(dict(rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""

RELOAD = """
import json, time
t_import = time.perf_counter()
from dflash_lib.data import build_token_store
t0 = time.perf_counter()
store = build_token_store({source!r}, max_len={max_len}, cache_dir={cache!r}, workers={workers}, progress=False)
n = len(store)
ids, mask = store[n // 2]
total = int(ids.sum()) + int(mask.sum())  # touch one sample
lengths = store.lengths
t1 = time.perf_counter()
print(json.dumps(dict(reload=t1 - t0, imports=t0 - t_import)))
"""

STAGES = """
import json, time
from dflash_lib.data import load_conversations, load_tokenizer, ChatMLTemplate
t0 = time.perf_counter(); tok = load_tokenizer("qwen"); t_tok = time.perf_counter() - t0
t0 = time.perf_counter(); convs = list(load_conversations({source!r})); t_parse = time.perf_counter() - t0
template = ChatMLTemplate()
t0 = time.perf_counter()
segs = [template.segments(tuple((r, tok.prepare(c)) for r, c in conv.turns)) for conv in convs]
t_template = time.perf_counter() - t0
t0 = time.perf_counter()
n = 0
for i in range(0, len(segs), 256):
    n += len(tok.encode_conversations(segs[i:i + 256]).ids)
t_encode = time.perf_counter() - t0
print(json.dumps(dict(load_tokenizer=t_tok, parse=t_parse, template=t_template, encode_1_thread=t_encode,
                      tokens=n)))
"""


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"benchmark step failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="sharegpt")
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dflash_bench_") as cache:
        kw = dict(source=args.source, max_len=args.max_len, cache=cache, workers=args.workers)
        cold = run(COLD.format(**kw))
        reload = run(RELOAD.format(**kw))
    base = run(BASELINE)
    stages = run(STAGES.format(**kw))

    tps = cold["tokens"] / cold["wall"]
    disk_mb = cold["disk"] / 2**20
    ratio = cold["rss_mb"] / disk_mb
    print(f"load average before: {' '.join(f'{x:.1f}' for x in load)} (1/5/15 min) on {os.cpu_count()} cores; "
          "other jobs on the machine slow every figure")
    print(f"corpus {args.source}: {cold['samples']:,} samples, {cold['tokens']:,} tokens in the store "
          f"({cold['raw_tokens']:,} before truncation at max_len={args.max_len}), workers={args.workers}")
    print(f"cold build     {cold['wall']:7.2f} s   {tps / 1e6:5.2f} M tokens/s stored "
          f"({cold['raw_tokens'] / cold['wall'] / 1e6:.2f} M/s tokenized)   "
          f"target >= {TARGET_TOKENS_PER_S / 1e6:.0f} M/s   {'PASS' if tps >= TARGET_TOKENS_PER_S else 'FAIL'}")
    print(f"               CPU time {cold['cpu']:.2f} s (whole process); {cold['cpu'] / cold['wall']:.2f} cores busy on "
          f"average: well under {args.workers} means other jobs took the cores")
    print(f"cached reload  {reload['reload']:7.3f} s   (open + one sample + lengths; imports {reload['imports']:.2f} s "
          f"not counted)   target <= {TARGET_RELOAD_S:.0f} s   "
          f"{'PASS' if reload['reload'] <= TARGET_RELOAD_S else 'FAIL'}")
    print(f"peak RSS       {cold['rss_mb']:7.1f} MiB  store on disk {disk_mb:.1f} MiB  ratio {ratio:.2f}x "
          f"(process with tokenizer loaded, before building: {base['rss_mb']:.1f} MiB)   "
          f"target <= {TARGET_RSS_OVER_STORE:.0f}x   {'PASS' if ratio <= TARGET_RSS_OVER_STORE else 'FAIL'}")
    print(f"stages, one thread: load tokenizer {stages['load_tokenizer']:.2f} s, JSON parse {stages['parse']:.2f} s, "
          f"template {stages['template']:.2f} s, tokenize+mask {stages['encode_1_thread']:.2f} s "
          f"({stages['tokens'] / stages['encode_1_thread'] / 1e6:.2f} M tokens/s)")


if __name__ == "__main__":
    main()
