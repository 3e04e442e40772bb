"""The dry run and the settings search, a stage above training: one step of the real configuration measured in
fake mode before a GPU is rented (`step`, `worst`, `report`), the fake process groups and the balanced-routing
stand-in it runs with, and tuning: the search for the fastest settings that fit (`search`). docs/scale.md."""

from dflash_lib.dryrun.report import (BackendComparison, BatchRecord, BatchResult, DryRunAssumptions, DryRunEta,
                                      DryRunReport, dry_run, format_report, measure_batches, measure_plan, run_cli)
from dflash_lib.dryrun.step import (FLEX_TILE, GIB, H200_BF16_TFLOPS, NVLINK4_GBS, PAPER_SAMPLES, Ranks, Reserve,
                                    StepFigures, StepModels, StepSettings, build_step_models, flex_tiles, for_cuda,
                                    measure_step)
from dflash_lib.dryrun.worst import WorstBatch, host_batch, worst_batches, worst_bucket_batch, worst_packed_batch
from dflash_lib.models.target_config import target_hf_config  # the tests read configs through it

__all__ = ["BackendComparison", "BatchRecord", "BatchResult", "DryRunAssumptions", "DryRunEta", "DryRunReport", "dry_run",
           "format_report", "measure_batches", "measure_plan", "run_cli", "FLEX_TILE", "GIB", "H200_BF16_TFLOPS",
           "NVLINK4_GBS", "PAPER_SAMPLES", "Ranks", "Reserve", "StepFigures", "StepModels", "StepSettings",
           "build_step_models", "flex_tiles", "for_cuda", "measure_step", "WorstBatch", "host_batch", "worst_batches",
           "worst_bucket_batch", "worst_packed_batch", "target_hf_config"]
