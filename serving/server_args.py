"""Server arguments: SGLang's flag names, one frozen dataclass, argparse built from it.

Every flag of the seed's prefill and decode commands parses. A flag that cannot take effect on
this machine or in this build fails at start-up with one line naming it (`ArgsError`), never a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.config import ModelConfig


API_KEY_ENV = "SGLANG_API_KEY"


class ArgsError(ValueError):
    """A flag that cannot take effect; the message starts with the flag."""


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = field(metadata={"help": "checkpoint directory (config.json + safetensors)"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model id in the API (default: the model path)"}
    )
    tokenizer_path: str | None = field(default=None, metadata={"help": "default: model path"})
    chat_template: str | None = field(
        default=None, metadata={"help": "jinja file (default: the checkpoint's)"}
    )
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(
        default=None,
        metadata={"help": "clients must send Authorization: Bearer KEY (default: $SGLANG_API_KEY)"},
    )
    max_payload_size: int = field(
        default=32 << 20, metadata={"help": "largest request body in bytes (413 above)"}
    )
    body_read_timeout_secs: float = field(
        default=10.0, metadata={"help": "a request body that stalls this long gets 408"}
    )
    max_queued_requests: int | None = field(
        default=None,
        metadata={
            "help": "requests waiting to start, beyond which new ones get 503 + Retry-After "
            "(default: 4 x the request rows)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "bfloat16", "float32"],
            "help": "auto: the checkpoint's dtype on CUDA, float32 on the CPU",
        },
    )
    device: str = field(default="auto", metadata={"choices": ["auto", "cuda", "cpu"]})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={"choices": ["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]},
    )
    context_length: int | None = field(
        default=None, metadata={"help": "max prompt + output tokens (default: the model's)"}
    )
    # memory
    mem_fraction_static: float = field(
        default=0.8, metadata={"help": "GPU: fraction of device memory for weights + caches"}
    )
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "token budget of the KV pools (CPU default 131072)"}
    )
    page_size: int = 64
    max_running_requests: int | None = field(default=None, metadata={"help": "default 32"})
    chunked_prefill_size: int = field(
        default=8192, metadata={"help": "tokens per prefill chunk; a multiple of index_kpool"}
    )
    max_prefill_tokens: int = field(default=16384, metadata={"help": "tokens per prefill batch"})
    # the prefix cache (a radix tree with KDA state snapshots; not on a PD decode worker)
    disable_radix_cache: bool = field(default=False, metadata={"help": "no prefix cache"})
    mamba_full_memory_ratio: float = field(
        default=0.1,
        metadata={
            "help": "prefix cache: memory of its KDA state snapshots / memory of the KV pool "
            "(pdserve's meaning: snapshots only; running requests' states are per row)"
        },
    )
    max_mamba_cache_size: int | None = field(
        default=None,
        metadata={"help": "prefix cache: this many state snapshots (overrides the ratio)"},
    )
    mamba_track_interval: int = field(
        default=256,
        metadata={
            "help": "prefix cache: while decoding, cache KV + state every this many tokens "
            "(a multiple of the snapshot grid, lcm(page size, index_kpool, 64))"
        },
    )
    # parallelism: max(tp, ep) rank processes, one per GPU (CPU: gloo processes)
    tp_size: int = field(default=1, metadata={"help": "attention/dense/vocab tensor parallelism"})
    ep_size: int = field(
        default=1, metadata={"help": "routed-expert parallelism: 1 or the number of ranks"}
    )
    pp_size: int = 1
    dp_size: int = 1
    dcp_size: int = 1
    nccl_port: int | None = field(
        default=None, metadata={"help": "rendezvous port of the ranks (default: a free one)"}
    )
    dist_init_addr: str | None = field(
        default=None, metadata={"help": "HOST:PORT rendezvous for a worker spanning --nnodes"}
    )
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = field(default=0, metadata={"help": "the first GPU this worker uses"})
    simulate_rank: int | None = field(
        default=None,
        metadata={
            "help": "measurement only: run rank R of the --tp-size/--ep-size world alone in this "
            "process, on random weights (no checkpoint read: --model-path needs config.json and "
            "the tokenizer), collectives through torch's fake backend; every answer is "
            "meaningless (docs/DEPLOY.md, 'Simulated rank')"
        },
    )
    # kernels
    dsa_prefill_backend: str = field(
        default="torch", metadata={"choices": ["torch", "tilelang", "flashmla_sparse"]}
    )
    dsa_decode_backend: str = field(
        default="torch", metadata={"choices": ["torch", "tilelang", "flashmla_sparse"]}
    )
    moe_runner_backend: str = field(
        default="auto", metadata={"choices": ["auto", "torch", "triton"]}
    )
    speculative_moe_runner_backend: str = field(
        default="auto", metadata={"choices": ["auto", "torch", "triton"]}
    )
    fp8_keep_bf16: str | None = field(
        default=None,
        metadata={
            "help": "block-FP8 checkpoints on CUDA: layer kinds to dequantize to bf16 at load "
            "instead of running FP8 kernels, comma-separated from kda, mla, indexer, dense_mlp, "
            "shared_expert, moe, or all"
        },
    )
    fp8_linears: str = field(
        default="timed",
        metadata={
            "choices": ["timed", "all"],
            "help": "block-FP8 checkpoints on CUDA: timed: at load each projection shape's FP8 "
            "GEMM is timed against bf16 at 32 and 8192 tokens and the shapes where FP8 is not "
            "faster at both are dequantized to bf16 (logged per shape; /get_server_info's "
            "scheduler.fp8); all: every projection runs FP8. Kinds in --fp8-keep-bf16 stay "
            "bf16 either way",
        },
    )
    disable_shared_experts_fusion: bool = field(
        default=False, metadata={"help": "accepted; shared experts are never fused here"}
    )
    cuda_graph_backend_prefill: str = field(
        default="disabled", metadata={"choices": ["disabled", "full"]}
    )
    cuda_graph_backend_decode: str = field(
        default="auto",
        metadata={"choices": ["auto", "disabled", "full"], "help": "auto: full on CUDA"},
    )
    cuda_graph_max_bs_decode: int = 32
    disable_overlap_schedule: bool = field(
        default=False,
        metadata={
            "help": "commit each step before the next is scheduled, so the device waits for "
            "the CPU's work (off: that work overlaps the next step; serving/engine/scheduler.py)"
        },
    )
    # speculative decoding
    speculative_algorithm: str | None = field(default=None, metadata={"choices": [None, "EAGLE"]})
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # PD disaggregation
    disaggregation_mode: str = field(
        default="null", metadata={"choices": ["null", "prefill", "decode"]}
    )
    disaggregation_transfer_backend: str = field(
        default="mooncake", metadata={"choices": ["mooncake"]}
    )
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str | None = None
    disaggregation_decode_extra_slots: int | None = field(
        default=None, metadata={"help": "default: 2 x max_running_requests when that is <= 32"}
    )
    # API
    reasoning_parser: str | None = field(default=None, metadata={"choices": [None, "glm45"]})
    tool_call_parser: str | None = field(default=None, metadata={"choices": [None, "glm47"]})
    # process
    skip_server_warmup: bool = False
    watchdog_timeout: float = field(
        default=300.0, metadata={"help": "kill the scheduler when one step takes longer (s)"}
    )
    random_seed: int = 0
    log_level: str = field(default="info", metadata={"choices": ["debug", "info", "warning"]})
    log_requests: bool = field(
        default=False,
        metadata={"help": "log each finished request's stage times at info (else at debug)"},
    )
    decode_log_interval: int = field(
        default=40, metadata={"help": "log a 'Decode batch' line every this many decode steps"}
    )
    profile_dir: str | None = field(
        default=None,
        metadata={
            "help": "where /start_profile writes traces when its body names no output_dir "
            "(default: $SGLANG_TORCH_PROFILER_DIR, else /tmp)"
        },
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "accepted; no remote code"})
    enable_metrics: bool = field(
        default=False,
        metadata={
            "help": "serve Prometheus metrics on /metrics, under SGLang's names (off: no "
            "/metrics route, as in SGLang)"
        },
    )

    # ---- derived ----
    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def queue_limit(self) -> int:
        """Requests that may wait to start (decode: for a request row) before 503s."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return 4 * (self.running_limit + self.decode_extra_slots)

    @property
    def running_limit(self) -> int:
        return self.max_running_requests or 32

    @property
    def decode_extra_slots(self) -> int:
        """SGLang's default: 2 x max_running_requests when that is set and <= 32, else 0."""
        if self.disaggregation_mode != "decode":
            return 0
        if self.disaggregation_decode_extra_slots is not None:
            return self.disaggregation_decode_extra_slots
        mrr = self.max_running_requests
        return 2 * mrr if mrr is not None and mrr <= 32 else 0

    @property
    def radix_cache(self) -> bool:
        """The prefix cache is on by default (as in SGLang), except on a PD decode worker: its
        KV and state arrive whole from prefill."""
        return not self.disable_radix_cache and self.disaggregation_mode != "decode"

    @property
    def world_size(self) -> int:
        """Rank processes of this worker (all nodes)."""
        return max(self.tp_size, self.ep_size)

    @property
    def rank_processes(self) -> int:
        """Rank processes this worker starts: the world, or 1 with --simulate-rank."""
        return 1 if self.simulate_rank is not None else self.world_size

    @property
    def ranks_per_node(self) -> int:
        return self.rank_processes // self.nnodes

    def dist_init_method(self) -> str:
        if self.dist_init_addr:
            return f"tcp://{self.dist_init_addr}"
        assert self.nccl_port is not None, "the launcher picks --nccl-port"
        return f"tcp://127.0.0.1:{self.nccl_port}"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def context_window(self, config: ModelConfig) -> int:
        return self.context_length or config.max_position_embeddings

    def validate_for_model(self, config: ModelConfig) -> None:
        """Checks that need the checkpoint's config.json (no weights)."""
        kp = config.index_kpool
        if self.chunked_prefill_size % kp:
            raise ArgsError(
                f"--chunked-prefill-size {self.chunked_prefill_size}: must be a multiple of "
                f"index_kpool ({kp})"
            )
        if self.page_size % kp:
            raise ArgsError(
                f"--page-size {self.page_size}: must be a multiple of index_kpool ({kp})"
            )
        if self.speculative_algorithm and config.num_nextn_predict_layers < 1:
            raise ArgsError(
                f"--speculative-algorithm {self.speculative_algorithm}: the checkpoint has no "
                "NextN layer (num_nextn_predict_layers is 0)"
            )
        grid = math.lcm(self.page_size, kp, 64)  # serving/engine/admission.snapshot_grid
        if self.radix_cache and self.mamba_track_interval % grid:
            raise ArgsError(
                f"--mamba-track-interval {self.mamba_track_interval}: must be a multiple of the "
                f"snapshot grid lcm(page size, index_kpool, 64) = {grid}"
            )
        from serving.distributed import check_sizes

        try:
            check_sizes(config, self.tp_size, self.ep_size)
        except ValueError as exc:
            raise ArgsError(str(exc)) from None
        if self.context_length and self.context_length > config.max_position_embeddings:
            raise ArgsError(
                f"--context-length {self.context_length}: the model supports at most "
                f"{config.max_position_embeddings}"
            )

    # ---- checks that need no model ----
    def validate(self) -> None:
        """Raise ArgsError for the first flag that cannot take effect here."""
        import torch

        device = self.resolved_device()
        num_devices = torch.cuda.device_count() if device == "cuda" else 1
        if device == "cuda" and num_devices == 0:
            raise ArgsError("--device cuda: no CUDA device is visible")
        if not Path(self.model_path).is_dir():
            raise ArgsError(f"--model-path {self.model_path}: not a directory")
        self._validate_parallel(device, num_devices)
        for flag in ("pp_size", "dp_size", "dcp_size"):
            if getattr(self, flag) != 1:
                raise ArgsError(f"--{_dash(flag)} {getattr(self, flag)}: only 1 is supported")
        if self.kv_cache_dtype.startswith("fp8"):
            raise ArgsError(f"--kv-cache-dtype {self.kv_cache_dtype}: fp8 KV caches are not built")
        from serving.config import ConfigError, parse_fp8_kinds

        try:
            parse_fp8_kinds(self.fp8_keep_bf16)
        except ConfigError as exc:
            raise ArgsError(str(exc)) from None
        for flag in ("dsa_prefill_backend", "dsa_decode_backend"):
            _require_backend(flag, getattr(self, flag), device)
        for flag in ("moe_runner_backend", "speculative_moe_runner_backend"):
            _require_backend(flag, getattr(self, flag), device)
        if self.cuda_graph_backend_decode == "full" and device != "cuda":
            raise ArgsError(
                f"--cuda-graph-backend-decode full: needs a CUDA device (this is {device})"
            )
        if self.cuda_graph_backend_prefill != "disabled":
            raise ArgsError("--cuda-graph-backend-prefill full: prefill graphs are not built")
        if self.cuda_graph_max_bs_decode < 1:
            raise ArgsError("--cuda-graph-max-bs-decode: must be >= 1")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ArgsError(f"--mem-fraction-static {self.mem_fraction_static}: must be in (0, 1)")
        if self.running_limit < 1:
            raise ArgsError("--max-running-requests: must be >= 1")
        if self.decode_log_interval < 1:
            raise ArgsError("--decode-log-interval: must be >= 1")
        if self.page_size < 1 or self.chunked_prefill_size < 1 or self.max_prefill_tokens < 1:
            raise ArgsError("--page-size/--chunked-prefill-size/--max-prefill-tokens: must be >= 1")
        if self.max_payload_size < 1 or self.body_read_timeout_secs <= 0:
            raise ArgsError("--max-payload-size/--body-read-timeout-secs: must be > 0")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ArgsError("--max-queued-requests: must be >= 0")
        if self.mamba_full_memory_ratio <= 0 or self.mamba_track_interval < 1:
            raise ArgsError("--mamba-full-memory-ratio/--mamba-track-interval: must be > 0")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 1:
            raise ArgsError("--max-mamba-cache-size: must be >= 1")
        if self.speculative_algorithm is not None:
            self._validate_speculative()
        if self.disaggregation_mode != "null":
            if importlib.util.find_spec("mooncake") is None:
                raise ArgsError(
                    f"--disaggregation-mode {self.disaggregation_mode}: the Mooncake transfer "
                    "engine is not installed (pip install -e '.[cpu]' or '.[cuda13]')"
                )
            if self.disaggregation_decode_extra_slots is not None and (
                self.disaggregation_decode_extra_slots < 0
            ):
                raise ArgsError("--disaggregation-decode-extra-slots: must be >= 0")

    def _validate_parallel(self, device: str, num_devices: int) -> None:
        world = self.world_size
        for flag in ("tp_size", "ep_size"):
            n = getattr(self, flag)
            if n < 1 or n not in (1, world):
                raise ArgsError(
                    f"--{_dash(flag)} {n}: --tp-size and --ep-size must each be 1 or the number "
                    f"of ranks ({world})"
                )
        if self.nnodes < 1 or world % self.nnodes or not 0 <= self.node_rank < self.nnodes:
            raise ArgsError(
                f"--nnodes {self.nnodes} --node-rank {self.node_rank}: the {world} ranks must "
                "split evenly over the nodes, and node-rank be below nnodes"
            )
        if self.simulate_rank is not None:
            self._validate_simulated(world)
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ArgsError("--nnodes > 1: needs --dist-init-addr HOST:PORT (node 0's)")
        if device == "cuda" and self.base_gpu_id + self.ranks_per_node > num_devices:
            raise ArgsError(
                f"--tp-size {self.tp_size} --ep-size {self.ep_size}: needs "
                f"{self.ranks_per_node} devices from --base-gpu-id {self.base_gpu_id}, this "
                f"machine has {num_devices} (cuda)"
            )

    def _validate_simulated(self, world: int) -> None:
        r = self.simulate_rank
        if world < 2:
            raise ArgsError(
                f"--simulate-rank {r}: needs the world it is a rank of (--tp-size and/or "
                "--ep-size N >= 2); with one rank there is nothing to simulate"
            )
        if not 0 <= r < world:
            raise ArgsError(f"--simulate-rank {r}: must be in [0, {world}) (the world's ranks)")
        if self.nnodes != 1 or self.node_rank != 0 or self.dist_init_addr:
            raise ArgsError(
                f"--simulate-rank {r}: runs one process on one node; drop --nnodes, "
                "--node-rank and --dist-init-addr"
            )

    def _validate_speculative(self) -> None:
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        drafts = self.speculative_num_draft_tokens
        if steps is None or not 1 <= steps <= 8:
            raise ArgsError(f"--speculative-num-steps {steps}: EAGLE needs 1..8 draft steps")
        if topk not in (None, 1):
            raise ArgsError(
                f"--speculative-eagle-topk {topk}: only chain drafts (topk 1) are supported"
            )
        if drafts is not None and drafts != steps + 1:
            raise ArgsError(
                f"--speculative-num-draft-tokens {drafts}: with topk 1 it must be "
                f"--speculative-num-steps + 1 = {steps + 1}"
            )

    @property
    def speculative_steps(self) -> int:
        """Draft steps per decode step (0: no speculation)."""
        return (self.speculative_num_steps or 0) if self.speculative_algorithm else 0

    def use_decode_graphs(self) -> bool:
        mode = self.cuda_graph_backend_decode
        return mode == "full" or (mode == "auto" and self.resolved_device() == "cuda")

    # ---- argparse ----
    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(
            prog="python -m serving.launch_server",
            description="Serve a GLM-5.3-Flash-style checkpoint (OpenAI-compatible HTTP API).",
        )
        for f in dataclasses.fields(cls):
            flag = "--" + _dash(f.name)
            meta = dict(f.metadata)
            kwargs: dict[str, Any] = {"help": meta.get("help")}
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            default = None if f.default is dataclasses.MISSING else f.default
            if f.type in ("bool", bool):
                ap.add_argument(flag, action="store_true", help=kwargs["help"])
                continue
            kwargs["type"] = _parse_type(f.type)
            if default is dataclasses.MISSING or f.default is dataclasses.MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
            ap.add_argument(flag, **kwargs)
        return ap

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        ns = vars(cls.parser().parse_args(argv))
        # The key is better kept out of argv (other users of the host can read it with ps).
        ns["api_key"] = ns["api_key"] or os.environ.get(API_KEY_ENV) or None
        return cls(**ns)

    def public(self) -> dict[str, Any]:
        """The arguments as /server_info shows them: the API key never leaves the process."""
        out = dataclasses.asdict(self)
        out["api_key"] = "<set>" if self.api_key else None
        return out


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _parse_type(annotation: Any):
    text = str(annotation)
    if "int" in text and "str" not in text:
        return int
    if "float" in text:
        return float
    if "None" in text:  # optional strings: "none"/"null" on the command line mean unset
        return lambda s: None if s.lower() in ("none", "null") else s
    return str


def _require_backend(flag: str, backend: str, device: str) -> None:
    """Kernel families we have: the torch references (auto picks them)."""
    if backend in ("torch", "auto"):
        return
    package = backend.split("_")[0]
    why = "" if importlib.util.find_spec(package) else f"; the {package} package is not installed"
    raise ArgsError(
        f"--{_dash(flag)} {backend}: not available in this build (available: torch){why}"
    )
