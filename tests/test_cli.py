"""The command line's error contract: a user error (ConfigError, DataError, BucketError, SamplerError, a missing
file, ...) is ONE line `error: ...` on stderr and exit code 2; a failed run one line and exit 1; a bug keeps its
traceback; `--debug` shows every traceback. And a corpus too small for the requested buckets trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_lib.__main__ import main
from dflash_lib.config import ConfigError
from dflash_lib.data.readers import DataError
from dflash_lib.data.templates import TemplateError
from dflash_lib.plan.buckets import BucketError, BucketFitError
from dflash_lib.plan.sampler import SamplerError
from dflash_lib.train.pipeline import PipelineError
from run_folder import metrics_rows

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}


def cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_lib", *args], cwd=cwd, env=env or ENV, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_missing_corpus_is_one_error_line_and_exit_2_the_traceback_only_with_debug(tmp_path):
    """... and no run folder: the source is opened before the folder is made (given with --run-dir, or a new
    one under the runs root)."""
    args = ["train", "--preset", "smoke", "-p", "source", "/no/such.jsonl"]
    proc = cli(*args, "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()]  # one line, nothing else on stderr
    assert proc.stderr.startswith("error: ") and "/no/such.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "r").exists()
    runs_root = tmp_path / "runs"
    runs_root.mkdir()
    debug = cli("--debug", *args, env={**ENV, "DFLASH_RUNS_ROOT": str(runs_root)})
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr and "DataError: source '/no/such.jsonl'" in debug.stderr
    assert list(runs_root.iterdir()) == []


def _fail_with(monkeypatch, exc: BaseException) -> None:
    """`run` (any notebook) raises `exc`, as the notebook runner would."""
    def execute(*args, **kwargs):
        raise exc
    monkeypatch.setattr("dflash_lib.lab.runs.execute", execute)


@pytest.mark.parametrize("exc, shown", [
    (ConfigError("unknown parameter 'bogus'"), "error: unknown parameter 'bogus'"),
    (DataError("corpus.jsonl:3: not JSON"), "error: corpus.jsonl:3: not JSON"),
    (TemplateError("record 7: no assistant turn"), "error: record 7: no assistant turn"),
    (BucketError("edges must be strictly ascending,\n  got [8, 4]"), "error: edges must be strictly ascending, got [8, 4]"),
    (BucketFitError("buckets that can never fit:\n  bucket 2"), "error: buckets that can never fit: bucket 2"),
    (SamplerError("sample 1 has 300 tokens"), "error: sample 1 has 300 tokens"),
    (FileNotFoundError(2, "No such file or directory", "/data/x.parquet"),
     "error: No such file or directory: /data/x.parquet"),
])
def test_user_errors_are_one_line_and_exit_2(monkeypatch, capsys, exc, shown):
    _fail_with(monkeypatch, exc)
    assert main(["run", "01_length_analysis"]) == 2
    assert capsys.readouterr().err == shown + "\n"


def test_debug_shows_the_traceback_of_a_user_error_before_or_after_the_command(monkeypatch, capsys):
    _fail_with(monkeypatch, BucketError("k must be an int >= 1"))
    for argv in (["--debug", "run", "nb"], ["run", "nb", "--debug"]):
        with pytest.raises(BucketError, match="k must be"):
            main(argv)
    assert capsys.readouterr().err == ""


def test_a_bug_keeps_its_traceback(monkeypatch):
    _fail_with(monkeypatch, ZeroDivisionError("division by zero"))
    with pytest.raises(ZeroDivisionError):
        main(["run", "nb"])


def test_a_user_error_inside_a_notebook_is_one_line_a_bug_there_is_not(monkeypatch, capsys):
    from papermill.exceptions import PapermillExecutionError

    cell = dict(cell_index=4, exec_count=3, source="load_lengths(...)", traceback=["..."])
    _fail_with(monkeypatch, PapermillExecutionError(ename="ConfigError", evalue="lengths_from: /no/such does not "
                                                    "exist", **cell))
    assert main(["run", "02_bucket_optimization"]) == 2
    assert capsys.readouterr().err == ("error: ConfigError: lengths_from: /no/such does not exist "
                                       "(notebook cell [3])\n")
    _fail_with(monkeypatch, PapermillExecutionError(ename="TemplateError", evalue="record 2", **cell))
    assert main(["run", "01_length_analysis"]) == 2  # a subclass of a user error, by name
    _fail_with(monkeypatch, PapermillExecutionError(ename="IndexError", evalue="out of range", **cell))
    with pytest.raises(PapermillExecutionError):
        main(["run", "02_bucket_optimization"])


def test_a_failed_training_run_is_one_line_and_exit_1_its_traceback_with_debug(monkeypatch, capsys, tmp_path):
    def train(*args, **kwargs):
        raise PipelineError("stage 'target[0]' failed: RuntimeError: boom", stage="target[0]")
    monkeypatch.setattr("dflash_lib.train.loop.train", train)
    args = ["train", "--preset", "smoke", "--run-dir", str(tmp_path)]
    assert main(args) == 1
    assert capsys.readouterr().err == "error: PipelineError: stage 'target[0]' failed: RuntimeError: boom\n"
    with pytest.raises(PipelineError):
        main(args + ["--debug"])


def _corpus(path: Path, answers: list[int]) -> Path:
    """A JSONL corpus of one conversation per entry of `answers` (words in the assistant's answer)."""
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}: " + "why " * (3 * i + 1)},
                               {"from": "gpt", "value": f"Answer {i}: " + "because " * n}]}
            for i, n in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("answers, k, buckets", [([12], 4, 2), ([5, 17, 40], 6, 4)],
                         ids=["one-record", "three-records"])
