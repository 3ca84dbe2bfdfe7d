"""The checks of ServerArgs' flags: ArgsChecks, which ServerArgs extends, raises ArgsError
naming the first flag that cannot take effect on this machine, in this build, or (with the
checkpoint's config.json) for this model. It reads ServerArgs' fields and derived values."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING

from serving.cli_flags import dash

if TYPE_CHECKING:
    from serving.config import ModelConfig


class ArgsError(ValueError):
    """A flag that cannot take effect; the message starts with the flag."""


class ArgsChecks:
    """ServerArgs' validate() and validate_for_model(); every attribute they read is one of
    ServerArgs'."""

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
                raise ArgsError(f"--{dash(flag)} {getattr(self, flag)}: only 1 is supported")
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
        for flag in ("cuda_graph_backend_decode", "cuda_graph_backend_vision"):
            if getattr(self, flag) == "full" and device != "cuda":
                raise ArgsError(f"--{dash(flag)} full: needs a CUDA device (this is {device})")
        if self.cuda_graph_backend_prefill != "disabled":
            raise ArgsError("--cuda-graph-backend-prefill full: prefill graphs are not built")
        if self.cuda_graph_max_bs_decode < 1:
            raise ArgsError("--cuda-graph-max-bs-decode: must be >= 1")
        if self.cuda_graph_vision_max_shapes < 2:
            raise ArgsError("--cuda-graph-vision-max-shapes: must be >= 2 (eviction keeps one)")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ArgsError(f"--mem-fraction-static {self.mem_fraction_static}: must be in (0, 1)")
        if self.running_limit < 1:
            raise ArgsError("--max-running-requests: must be >= 1")
        if self.disaggregation_decode_enable_radix_cache and self.disaggregation_mode != "decode":
            raise ArgsError(
                "--disaggregation-decode-enable-radix-cache: only for --disaggregation-mode "
                "decode (prefill and a single worker keep their own cache)"
            )
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
        if self.max_images_per_request < 0 or self.media_fetch_timeout <= 0:
            raise ArgsError("--max-images-per-request/--media-fetch-timeout: must be >= 0 / > 0")
        if self.max_image_tokens is not None and self.max_image_tokens < 1:
            raise ArgsError("--max-image-tokens: must be >= 1")
        local = self.allowed_local_media_path
        if local is not None and not Path(local).is_dir():
            raise ArgsError(f"--allowed-local-media-path {local}: not a directory")
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
                    f"--{dash(flag)} {n}: --tp-size and --ep-size must each be 1 or the number "
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


def _require_backend(flag: str, backend: str, device: str) -> None:
    """Kernel families we have: the torch references (auto picks them)."""
    if backend in ("torch", "auto"):
        return
    package = backend.split("_")[0]
    why = "" if importlib.util.find_spec(package) else f"; the {package} package is not installed"
    raise ArgsError(
        f"--{dash(flag)} {backend}: not available in this build (available: torch){why}"
    )
