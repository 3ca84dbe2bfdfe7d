"""Tensor and expert parallelism on CPU (gloo, 2 rank processes, float32, tiny checkpoint).

Every parallel layout computes the same logits as one rank, within 1e-5 relative: ragged batches
(prefill then decode) and a prefill fed in chunks unaligned to kpool.
"""

from __future__ import annotations

import pytest
import torch

from tests.tp_ranks import load_peaks, run_ranks, scenario

TOL = 1e-5


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    torch.manual_seed(0)
    return scenario(str(tiny_ckpt))


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "ep2", "tp2ep2"])
def test_logits_equal_one_rank(tiny_ckpt, reference, tmp_path, tp, ep):
    out = tmp_path / "logits.pt"
    run_ranks(tiny_ckpt, tp, ep, out)
    ours = torch.load(out)
    assert len(ours) == len(reference)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a.shape == b.shape
        assert rel_err(a, b) <= TOL, f"step {i}: {rel_err(a, b):.2e}"


def test_padded_vocab_tp4_logits_equal_one_rank(v410_ckpt, tmp_path):
    """A vocabulary of 410 at --tp-size 4 loads (padded to 412: rank 3 holds 101 real rows and
    2 zero rows) and every logit equals one rank's, over the 410 real tokens only."""
    torch.manual_seed(0)
    reference = scenario(str(v410_ckpt))
    out = tmp_path / "logits.pt"
    run_ranks(v410_ckpt, 4, 1, out)
    ours = torch.load(out)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a.shape == b.shape and a.shape[-1] == 410
        assert rel_err(a, b) <= TOL, f"step {i}: {rel_err(a, b):.2e}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {i}: greedy tokens differ"


def test_padded_vocab_rows_are_read_short_and_zero_filled(v410_ckpt):
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state
    from serving.models.loader import load_weights

    config = ModelConfig.from_pretrained(v410_ckpt)
    full, _ = load_weights(v410_ckpt, config, torch.float32)
    for rank, real in ((0, 103), (3, 101)):
        set_state(ParallelState(rank=rank, tp_size=4))
        try:
            part, _ = load_weights(v410_ckpt, config, torch.float32)
        finally:
            set_state(ParallelState())
        for name in ("embed_tokens", "lm_head.weight"):
            f, p = dict(full.named_parameters())[name], dict(part.named_parameters())[name]
            assert p.shape[0] == 103
            assert torch.equal(p[:real], f[rank * 103 : rank * 103 + real])
            assert p[real:].abs().sum() == 0


