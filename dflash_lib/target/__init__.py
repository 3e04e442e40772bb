"""The frozen target's features, one home for every source of them: the one interface (`protocol.FeatureSource`),
the target's facts read once (`facts`), the local model (`local`) and the sources beside it (the sharded one,
`sharded`; the served one, `served`; its captured cache, `cached`, written by `capture`; the in-memory cache,
`feature_cache`) and the opener that picks one from the settings (`open`). docs/architecture.md lists them."""
