"""Support for the tests and benchmarks, not the training suite: comparing a module across devices or dtypes
(:mod:`.parity`) and the deterministic proxies of a step's cost (:mod:`.profiling`: bytes saved for backward,
attention maps, dispatched ops)."""