def test_a_corpus_with_fewer_lengths_than_buckets_trains_and_says_so_once(tmp_path, answers, k, buckets):
    """One record has 1 length: 2 buckets (its own and the empty top one up to max_len) of smoke's k=4; three
    records have 3 lengths: 4 buckets of k=6."""
    corpus = _corpus(tmp_path / "corpus.jsonl", answers)
    run_dir = tmp_path / "run"
    proc = cli("train", "--preset", "smoke", "-p", "source", str(corpus), "-p", "k", str(k), "-p", "steps", "3",
               "-p", "heldout_fraction", "0", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "buckets requested" in line]
    assert warnings == [f"k={k} buckets requested, but the {len(answers)} sample(s) have only {len(answers)} "
                        f"distinct length(s): planning {buckets} bucket(s), one per length, the last one up to "
                        f"max_len=512"], proc.stderr[-3000:]
    rows = metrics_rows(run_dir)
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3] and all(r["bucket"] < buckets for r in rows if "bucket" in r)
    assert proc.stdout.strip().splitlines()[-1] == str(run_dir)


def test_bad_settings_and_a_folder_as_corpus_are_one_line_before_any_run_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "-p", "lr", "1e9", "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err == "error: lr must be in (0, 1], got 1000000000.0\n"
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    assert main(["train", "--preset", "smoke", "-p", "source", str(corpus_dir), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: source '{corpus_dir}' is a directory; give one .json/.jsonl/.parquet file")
    assert not run_dir.exists()


@pytest.mark.parametrize("command", ["train", "dryrun", "plan"])
def test_a_parameter_given_twice_is_one_line_before_any_work(command, tmp_path, capsys):
    """Every subcommand reads its -p pairs through the one parser."""
    run_dir = ["--run-dir", str(tmp_path / "run")] if command == "train" else []
    assert main([command, *run_dir, "--preset", "smoke", "-p", "k", "2", "-p", "k", "3"]) == 2
    assert capsys.readouterr().err == "error: parameter 'k' given twice\n"
    assert not (tmp_path / "run").exists()


def test_params_lists_every_key_and_help_names_the_notebooks_and_backends(capsys):
    from dflash_lib.config import FLAT_FIELDS, TrainConfig
    from dflash_lib.lab.runs import notebook_names

    assert main(["params"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert sorted(keys) == sorted(FLAT_FIELDS)
    assert main(["params", "train"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[train]" and len(out) == 1 + len(TrainConfig.__dataclass_fields__)
    assert main(["params", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown section 'nope'; sections: data, buckets")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    names = notebook_names()
    assert names == sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb")) and "04_train" in names
    shown = " ".join(capsys.readouterr().out.split())  # (argparse wraps the help text)
    assert all(name in shown for name in names)
    with pytest.raises(SystemExit):
        main(["regenerate", "--help"])
    out = capsys.readouterr().out
    assert "--backend {local,openai}" in out and "{," not in out
