"""Health, model and server information, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from serving.front.api.context import FrontContext
from serving.front.api.errors import APIError, error_response
from serving.front.api.native_protocol import ProfileBody
from serving.front.api.sequences import collect, make_seqs
from serving.protocol import FAKE_BOOTSTRAP_HOST, FlushCache, StartProfile, StopProfile
from serving.sampling_params import SamplingParams

HEALTH_GENERATE_TIMEOUT_S = 20.0
# Writing a long trace of every rank takes a while (SGLang waits 600 s as well).
PROFILE_TIMEOUT_S = 600.0


def package_version() -> str:
    """pdserve's version for /server_info. A checkout run without `pip install` (the GPU scripts:
    the image's venv, wheels in a site dir, the repository on sys.path) has no package metadata:
    then the version in the checkout's pyproject.toml, marked as such. Run 5's decode role
    raised PackageNotFoundError here on every /get_server_info (a 500 for the whole body)."""
    try:
        return version("pdserve")
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    text = pyproject.read_text() if pyproject.is_file() else ""
    found = re.search(r'^version = "([^"]+)"', text, re.M)  # [project]'s, the first
    return f"{found.group(1)} (source checkout, not installed)" if found else "unknown"


def simulation(args) -> dict | None:
    """/server_info's warning for a --simulate-rank worker (None for a real one)."""
    if args.simulate_rank is None:
        return None
    return {
        "simulated_rank": args.simulate_rank,
        "world_size": args.world_size,
        "tp_size": args.tp_size,
        "ep_size": args.ep_size,
        "warning": (
            f"this worker runs only rank {args.simulate_rank} of a TP/EP world of "
            f"{args.world_size} on random weights, collectives through a fake backend: every "
            "answer is meaningless; for per-rank memory and speed measurements only"
        ),
    }


def admin_router(ctx: FrontContext) -> APIRouter:
    router = APIRouter()
    client = ctx.client
    server_version = package_version()

    @router.get("/health")
    async def health() -> Response:
        if not client.is_ready:
            return error_response(503, client.state)
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """A real one-token generation through the scheduler."""
        if not client.is_ready:
            return error_response(503, client.state)
        ids = ctx.encode("ping", add_special_tokens=False) or [0]
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
        # PD workers run the probe locally: SGLang's fake bootstrap host means "no peer".
        pd = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0}
        local = pd if ctx.args.disaggregation_mode != "null" else {}
        seqs = make_seqs(ctx.tokenizer, f"health-{uuid.uuid4().hex}", [ids], [sampling], 1, **local)
        try:
            await asyncio.wait_for(collect(request, client, seqs), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(
                503, f"a one-token generation did not finish in {HEALTH_GENERATE_TIMEOUT_S:.0f} s"
            )
        except APIError as e:
            return error_response(503, f"a one-token generation failed: {e.message}")
        return Response(status_code=200)

    def model_card() -> dict:
        context = client.ready.context_length if client.ready else ctx.args.context_length
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "pdserve",
            "root": ctx.model_name,  # as SGLang: the served name, not a path on this host
            "max_model_len": context,
        }

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        ctx.check_model(model)
        return JSONResponse(model_card())

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> JSONResponse:
        stats = dataclasses.asdict(client.stats) if client.stats else {}
        ready = client.ready
        return JSONResponse(
            {
                **ctx.args.public(),
                # SGLang's name for the KV capacity in tokens (usable pages x page size)
                "max_total_num_tokens": ready.total_pages * ready.page_size if ready else None,
                "scheduler": dataclasses.asdict(ready) if ready else None,
                "internal_states": [stats],
                "simulation": simulation(ctx.args),
                "version": server_version,
            }
        )

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": ctx.args.model_path,
                "tokenizer_path": ctx.args.tokenizer_path or ctx.args.model_path,
                "served_model_name": ctx.model_name,
                "is_generation": True,
                "disaggregation_mode": ctx.args.disaggregation_mode,
                "model_type": ctx.model_config.get("model_type"),
                "architectures": ctx.model_config.get("architectures", []),
            }
        )

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """SGLang's: empty the prefix cache; refused (400) while requests are live."""
        if not client.is_ready:
            return error_response(503, client.state)
        reply = await client.control(FlushCache())
        if reply.error is not None:
            return error_response(400, f"cache not flushed: {reply.error}")
        return Response("Cache flushed.\n", status_code=200, media_type="text/plain")

    @router.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(body: ProfileBody | None = None) -> Response:
        """SGLang's: start the torch profiler on every rank of this worker (CPU, and CUDA
        where there is one); traces are written when it stops. 400 when profiling is already
        on, the output directory cannot be written or a field asks for what is not built."""
        if not client.is_ready:
            return error_response(503, client.state)
        reply = await client.control(start_profile_request(body or ProfileBody()))
        if reply.error is not None:
            return error_response(400, reply.error)
        return Response("Start profiling.\n", status_code=200, media_type="text/plain")

    @router.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        """SGLang's: stop profiling and write every rank's trace; 400 when it is not on."""
        if not client.is_ready:
            return error_response(503, client.state)
        reply = await client.control(StopProfile(), timeout=PROFILE_TIMEOUT_S)
        if reply.error is not None:
            return error_response(400, reply.error)
        return Response(
            "Stop profiling. This will take some time.\n", status_code=200, media_type="text/plain"
        )

    if client.metrics is not None:  # --enable-metrics, as in SGLang: no route without it

        @router.get("/metrics")
        async def metrics() -> Response:
            return Response(client.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return router


def start_profile_request(body: ProfileBody) -> StartProfile:
    """The scheduler's command for SGLang's body; APIError (400) for what is not built here."""
    for name in ("start_step", "profile_by_stage", "merge_profiles"):
        if getattr(body, name):
            raise APIError(400, f"{name}: not supported here (profile from now on)", name)
    if body.num_steps is not None and body.num_steps < 1:
        raise APIError(400, f"num_steps: must be >= 1, got {body.num_steps}", "num_steps")
    return StartProfile(
        output_dir=body.output_dir,
        num_steps=body.num_steps,
        activities=body.activities if body.activities is not None else ["CPU", "GPU"],
        with_stack=body.with_stack if body.with_stack is not None else True,
        record_shapes=bool(body.record_shapes),
        profile_prefix=body.profile_prefix or "",
        profile_id=str(time.time()),  # SGLang's profile id: the start time
    )
