"""The small model's tokenized corpus as compressed shards, the form in which it travels to the GPU.

A token folder holds heldout.u16.xz, train-NNN.u16.xz (SHARD_TOKENS tokens each, the last
shorter) and index.json. A shard is the raw little-endian uint16 token ids (the vocabulary is
8,192 < 2**16), xz-compressed with LZMA2 set for 2-byte symbols (about 0.85 bytes a token, against
0.92 for the same text xz-compressed). Documents are shuffled before they are cut into shards, so
every shard is a sample of the whole corpus and a part made of any shards is too.

`stage` copies a run folder's tokenizer files and config.json, the held-out shard and the train
shards of one part into a folder small enough to be carried to the GPU machine beside the
repository (parts are consecutive shards that fit --mib):

    python -m training.token_shards stage --run data/small-run --out data/gpu-carry --part 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

SHARD_TOKENS = 2_000_000
FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 0, "lp": 1, "pb": 1}]
RUN_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "chat_template.jinja", "config.json")  # fmt: skip
PART_MIB = 26.0  # 31 MiB of tracked files + 1 MiB of fla-core + this < the 64 MiB carry limit


def _compress(ids: np.ndarray) -> bytes:
    return lzma.compress(ids.astype("<u2").tobytes(), format=lzma.FORMAT_XZ, filters=FILTERS)


def write_tokens(out: Path, train: Iterable[np.ndarray], heldout: np.ndarray) -> dict:
    """Cut the train token stream into shards; write them, the held-out shard and index.json."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.u16.xz"):
        old.unlink()
    chunks: list[np.ndarray] = []
    buffered, pieces = 0, []
    for ids in train:
        chunks.append(ids)
        buffered += len(ids)
        while buffered >= SHARD_TOKENS:
            flat = np.concatenate(chunks)
            pieces.append(flat[:SHARD_TOKENS])
            chunks, buffered = [flat[SHARD_TOKENS:]], len(flat) - SHARD_TOKENS
    if buffered:
        pieces.append(np.concatenate(chunks))
    names = [f"train-{i:03d}.u16.xz" for i in range(len(pieces))]
    with ThreadPoolExecutor(2) as pool:  # lzma lets go of the GIL
        blobs = list(pool.map(_compress, [heldout, *pieces]))
    shards = []
    for name, ids, blob in zip(["heldout.u16.xz", *names], [heldout, *pieces], blobs):
        (out / name).write_bytes(blob)
        shards.append({"name": name, "tokens": int(len(ids)), "bytes": len(blob),
                       "sha256": hashlib.sha256(blob).hexdigest()})  # fmt: skip
    index = {"dtype": "uint16", "shards": shards}
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def read_shard(path: Path) -> torch.Tensor:
    raw = lzma.decompress(path.read_bytes())
    return torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int32))


def read_tokens(folder: Path) -> dict[str, torch.Tensor]:
    """{"train": every train shard under `folder`, in name order, "heldout": its held-out shard,
    "shards": their names}; a missing folder, no train shard or no held-out shard is an error."""
    train = sorted(folder.glob("train-*.u16.xz"))
    if not train or not (folder / "heldout.u16.xz").is_file():
        raise FileNotFoundError(f"no token shards in {folder} (train-*.u16.xz and heldout.u16.xz)")
    return {
        "train": torch.cat([read_shard(p) for p in train]),
        "heldout": read_shard(folder / "heldout.u16.xz"),
        "shards": [p.name for p in train],
    }


def parts(index: dict, mib: float) -> list[list[dict]]:
    """The train shards grouped, in order, into parts of at most `mib` (with the held-out
    shard, which every part carries)."""
    heldout = next(s for s in index["shards"] if s["name"] == "heldout.u16.xz")
    out: list[list[dict]] = [[]]
    size = heldout["bytes"]
    for shard in index["shards"]:
        if shard["name"] == "heldout.u16.xz":
            continue
        if out[-1] and size + shard["bytes"] > mib * 2**20:
            out.append([])
            size = heldout["bytes"]
        out[-1].append(shard)
        size += shard["bytes"]
    return out


def stage(run: Path, out: Path, part: int, mib: float = PART_MIB) -> dict:
    """Copy the run's tokenizer files, config.json, held-out shard and part `part` (from 1) of
    its train shards into `out`/ (tokens in `out`/tokens)."""
    index = json.loads((run / "tokens" / "index.json").read_text())
    groups = parts(index, mib)
    if not 1 <= part <= len(groups):
        raise SystemExit(f"token_shards: --part must be 1..{len(groups)} at --mib {mib}")
    shutil.rmtree(out, ignore_errors=True)
    (out / "tokens").mkdir(parents=True)
    for name in RUN_FILES:
        shutil.copyfile(run / name, out / name)
    chosen = [s for s in index["shards"] if s["name"] == "heldout.u16.xz"] + groups[part - 1]
    for shard in chosen:
        shutil.copyfile(run / "tokens" / shard["name"], out / "tokens" / shard["name"])
    (out / "tokens" / "index.json").write_text(json.dumps({**index, "shards": chosen}, indent=2))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"part": part, "parts": len(groups), "train_tokens": sum(s["tokens"] for s in
            groups[part - 1]), "mib": round(size / 2**20, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stage", help="a carry folder of one part of the shards")
    st.add_argument("--run", default="data/small-run")
    st.add_argument("--out", default="data/gpu-carry")
    st.add_argument("--part", type=int, default=1)
    st.add_argument("--mib", type=float, default=PART_MIB)
    args = ap.parse_args()
    print(json.dumps(stage(Path(args.run), Path(args.out), args.part, args.mib)))


if __name__ == "__main__":
    main()
