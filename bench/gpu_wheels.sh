#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what a bare CUDA machine needs beyond its image to run the PD
# stack (bench/pd_bench.py installs it there): cp312 manylinux x86_64 wheels of our
# dependencies the image lacks, the CUDA 13 Mooncake wheel cut down to the transfer engine, and
# Debian packages of the system libraries Mooncake's engine.so links (libibverbs, libmlx5,
# libnuma, libcurl and their closure; pd_bench.py links in only those the machine lacks).
#
#   bash bench/gpu_wheels.sh            # run from the repository root, on a machine with pip
#                                        # (PyPI) and apt (Debian) access
#
# The image is assumed to have torch, httpx, anyio, h11, click, annotated-doc, uvloop, jinja2,
# prometheus-client, safetensors, tokenizers, numpy, aiohttp, requests, msgpack.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl/deb

# Versions: the ones the CPU test environment runs (pyproject.toml's ranges).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
    mooncake-transfer-engine-cuda13==0.3.13.post1 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 pyzmq==27.3.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 opentelemetry-api==1.45.2 llguidance==1.9.1 fla-core==0.6.0

# The Mooncake wheel is 98 MB, mostly what we never load (collective backend, EP kernels, the
# store, benchmark and master binaries). Keep mooncake.engine and the libraries it links.
"$PY" - .whl/mooncake_transfer_engine_cuda13-*.whl <<'EOF'
import re, sys, zipfile, os
path = sys.argv[1]
drop = re.compile(
    r"^mooncake/(libmooncake_pg.*\.so|pg_.*\.so|libmooncake_ep_device\.so|_ep\..*\.so|store\.so"
    r"|transfer_engine_bench|mooncake_client|mooncake_master)$"
    r"|^mooncake_transfer_engine_cuda13\.libs/(libetcd_wrapper|libasio|libzstd|libxxhash|liburing)"
)
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if drop.search(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(x for x in lines if not drop.search(x.split(",")[0])).encode()
        dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(tmp, path)
print(f"{os.path.basename(path)}: cut to {os.path.getsize(path) / 2**20:.1f} MiB")
EOF

(cd .whl/deb && apt-get download -q \
    libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 \
    libcurl4 libbrotli1 libcom-err2 libdb5.3 libffi8 libgmp10 libgnutls30 libgssapi-krb5-2 \
    libhogweed6 libidn2-0 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 libldap-2.5-0 \
    libnettle8 libnghttp2-14 libp11-kit0 libpsl5 librtmp1 libsasl2-2 libsasl2-modules-db \
    libssh2-1 libssl3 libtasn1-6 libunistring2 libzstd1 zlib1g)
du -sh .whl .whl/deb
