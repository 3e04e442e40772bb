"""Planning a run's batches from its lengths, before any model exists: exact bucket edges (`buckets`), whether
each bucket's worst batch fits (`fit`), the step-time cost model (`costmodel`) and the batch samplers (`sampler`).
numpy (and torch's Sampler base); nothing here imports a model."""
