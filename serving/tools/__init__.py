"""Offline commands: checkpoint writers, distillation, generation and benchmarks. Nothing on the
serving path imports them."""
