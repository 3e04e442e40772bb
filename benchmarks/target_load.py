"""What loading a local target costs: seconds and peak host RSS of `target.local.load_pretrained` (transformers'
`from_pretrained`) vs the hand-written safetensors loader it replaced, on a ~500 M-parameter random Qwen3 folder.

Run: .venv/bin/python -P benchmarks/target_load.py [--dir PATH] [--device cpu|cuda] [--dtype bfloat16|float32]
The folder (Qwen3-0.6B's shapes at 24 layers, the real vocabulary, tied embeddings, bf16: ~1.07 GB) is written
once to `--dir` (default: a folder in the system temp dir) and reused. Each loader then runs in a FRESH
subprocess, which reports: seconds to load, then reads every tensor once (on CPU a memory-mapped weight is only
read from disk when used: residency is what a run pays), and its peak RSS (VmHWM) above what it held before
loading (torch and transformers imported), as a multiple of the model's bytes in `--dtype`. The goal: <= ~1.2x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]  # tokenize.py

import torch  # noqa: E402
import transformers  # noqa: E402

from dflash_lib.families.qwen3 import QWEN3_VOCAB  # noqa: E402
from dflash_lib.models.target_config import local_hf_config, weight_files  # noqa: E402
from dflash_lib.target.attention import IMPLEMENTATION  # noqa: E402
from dflash_lib.target.local import load_pretrained  # noqa: E402

SHAPE = dict(vocab_size=QWEN3_VOCAB, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
             max_position_embeddings=40960)  # Qwen3-0.6B's config.json, 24 of its 28 layers: ~533 M parameters


def write_folder(directory: Path) -> None:
    """A random bf16 Qwen3 of SHAPE saved by `save_pretrained` into `directory`, unless it is there already."""
    if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
        return
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(directory)


def load_local_before_issue_24(directory: str | Path, hf_cfg: transformers.PretrainedConfig,
                               device: torch.device | str, dtype: torch.dtype,
                               attn_implementation: str = "sdpa") -> transformers.PreTrainedModel:
    """THE OLD LOADER, kept here only to compare with (it was `models.target.load_local` until issue 24): the
    model built on `device` by `from_config` (a random init), then each safetensors key copied in by hand (no key
    conversions: a fused-experts checkpoint could not load)."""
    from safetensors import safe_open

    root = Path(directory)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype,
                                                              attn_implementation=attn_implementation)
    slots = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in weight_files(root):
            with safe_open(str(root / name), framework="pt", device=str(torch.device(device))) as f:
                for key in f.keys():
                    slots[key].copy_(f.get_tensor(key))
    return model


def memory(field: str) -> int:
    """This process' `field` of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes. Not
    `ru_maxrss`: Linux carries that over from the parent across fork and exec, and the parent wrote the folder."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise SystemExit(f"/proc/self/status has no {field} (Linux only)")


def child(loader: str, directory: Path, device: str, dtype: torch.dtype) -> dict:
    """One load in this (fresh) process: seconds, and peak RSS above the RSS before it, in bytes."""
    before = memory("VmRSS")
    hf_cfg = local_hf_config(directory)
    start = time.perf_counter()
    load = load_pretrained if loader == "from_pretrained" else load_local_before_issue_24
    model = load(directory, hf_cfg, device, dtype, IMPLEMENTATION["sdpa"])
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with torch.no_grad():  # read every weight once: a memory-mapped one is only resident once read
        checksum = sum(float(p.sum(dtype=torch.float32)) for p in model.parameters())  # no fp32 copy
    peak = memory("VmHWM")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(loader=loader, seconds=seconds, rss_before=before, rss_peak=peak, model_bytes=model_bytes,
                parameters=sum(p.numel() for p in model.parameters()), checksum=checksum,
                dtype=str(next(model.parameters()).dtype), device=str(next(model.parameters()).device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dflash_target_load_qwen3_533m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--child", choices=["from_pretrained", "load_local"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.device, dtype)))
        return
    start = time.perf_counter()
    write_folder(args.dir)
    print(f"folder {args.dir} ready in {time.perf_counter() - start:.1f} s")
    rows = []
    for loader in ("from_pretrained", "load_local"):
        out = subprocess.run([sys.executable, "-P", __file__, "--child", loader, "--dir", str(args.dir),
                              "--device", args.device, "--dtype", args.dtype],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'loader':<16} {'params':>8} {'model GB':>9} {'load s':>7} {'RSS before GB':>14} {'peak GB':>8} "
          f"{'peak - before':>14} {'x model':>8}")
    for r in rows:
        grown = r["rss_peak"] - r["rss_before"]
        print(f"{r['loader']:<16} {r['parameters'] / 1e6:>7.0f}M {r['model_bytes'] / 1e9:>9.3f} {r['seconds']:>7.2f} "
              f"{r['rss_before'] / 1e9:>14.3f} {r['rss_peak'] / 1e9:>8.3f} {grown / 1e9:>14.3f} "
              f"{grown / r['model_bytes']:>8.2f}")
    assert rows[0]["checksum"] == rows[1]["checksum"], "the two loaders loaded different weights"
    print(f"device {rows[0]['device']}, dtype {rows[0]['dtype']}; both loaders read the same weights (checksums equal)")


if __name__ == "__main__":
    main()
