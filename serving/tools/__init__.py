"""Operator commands: checkpoint writers (tiny model, FP8), generation, the memory plan, the
serving benchmark and trace summaries. Nothing on the serving path imports them."""
