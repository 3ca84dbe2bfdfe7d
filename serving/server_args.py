"""Server arguments: SGLang's flag names, one frozen dataclass, argparse built from it.

Every flag of the seed's prefill and decode commands parses. A flag that cannot take effect on
this machine or in this build fails at start-up with one line naming it (`ArgsError`), never a
traceback. The checks are server_args_checks.py's (ArgsChecks, which ServerArgs extends), the
parser builder cli_flags.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serving.cli_flags import dataclass_parser
from serving.server_args_checks import ArgsChecks, ArgsError

if TYPE_CHECKING:
    from serving.config import ModelConfig

# ArgsError is what ServerArgs.validate() and validate_for_model() raise: callers take it from here.
__all__ = ["API_KEY_ENV", "ArgsError", "ServerArgs"]

API_KEY_ENV = "SGLANG_API_KEY"


@dataclass(frozen=True)
class ServerArgs(ArgsChecks):
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
    cuda_graph_backend_vision: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "disabled", "full"],
            "help": "the vision tower, one image at a time through a CUDA graph per image size "
            "(its launches dominate an eager run); auto: full on CUDA. The trade: an image size "
            "not seen yet pays one capture (about one eager run plus instantiation) and stalls "
            "its step for it",
        },
    )
    cuda_graph_vision_max_shapes: int = field(
        default=16,
        metadata={
            "help": "image sizes (grids) whose vision graphs are kept, least recently used "
            "evicted (at least 2: eviction keeps one, so their shared memory pool stays "
            "capturable); the pool holds the largest's activations either way"
        },
    )
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
    disaggregation_decode_enable_radix_cache: bool = field(
        default=False,
        metadata={
            "help": "decode only: keep a prefix cache of KV pages (no KDA snapshots): the "
            "prompt's whole pages it holds are not sent again by prefill, only the pages past "
            "them and the request's state rows (off by default while it is measured)"
        },
    )
    # API
    reasoning_parser: str | None = field(default=None, metadata={"choices": [None, "glm45"]})
    tool_call_parser: str | None = field(default=None, metadata={"choices": [None, "glm47"]})
    # images (a checkpoint with a vision_config; docs/PROTOCOL.md)
    max_images_per_request: int = field(
        default=16, metadata={"help": "images in one request's prompt, beyond which a 400"}
    )
    max_image_tokens: int | None = field(
        default=None,
        metadata={
            "help": "image tokens one image may take, beyond which a 400 (default: the "
            "checkpoint's preprocessor_config.json max_image_tokens)"
        },
    )
    allowed_media_domains: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated hosts whose http(s) image URLs are fetched (default: "
            "none; only data: URLs)"
        },
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata={"help": "file:// image URLs are read only under this directory (default: none)"},
    )
    media_fetch_timeout: float = field(
        default=5.0, metadata={"help": "seconds an image URL fetch may take, beyond which a 400"}
    )
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
        state arrives from prefill (it may keep KV pages only: decode_page_cache)."""
        return not self.disable_radix_cache and self.disaggregation_mode != "decode"

    @property
    def decode_page_cache(self) -> bool:
        """PD decode's prefix cache: KV pages only (the state after a prompt is prefill's)."""
        return (
            self.disaggregation_mode == "decode" and self.disaggregation_decode_enable_radix_cache
        )

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

    @property
    def speculative_steps(self) -> int:
        """Draft steps per decode step (0: no speculation)."""
        return (self.speculative_num_steps or 0) if self.speculative_algorithm else 0

    def use_decode_graphs(self) -> bool:
        return self._graphs_on(self.cuda_graph_backend_decode)

    def use_vision_graphs(self) -> bool:
        return self._graphs_on(self.cuda_graph_backend_vision)

    def image_token_limit(self) -> int:
        """The most tokens of one image the front admits: --max-image-tokens, capped by the
        checkpoint's preprocessor_config.json max_image_tokens (8,000, the processor's
        default, where absent). The memory plan and the tower's CUDA graphs are sized by this
        same number, so no admitted image is larger than what they hold."""
        path = os.path.join(self.model_path, "preprocessor_config.json")
        raw = {}
        if os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
        processor_max = int(raw.get("max_image_tokens", 8000))
        return min(self.max_image_tokens or processor_max, processor_max)

    def _graphs_on(self, mode: str) -> bool:
        return mode == "full" or (mode == "auto" and self.resolved_device() == "cuda")

    # ---- argparse ----
    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        return dataclass_parser(
            cls,
            prog="python -m serving.launch_server",
            description="Serve a GLM-5.3-Flash-style checkpoint (OpenAI-compatible HTTP API).",
        )

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
