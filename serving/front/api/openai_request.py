"""What both OpenAI routes do with a request before running it: the checks they share,
the output constraint on each prompt's sampling parameters, the PD bootstrap fields, and how
a stream reports usage."""

from __future__ import annotations

from typing import Any

from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError
from serving.front.api.openai_protocol import SamplingRequest
from serving.front.api.sampling import check_n
from serving.front.api.structured_output import Constraint
from serving.sampling_params import SamplingParams


def check_common(ctx: FrontContext, body: SamplingRequest) -> None:
    ctx.check_model(body.model)
    check_n(body.n)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")


def constrain(
    ctx: FrontContext, samplings: list[SamplingParams], constraint: Constraint | None
) -> None:
    """Put the output constraint on each prompt's sampling parameters; 400 if it does not
    compile."""
    if constraint is None:
        return
    for sampling in samplings:
        setattr(sampling, constraint.field, constraint.text)
    ctx.check_constraint(samplings[0])


def bootstrap_fields(body: SamplingRequest) -> dict[str, Any]:
    return {
        "bootstrap_host": body.bootstrap_host,
        "bootstrap_port": body.bootstrap_port,
        "bootstrap_room": body.bootstrap_room,
    }


def usage_mode(body: SamplingRequest) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage so far on every chunk: vLLM's continuous_usage_stats,
    which like vLLM's needs include_usage)."""
    options = body.stream_options
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats
