"""A drafter's acceptance measured by real speculative decoding on HELD-OUT prompts.

    python -m dflash_lib evaluate --drafter DIR [--target DIR|tiny] [-p prompts N] [-p max_new_tokens M] [-p KEY V]

DIR: a saved drafter or a trainer run folder. `evaluate(...)` decodes with the drafter (`evaluate.acceptance`,
`models.sampling`) and the target alone: `DecodeReport`, the last stdout line; `evaluate_run(...)` every checkpoint
of a run. Modules: `setup` (the drafter, its run, the config, the target and the prompts, checked), `acceptance`
(the speculative decoding loop and tau), `decoding` (in process), `engine` (the same prompts served by the engine),
`served` (the engine's figures judged), `run` (a whole run, read through `rundir.reader`), `reports` (the records),
`engine_check` (`python -m dflash_lib engine-check`). docs/serving.md, "Measuring a drafter: speculative
decoding on held-out prompts"; the prompts (`-p prompts_from`, `data.prompts`): docs/evaluation.md.
"""

from dflash_lib.evaluate.decoding import (Baseline, _baseline, _warm, _warn_differ, decode, decode_groups,
                                          decode_report, evaluate)
from dflash_lib.evaluate.engine import overall_served_tau, serve_drafter, served, served_sets
from dflash_lib.evaluate.reports import (RUN_SUMMARY_KEYS, DecodeReport, DrafterMeasurement, RunEvaluation, run_summary,
                                         summary)
from dflash_lib.evaluate.run import (LOSS_WINDOW, SERVING_DIR, best_drafter, checkpoint_drafter, evaluate_run,
                                     loss_figures, run_checkpoints, run_doctor, sampled_setup, trainer_folder)
from dflash_lib.evaluate.setup import (Say, Setup, build_config, check_engine, check_fit, check_positions,
                                       decode_threads, find_drafter, initial_drafter, load_drafter, prepare,
                                       target_positions)

__all__ = [
    "Baseline", "DecodeReport", "DrafterMeasurement", "LOSS_WINDOW", "RUN_SUMMARY_KEYS", "RunEvaluation",
    "SERVING_DIR",
    "Say", "Setup", "_baseline", "_warm", "_warn_differ", "best_drafter", "build_config", "check_engine", "check_fit",
    "check_positions", "checkpoint_drafter", "decode", "decode_groups", "decode_report", "decode_threads", "evaluate",
    "evaluate_run", "find_drafter", "initial_drafter", "load_drafter", "loss_figures", "overall_served_tau", "prepare",
    "run_checkpoints", "run_doctor", "run_summary", "sampled_setup", "serve_drafter", "served", "served_sets",
    "summary", "target_positions", "trainer_folder",
]
