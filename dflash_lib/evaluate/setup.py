"""What an evaluation decodes with: the drafter folder and its run (`find_drafter`), the config laid over the run's
(`build_config`), the target, the saved drafter on it and the prompts, each checked before a weight is read
(`prepare` -> `Setup`: the drafter fits the target, the engine is at hand, the prompts fit the target's positions
and vocabulary). The run folder is read through `rundir.reader`.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import httpx
import torch

from dflash_lib.config import FLAT_FIELDS, Config, ConfigError, from_params
from dflash_lib.data.benchmarks import HELDOUT
from dflash_lib.data.prompts import PromptGroup, PromptSets, prompt_sets, thinking_modes
from dflash_lib.families import text_config
from dflash_lib.models import export
from dflash_lib.models.drafters import drafter_kind
from dflash_lib.models.export import init_from, read_drafter
from dflash_lib.models.target_config import target_hf_config
from dflash_lib.rundir.reader import CONFIG_FILE, DRAFTER_DIR
from dflash_lib.serve.client import EngineClient
from dflash_lib.serve.measure import check_served_model
from dflash_lib.serve.server import engine_python
from dflash_lib.target.local import TargetModel


Say = Callable[[str], None]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


def find_drafter(path: str | Path) -> tuple[Path, Path | None, dict[str, Any] | None]:
    """(the drafter folder, the trainer run folder or None, the run's recorded flat config or None) for a
    drafter folder or a trainer run folder (`drafter/` inside it)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"--drafter {str(p)!r}: no such directory")
    run_dir, drafter_dir = (p, p / DRAFTER_DIR) if (p / DRAFTER_DIR).is_dir() else (p.parent, p)
    cfg = run_dir / CONFIG_FILE
    if cfg.is_file():
        doc = json.loads(cfg.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("config"), dict):  # a trainer run's config.json
            recorded = {k: v for sec in doc["config"].values() if isinstance(sec, dict) for k, v in sec.items()}
            return drafter_dir, run_dir, recorded
    return drafter_dir, None, None


def build_config(params: Mapping[str, Any], target: str | None,
                 recorded: Mapping[str, Any] | None = None) -> tuple[Config, list[str]]:
    """`-p` pairs (config fields, the evaluation's included) laid over a run's recorded config; the recorded keys
    this version no longer has are dropped and listed. `target` None: `-p target`, else the run's recorded one
    (ConfigError when there is neither)."""
    dropped: list[str] = []
    base = None
    if recorded:
        dropped = sorted(k for k in recorded if k not in FLAT_FIELDS)
        base = from_params({k: v for k, v in recorded.items() if k in FLAT_FIELDS})
    if target is None:
        target = params.get("target", (recorded or {}).get("target"))
        if target is None:
            raise ConfigError("--target is required: the drafter is not in a trainer run folder (config.json), so "
                              "no target is recorded; give --target tiny or a local model folder")
    return from_params({**params, "target": target}, base), dropped


@dataclass
class Setup:
    config: Config
    drafter_dir: Path  # the saved drafter (a run's final drafter/)
    run_dir: Path | None  # the trainer run folder, when the drafter came from one
    target: Any  # TargetModel
    drafter: Any  # the saved drafter on the target, in eval mode
    prompts: PromptSets

    @property
    def stop_ids(self) -> list[int]:
        return [self.prompts.eos_id] if self.config.evaluate.stop_at_eos else []

    @property
    def min_new_tokens(self) -> int:
        """Output tokens before the end-of-turn token may end an answer (`regenerate.min_new_tokens`)."""
        return self.config.regenerate.min_new_tokens

    def sampling(self) -> dict[str, Any]:
        """The decoders' sampling arguments: `-p temperature` and `top_p` (the regenerate section's, the same
        quantity: how the target answers) and a fresh CPU generator seeded `-p sample_seed` (each decoding
        draws the same stream)."""
        r = self.config.regenerate
        return {"temperature": r.temperature, "top_p": r.top_p,
                "generator": torch.Generator().manual_seed(self.config.evaluate.sample_seed)}


