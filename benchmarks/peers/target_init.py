"""A drafter folder whose decoder layer starts as the target's last one: the "initialise the drafter's layers from the
target's" lever, measured on the peers' job by spread.py (`-p init_from` this folder; docs/peers.md).

    .venv/bin/python -P benchmarks/peers/target_init.py --like runs/peers/ours/export --out runs/peers/spread/target-init

Reads the shape and names from an exported drafter of the job (`--like`: config.json and model.safetensors, fp32)
and writes the same layout to `--out`: drafter layer i <- the target's layer L - n + i (its attention and MLP
projections and both norms; the drafter's q/k norms, which a Llama layer has not, stay 1), the final norm <- the
target's, the fused projection `fc` drawn N(0, initializer_range) from `--seed`, `hidden_norm` 1: what `init_from`
loads in place of the random init.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_lib.models.target_config import weight_files


def target_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the target folder's safetensors, by name."""
    out: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        with safe_open(str(folder / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", required=True, help="an exported drafter of the job (fp32)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    like, out = Path(a.like), Path(a.out)
    cfg = json.loads((like / "config.json").read_text())
    target = Path(cfg["dflash_config"]["training"]["target"]["name"])
    theirs = target_tensors(target)
    n, last = int(cfg["num_hidden_layers"]), int(cfg["dflash_config"]["training"]["target"]["num_hidden_layers"])
    std = float(cfg["dflash_config"]["training"]["initializer_range"])
    torch.manual_seed(a.seed)
    weights = {}
    with safe_open(str(like / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            x = f.get_tensor(key)
            if key.startswith("layers."):
                i, rest = key.split(".", 2)[1:]
                src = f"model.layers.{last - n + int(i)}.{rest}"
                x = theirs[src] if src in theirs else torch.ones_like(x)  # q_norm / k_norm: not in a Llama layer
            elif key == "norm.weight":
                x = theirs["model.norm.weight"]
            elif key == "fc.weight":
                x = torch.randn_like(x) * std
            elif key == "hidden_norm.weight":
                x = torch.ones_like(x)
            weights[key] = x.clone().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(like / "config.json", out / "config.json")
    print(out)


if __name__ == "__main__":
    main()
