"""training/train_small.py on CPU with the tiny preset (transformers' torch KDA path): a
run split in two with --resume ends with exactly the weights of one straight run, the export
reads the same in transformers and our loader, and every refusal is one clear line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from training.train_small import Plan, Trainer, main

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--preset", "tiny", "--device", "cpu", "--batch", "2", "--seq-len", "64",
        "--steps", "4", "--warmup", "2", "--log-every", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The tiny tokenizer's corpus, one document per paragraph."""
    out = tmp_path_factory.mktemp("corpus")
    text = (REPO / "serving" / "assets" / "corpus.txt").read_text()
    docs = [p for p in text.split("\n\n") if len(p) > 200]
    for split, part in (("train", docs), ("heldout", docs[:4])):
        with gzip.open(out / f"{split}.jsonl.gz", "wt") as f:
            for i, d in enumerate(part):
                f.write(json.dumps({"source": "t", "id": f"{split}{i}", "text": d}) + "\n")
    return out


def test_resumed_run_equals_a_straight_run_and_exports(corpus, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    main(["--run", str(straight), "--corpus", str(corpus), *ARGS])
    main(["--run", str(split), "--corpus", str(corpus), *ARGS, "--run-steps", "2"])
    assert torch.load(split / "state.pt", weights_only=False)["step"] == 2
    main(["--run", str(split), "--corpus", str(corpus), *ARGS, "--resume"])
    a = torch.load(straight / "state.pt", weights_only=False)
    b = torch.load(split / "state.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for part in ("model", "mtp"):
        for name, t in a[part].items():
            assert torch.equal(t, b[part][name]), f"{part}.{name} differs after the resume"
    log = [json.loads(x) for x in (split / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    # --extend: four more steps on a second cosine segment (warm-up 2 from the floor to half the
    # first peak, then down to the floor at the plan's end); the first segment's rates unchanged
    main(["--run", str(straight), "--corpus", str(corpus), *ARGS, "--resume", "--extend", "4"])
    state = torch.load(straight / "state.pt", weights_only=False)
    assert state["step"] == 8 and state["plan"]["extend_from"] == 4
    first, both = _lrs(Plan(**a["plan"]), 4), _lrs(Plan(**state["plan"]), 9)
    lr = a["plan"]["lr"]
    assert both[:4] == first
    assert both[4:] == pytest.approx([0.3 * lr, 0.5 * lr, 0.5 * lr, 0.3 * lr, 0.1 * lr])
    main(["--run", str(split), "--export", str(tmp_path / "ckpt")])
    check = json.loads((tmp_path / "ckpt.export_check.json").read_text())
    assert check["target_rel_err"] < 1e-5 and check["target_argmax_equal"] == 1.0, check
    assert check["draft_rel_err"] < 1e-5 and check["draft_argmax_equal"] == 1.0, check


def _lrs(plan, n: int) -> list[float]:
    """The learning rates of steps 0..n-1 under `plan`."""
    trainer = type("T", (), {"plan": plan})()
    return [Trainer.lr_at(trainer, step) for step in range(n)]


def test_refusals_name_the_problem(corpus, tmp_path, capsys):
    def _refusal(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(list(argv))
        assert exit_.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert "no corpus at" in _refusal("--run", str(tmp_path / "r1"), "--corpus",
                                      str(tmp_path / "nowhere"), *ARGS)  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    with gzip.open(empty / "train.jsonl.gz", "wt") as f:
        f.write(json.dumps({"source": "t", "id": "0", "text": "  "}) + "\n")
    assert "is empty" in _refusal("--run", str(tmp_path / "r2"), "--corpus", str(empty), *ARGS)
    assert "no " in _refusal("--run", str(tmp_path / "r3"), "--resume", *ARGS)
    assert "no token shards" in _refusal("--run", str(tmp_path / "r5"), "--tokens",
                                         str(tmp_path / "nowhere"), *ARGS)  # fmt: skip
    run = tmp_path / "r4"
    main(["--run", str(run), "--corpus", str(corpus), *ARGS, "--run-steps", "1"])
    assert "pass --resume" in _refusal("--run", str(run), "--corpus", str(corpus), *ARGS)
    assert "finish its plan first" in _refusal("--run", str(run), "--resume", "--extend", "2",
                                               *ARGS)  # fmt: skip
    raw = json.loads((run / "config.json").read_text())
    raw["text_config"]["hidden_size"] = 96
    (run / "config.json").write_text(json.dumps(raw))
    line = _refusal("--run", str(run), "--resume", *ARGS)
    assert "does not match" in line and "hidden_size" in line, line
    other = ARGS[:1] + ["small"] + ARGS[2:]
    assert "--preset tiny, not small" in _refusal("--run", str(run), "--resume", *other)


def test_token_shards_round_trip_and_stage_parts(tmp_path, monkeypatch):
    """Shards hold the token stream exactly; staged parts are disjoint, cover every shard, stay
    under their size and carry the held-out shard and the run's tokenizer files."""
    import numpy as np

    from training import token_shards

    monkeypatch.setattr(token_shards, "SHARD_TOKENS", 1000)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 8192, rng.integers(50, 400), dtype=np.uint16) for _ in range(40)]
    run = tmp_path / "run"
    index = token_shards.write_tokens(run / "tokens", iter(docs), docs[0])
    for name in token_shards.RUN_FILES:
        (run / name).write_text(name)
    read = token_shards.read_tokens(run / "tokens")
    assert torch.equal(read["train"], torch.from_numpy(np.concatenate(docs).astype(np.int32)))
    assert torch.equal(read["heldout"], torch.from_numpy(docs[0].astype(np.int32)))
    shard_bytes = max(s["bytes"] for s in index["shards"])
    mib = 3.5 * shard_bytes / 2**20
    groups = token_shards.parts(index, mib)
    assert len(groups) > 1
    staged = []
    for part in range(1, len(groups) + 1):
        out = tmp_path / f"carry{part}"
        report = token_shards.stage(run, out, part, mib)
        assert report["mib"] * 2**20 <= mib * 2**20 + 65536  # + the small text files
        assert (out / "tokenizer.json").read_text() == "tokenizer.json"
        got = token_shards.read_tokens(out / "tokens")
        assert torch.equal(got["heldout"], read["heldout"])
        staged += got["shards"]
    assert staged == read["shards"]
    with pytest.raises(FileNotFoundError, match="no token shards"):
        token_shards.read_tokens(tmp_path / "nowhere")