def prepare(drafter: str | Path, target: str | None, params: Mapping[str, Any] | None = None,
            say: Say = _stderr) -> Setup:
    """Config (a run's recorded one under `params`), target (bf16 on CUDA, fp32 on CPU, as the trainer runs
    it), the saved drafter on it (refused first when it does not fit) and the held-out prompts, every vocabulary
    id checked against the target. `target` None: the run's recorded one (`build_config`)."""
    drafter_dir, run_dir, recorded = find_drafter(drafter)
    config, dropped = build_config(dict(params or {}), target, recorded)
    if run_dir is not None:
        say(f"run config from {run_dir / CONFIG_FILE}" + (f" (dropped keys this version lacks: {dropped})"
                                                             if dropped else ""))
        was = (recorded or {}).get("target")
        if was is not None and was != config.model.target:
            say(f"note: the run trained against target {was!r}; evaluating against {config.model.target!r}")
    device_name = config.train.device
    if device_name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but CUDA is not available")
    device = torch.device("cuda" if device_name != "cpu" and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the trainer runs the target
    check_fit(drafter_dir, config)  # before the target is built: its own checks would blame the wrong setting
    check_engine(config)
    tgt = TargetModel.from_model_config(config.model, device=device, dtype=dtype, seed=config.train.seed)
    model = load_drafter(drafter_dir, tgt)
    prompts = prompt_sets(config, run_dir)
    _check_vocabulary(prompts.prompts, tgt, config)
    for group in prompts.groups:
        check_positions(group, target_positions(tgt), config.regenerate.max_new_tokens, model.cfg.block_size)
    if config.evaluate.enable_thinking and all(g.benchmark == HELDOUT for g in prompts.groups):
        say("note: enable_thinking renders benchmark prompts only; the held-out prompts keep the token store's "
            f"rendering (thinking {config.data.thinking!r})")
    if config.data.template == "chatml" and len(thinking_modes(config)) > 1:
        say("note: template 'chatml' has no thinking mode: 'on' and 'off' render the same prompts "
            "(-p template qwen3 or hf for a Qwen3 target)")
    lengths = [len(p) for p in prompts.prompts]
    say(f"prompts: {prompts.source}; {len(lengths)} prompts of {min(lengths)}..{max(lengths)} tokens, "
        f"max_new_tokens {config.regenerate.max_new_tokens}, device {device}, target {config.model.target!r} "
        f"({dtype})")
    return Setup(config, drafter_dir, run_dir, tgt, model, prompts)


def check_engine(config: Config) -> None:
    """`-p engine vllm` needs the target as a local folder (the engine serves a folder) and an engine: a running
    server (`engine_url`) serving that target (`check_served_model`) or a Python with vllm (`serve.engine_python`).
    ConfigError before any weight is read."""
    e = config.evaluate
    if e.engine == "none":
        return
    if not Path(config.model.target).expanduser().is_dir():
        raise ConfigError(f"engine {e.engine}: the engine serves a local target folder; target "
                          f"{config.model.target!r} is not one (-p target DIR)")
    if not e.engine_url:
        engine_python(e.engine_python or None)
        return
    client = EngineClient(e.engine_url)
    try:
        check_served_model(client, config.model.target, 0)  # another target's server: refused before any load
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:  # none, or no OpenAI server's
        raise ConfigError(f"engine_url {e.engine_url}: no usable answer to /v1/models ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]})") from None
    finally:
        client.close()


def target_positions(target: Any) -> int | None:
    """The target's RoPE positions (`max_position_embeddings` of its text config); None when it names none."""
    hf = target.hf
    text = text_config(hf)
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if n else None


def check_positions(group: PromptGroup, positions: int | None, max_new_tokens: int, block_size: int) -> None:
    """Refuse a prompt group whose decoding could run past the target's `positions` (its max_position_embeddings):
    a prompt of P tokens needs P + max_new_tokens + block_size positions (the answer, then one draft block past
    it). Past them RoPE extrapolates without an error and the figures would measure a model outside its range.
    ConfigError naming the set, turn, longest prompt and the -p that fits it; None `positions`: no check."""
    if positions is None:
        return
    over = [(len(p), name) for p, name in zip(group.prompts, group.names)
            if len(p) + max_new_tokens + block_size > positions]
    if over:
        n, name = max(over)
        fit = positions - n - block_size
        raise ConfigError(
            f"prompt set {group.benchmark!r} (turn {group.turn}, thinking {group.thinking}): {len(over)} of "
            f"{len(group.prompts)} prompts need more than the target's {positions} positions "
            f"(max_position_embeddings): the longest, {name}, has {n} tokens + max_new_tokens {max_new_tokens} + a "
            f"block of {block_size} = {n + max_new_tokens + block_size}; "
            + (f"-p max_new_tokens {fit} or fewer fits it, " if fit > 0 else "")
            + "or leave that set out of -p prompts_from")


def _check_vocabulary(prompts: Sequence[Sequence[int]], target: Any, config: Config) -> None:
    too_big = [i for p in prompts for i in p if i >= target.vocab_size]
    if too_big:
        raise ConfigError(f"tokenizer {config.data.tokenizer!r} gives ids up to {max(too_big)}, beyond the target's "
                          f"{target.vocab_size} embedding rows")


def check_fit(drafter_dir: Path, config: Config) -> None:
    """Refuse a drafter made for another target shape than `config`'s target has, from the drafter's config.json
    and the target's (no weights): hidden size, decoder layers, fused feature layers, each named with the
    drafter's and the target's value and the -p that sets it. DFlashDrafter.load checks the rest (vocabulary,
    the exact layer ids) once the target is built."""
    try:
        mine = export.drafter_config(export.read_doc(drafter_dir), str(drafter_dir / export.CONFIG_FILE))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    m = config.model
    theirs = target_hf_config(m)
    tiny = m.target == "tiny"  # its shape is set by -p; any other target's is its own
    rows = [("hidden size", mine.hidden_size, "the target's", theirs.hidden_size, "hidden_size" if tiny else ""),
            ("target layers", mine.target_num_layers, "the target has", theirs.num_hidden_layers,
             "target_layers" if tiny else ""),
            ("fused features", len(mine.target_layer_ids), "num_features is", len(m.target_layer_ids) or m.num_features,
             "num_features")]
    bad = [f"{what} {a} ({whose} {b}" + (f"; -p {key} {a})" if key else ")")
           for what, a, whose, b, key in rows if a != b]
    if bad:
        raise ConfigError(f"drafter {drafter_dir} does not fit target {m.target!r}: drafter " + ", ".join(bad))


def load_drafter(directory: str | Path, target: Any) -> Any:
    """A saved/exported drafter on `target`, in eval mode; ConfigError for a missing folder."""
    try:
        model = read_drafter(directory, target)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    return model.eval()


def initial_drafter(config: Config, target: Any) -> Any:
    """The drafter a training run of `config` starts from (`build.build_parts`): built after
    `torch.manual_seed(seed)` on the target's device, then `init_from` when set. The caller's RNG is untouched."""
    devices = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.train.seed)
        drafter = drafter_kind(config.model.drafter_kind).build(config.model, target)
    if config.model.init_from:
        init_from(drafter, config.model.init_from)
    return drafter.eval()


@contextmanager
def decode_threads(setup: Setup) -> Iterator[None]:
    """torch's intra-op threads set to `decode_threads` (when > 0 and the target is on the CPU), then restored."""
    n, before = setup.config.evaluate.decode_threads, torch.get_num_threads()
    if n > 0 and setup.target.device.type == "cpu":
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