def test_rank_reads_only_its_slices(tiny_ckpt):
    """Rank 1 of TP2+EP2 holds half the heads, half the vocab and the second half of the
    experts, each equal to that slice of the one-rank model (no process group needed)."""
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state
    from serving.models.loader import load_weights

    config = ModelConfig.from_pretrained(tiny_ckpt)
    full, _ = load_weights(tiny_ckpt, config, torch.float32)
    set_state(ParallelState(rank=1, tp_size=2, ep_size=2))
    try:
        part, _ = load_weights(tiny_ckpt, config, torch.float32)
    finally:
        set_state(ParallelState())
    f, p = dict(full.named_parameters()), dict(part.named_parameters())
    half = config.vocab_size // 2
    assert torch.equal(p["embed_tokens"], f["embed_tokens"][half:])
    q = f["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(p["layers.0.self_attn.q_proj.weight"], q[q.shape[0] // 2 :])
    o = f["layers.1.self_attn.o_proj.weight"]
    assert torch.equal(p["layers.1.self_attn.o_proj.weight"], o[:, o.shape[1] // 2 :])
    e = config.n_routed_experts // 2
    assert torch.equal(p["layers.1.mlp.w13"], f["layers.1.mlp.w13"][e:])
    conv, qkv = f["layers.0.self_attn.conv_weight"], config.kda_qkv_dim
    local = torch.cat([conv[i * qkv + qkv // 2 : (i + 1) * qkv] for i in range(3)])
    assert torch.equal(p["layers.0.self_attn.conv_weight"], local)


def test_plan_of_the_real_config(tmp_path, capsys):
    """The plan command from config.json alone: the real preset at the seed's decode settings."""
    from serving.tools.plan import main
    from serving.tools.tiny_model import write_checkpoint

    real = write_checkpoint(tmp_path / "real", preset="real")
    assert not list(real.glob("*.safetensors"))
    flags = ["--model-path", str(real), "--mem-fraction-static", "0.70"]
    flags += ["--context-length", "69632", "--max-running-requests", "32"]
    flags += ["--disaggregation-decode-extra-slots", "64", "--gpu-memory-gib", "141"]
    main([*flags, "--tp-size", "8", "--ep-size", "8"])
    out = capsys.readouterr().out
    assert "313.3 B parameters" in out, out  # float32 islands counted once, not by bytes
    assert "request rows                  97" in out, out
    weights = float(out.split("weights per rank")[1].split()[0])
    assert 583.7 / 8 < weights < 583.7 / 8 + 2, out  # a little replicated on every rank
    assert "KV tokens per GPU" in out, out
    with pytest.raises(SystemExit, match="linear_num_heads .KDA heads. = 64 does not divide"):
        main([*flags, "--tp-size", "3", "--ep-size", "3"])


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2), (4, 1), (4, 4)])
def test_tiny_loads_at_every_size_it_divides_by(tiny_ckpt, tp, ep):
    """Each rank reads only its slices: the last rank's bytes read are its parameters' bytes,
    well under the checkpoint's (replicated tensors are read by every rank)."""
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state
    from serving.models.loader import load_weights

    config = ModelConfig.from_pretrained(tiny_ckpt)
    full, _ = load_weights(tiny_ckpt, config, torch.float32)
    world = max(tp, ep)
    set_state(ParallelState(rank=world - 1, tp_size=tp, ep_size=ep))
    try:
        part, _ = load_weights(tiny_ckpt, config, torch.float32)
    finally:
        set_state(ParallelState())
    own = sum(p.numel() * p.element_size() for p in part.parameters())
    assert part.checkpoint_bytes_read == own
    assert own < (0.75 if tp > 1 else 0.95) * full.checkpoint_bytes_read, own


def test_peak_host_memory_per_rank_while_loading(tmp_path, monkeypatch):
    """Each TP2 rank's peak RSS (VmHWM) grows by well under what loading the whole checkpoint
    costs: ranks allocate their shard only and read their slices, never the full tensors.
    The checkpoint is the tiny one widened to ~400 MB (the routed experts, split by intermediate
    size at TP2), so the weights dominate the peak."""
    from serving.tools import tiny_model

    wide = {**tiny_model.PRESETS["tiny"], "hidden_size": 512, "intermediate_size": 1024}
    wide.update(moe_intermediate_size=512, n_routed_experts=32)
    monkeypatch.setitem(tiny_model.PRESETS, "wide", wide)
    ckpt = tiny_model.write_checkpoint(tmp_path / "wide", preset="wide")
    peaks = load_peaks(ckpt, [(0, 1, 1), (0, 2, 1), (1, 2, 1)])
    growth = {key: (after - before) / 1024 for key, (before, after) in peaks.items()}
    full = growth.pop((0, 1, 1))
    print(f"peak RSS growth while loading (MiB): one rank {full:.0f}, TP2 ranks", growth)
    assert full > 300, full  # the weights dominate: the comparison below means something
    for (rank, _, _), mib in growth.items():
        assert mib < 0.65 * full, f"TP2 rank {rank} peaked {mib:.0f} MiB over its start"


def test_sizes_that_do_not_divide_are_named(tiny_ckpt):
    from serving.config import ModelConfig
    from serving.distributed import check_sizes
    from serving.tools.tiny_model import build_config

    tiny = ModelConfig.from_pretrained(tiny_ckpt)
    with pytest.raises(ValueError, match=r"--tp-size 8: .*linear_num_heads \(KDA heads\) = 4"):
        check_sizes(tiny, 8, 8)
    with pytest.raises(ValueError, match=r"--ep-size 3: .*n_routed_experts = 8"):
        check_sizes(tiny, 1, 3)
    with pytest.raises(ValueError, match="each must be 1 or 4"):
        check_sizes(tiny, 2, 4)
    specials = {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2}
    for preset in ("bench", "real"):
        config = ModelConfig.from_dict(build_config(preset, specials))
        for n in (1, 2, 4, 8):
            check_sizes(config, n, n)
            check_sizes(config, n, 1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp-size", "2", "--nnodes", "2"], "--nnodes > 1: needs --dist-init-addr"),
        (["--tp-size", "4", "--nnodes", "3"], "--nnodes 3 --node-rank 0: the 4 ranks"),
        (["--tp-size", "2", "--ep-size", "4"], "each be 1 or the number of ranks (4)"),
    ],
)
def test_parallel_flags_that_cannot_take_effect(tiny_ckpt, flags, message):
    from serving.server_args import ArgsError, ServerArgs

    args = ServerArgs.from_cli(["--model-path", str(tiny_ckpt), "--device", "cpu", *flags])
    with pytest.raises(ArgsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        args.validate()


def test_rendezvous_address(tiny_ckpt):
    from serving.server_args import ServerArgs

    base = ["--model-path", str(tiny_ckpt), "--tp-size", "4"]
    args = ServerArgs.from_cli([*base, "--nccl-port", "22171"])
    assert args.dist_init_method() == "tcp://127.0.0.1:22171" and args.ranks_per_node == 4
    args = ServerArgs.from_cli([*base, "--dist-init-addr", "10.0.0.1:5000", "--nnodes", "2"])
    assert args.dist_init_method() == "tcp://10.0.0.1:5000" and args.ranks_per_node == 2


def test_every_step_rank_zero_sends_runs_on_a_follower(monkeypatch):
    """RankFanout's messages, fed to a Follower, call the same programs with the same host
    inputs in the same order (collectives stubbed: rank 0's broadcasts are recorded, then
    replayed to the follower), and its asks are answered by the follower's role and profiler."""
    from serving.engine import tp_worker
    from serving.engine.tp_worker import Follower, RankFanout
    from serving.executor.model_runner import ImageRows

    def _rows(images):  # what a follower's program got in place of image tokens' embeddings
        return None if images is None else (images.positions, images.embeds.tolist())

    calls: list[tuple] = []

    class Pool:
        device, journal = "cpu", None

        def take_journal(self) -> list:
            entries, self.journal = self.journal, []
            return entries

        def replay(self, journal: list) -> None:
            calls.append(("replay", journal))

    class Runner:
        pool = Pool()

        def forward(self, items, logits, images=None):
            calls.append(("forward", items, logits, _rows(images)))

        def publish(self, rows, tokens):
            calls.append(("publish", rows, tokens.tolist()))

    class Spec:
        def extend_draft(self, rows, starts, next_tokens, hidden, images=None):
            calls.append(
                ("extend_draft", rows, starts, next_tokens, hidden.tolist(), _rows(images))
            )

        def verify(self, host):
            calls.append(("verify", host.tolist()))
            return "pending"

        def roll_back(self, pending, padded, last, captures):
            calls.append(("roll_back", pending, padded, last, captures))

    class Answers:
        def handle(self, order):
            return ("answer", order)

    sent, tensors, gathered = [], [], []
    monkeypatch.setattr(tp_worker, "broadcast_object", sent.append)
    monkeypatch.setattr(tp_worker, "broadcast_tensor", lambda x: tensors.append(x.clone()))
    monkeypatch.setattr(tp_worker, "gather_object", lambda _: [None, "follower's"])
    fanout = RankFanout(Runner.pool, followers=1)
    fanout.forward(["item"], "last")
    fanout.forward(["item"], "last", ImageRows([1, 2], torch.full((2, 4), 3.0)))
    fanout.pool.journal.append(("reset", [3]))
    fanout.publish([3], torch.tensor([7]))
    fanout.extend_draft([3], [0], [[5, 6]], torch.ones(2, 4))
    fanout.extend_draft([3], [0], [[5, 6]], torch.ones(2, 4), ImageRows([0], torch.ones(1, 4)))
    fanout.verify(torch.tensor([[1], [2], [3]]))
    fanout.roll_back([[1, 2]], [1], [(0, 1, 9)])
    assert fanout.ask_role("orders") == ["follower's"]
    assert fanout.ask_profilers(("stop",)) == ["follower's"]
    fanout.stop()

    queue = list(sent)
    monkeypatch.setattr(tp_worker, "broadcast_object", lambda: queue.pop(0))
    monkeypatch.setattr(tp_worker, "broadcast_tensor", lambda x: x.copy_(tensors.pop(0)))
    monkeypatch.setattr(tp_worker, "gather_object", gathered.append)
    Follower(Runner(), Spec(), Answers(), Answers(), 4, torch.float32, False).follow()
    assert not queue and not tensors
    assert [c for c in calls if c[0] != "replay"] == [
        ("forward", ["item"], "last", None),
        ("forward", ["item"], "last", ([1, 2], [[3.0] * 4] * 2)),
        ("publish", [3], [7]),
        ("extend_draft", [3], [0], [[5, 6]], [[1.0] * 4] * 2, None),
        ("extend_draft", [3], [0], [[5, 6]], [[1.0] * 4] * 2, ([0], [[1.0] * 4])),
        ("verify", [[1], [2], [3]]),
        ("roll_back", "pending", [[1, 2]], [1], [(0, 1, 9)]),
    ]
    assert ("replay", [("reset", [3])]) in calls
    assert gathered == [("answer", "orders"), ("answer", ("stop",))]
