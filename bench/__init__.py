"""Measurements: engine and kernel benchmarks, the PD stack's benchmark, GPU device-call scripts,
profiling and sync checks (docs/BENCHMARKS.md). Not in the wheel; nothing in serving/, workers/,
kernels/ or router/ imports it."""
