"""The training stage: `loop.train(config, run_dir)` and what it is made of: the parts a run is built from
(`build`), the host-side feed and the threaded pipeline, one optimizer step (`step`), the schedules, torchrun glue
(`distributed`), checkpoints with every RNG (`checkpoint`), where a run stands (`state`), resume, metrics, the
held-out evaluation during training (`heldout`) and the fake-mode dry run (`dryrun`)."""
