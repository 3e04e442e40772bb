"""Batch samplers (lists of sample indices, usable as a DataLoader's `batch_sampler=`), randomness metrics and
the efficiency-vs-randomness frontier. One file per sampler; `budget` says when a batch is full, the samplers
say in what order."""

from dflash_lib.plan.sampler.base import (EpochBatchSampler, EpochPlan, FixedBatchSampler, PaddedBudgetSampler,
                                          shard_by_bucket, shard_in_order)
from dflash_lib.plan.sampler.bucketed import BucketedShuffleSampler
from dflash_lib.plan.sampler.budget import (BatchBudget, BlockBudget, Bound, SamplerError, TokenBudget,
                                            derived_block_budget, fill_in_order, fixed_batch_sizes, greedy_fill,
                                            resolve_block_budget, split_by_budget, worst_batch_refusal)
from dflash_lib.plan.sampler.frontier import (BASELINES, OURS, StrategyPoint, dominates, dominating_baselines,
                                              evaluate_strategies, format_points, measure, pareto_front)
from dflash_lib.plan.sampler.length_grouped import LengthGroupedSampler
from dflash_lib.plan.sampler.metrics import (BudgetUse, RandomnessStats, as_csr, bucket_mix, bucket_mix_kl,
                                             budget_use, cobatch_recurrence, lag1_correlation, packing_efficiency,
                                             padding_efficiency, randomness)
from dflash_lib.plan.sampler.packed import PackedSampler, cu_seqlens, pack_rows
from dflash_lib.plan.sampler.random_shuffle import RandomShuffleSampler
from dflash_lib.plan.sampler.sorted_static import SortedStaticSampler

__all__ = [
    "BASELINES", "OURS", "BatchBudget", "BlockBudget", "Bound", "BucketedShuffleSampler", "BudgetUse",
    "EpochBatchSampler", "EpochPlan", "FixedBatchSampler", "LengthGroupedSampler", "PackedSampler",
    "PaddedBudgetSampler", "RandomShuffleSampler", "RandomnessStats", "SamplerError", "SortedStaticSampler",
    "StrategyPoint", "TokenBudget", "as_csr", "bucket_mix", "bucket_mix_kl", "budget_use", "cobatch_recurrence",
    "cu_seqlens", "derived_block_budget", "dominates", "dominating_baselines", "evaluate_strategies",
    "fill_in_order", "fixed_batch_sizes", "format_points", "greedy_fill", "lag1_correlation", "measure",
    "pack_rows", "packing_efficiency", "padding_efficiency", "pareto_front", "randomness", "resolve_block_budget",
    "shard_by_bucket", "shard_in_order", "split_by_budget", "worst_batch_refusal",
]
