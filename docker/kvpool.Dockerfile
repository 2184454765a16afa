# syntax=docker.io/docker/dockerfile:1.7
# The `kvpool` image: the one `kvpool` binary (default features) for the operator
# (`kvpool operator run`), the master, the conductor and the synthetic engines, and the `kvpool`
# Python package (the PyO3 extension, kvpool.mooncake and the vLLM/SGLang adapters) installed at
# /opt/kvpool/python, which the init container of every engine pod copies into the engine
# (`kvpool operator install-python`); the wheel is built with feature `cuda` (GPU KV caches
# registered in place; the CUDA driver is loaded at run time, none is needed here).
# Build from the repository root:
#   docker build -f docker/kvpool.Dockerfile -t ghcr.io/kvpool/kvpool:0.1.0 .
# Runs as UID 65532. See docs/images.md and docs/adr/0004-python-package-in-engine-pods.md.
# Base images are written out in full (no build arguments) so that scripts/pin-images.sh can pin
# each one to its digest (`image:tag@sha256:...`) and later refresh the pins; the rust tag is the
# toolchain rust-toolchain.toml pins (tests/packaging.rs checks both).

ARG MATURIN_VERSION=1.9.6
ARG ZIGLANG_VERSION=0.12.1

FROM docker.io/library/rust:1.95.0-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev libclang-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p kvpool --bin kvpool \
 && install -D -m 0755 target/release/kvpool /out/kvpool

# The Python package: one abi3 wheel (every CPython the package supports), linked through zig
# against glibc 2.28's symbols so that the extension loads in engine images older than this
# Debian (manylinux_2_28: Ubuntu 20.04+, RHEL 8+, the floor PyTorch's own wheels have), then
# unpacked with pip. No dependencies are installed: the engine image brings its own Python ones.
FROM docker.io/library/rust:1.95.0-bookworm AS python
ARG MATURIN_VERSION
ARG ZIGLANG_VERSION
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev pkg-config python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/maturin \
 && /opt/maturin/bin/pip install --no-cache-dir "maturin==${MATURIN_VERSION}" "ziglang==${ZIGLANG_VERSION}"
# maturin runs zig as `python3 -m ziglang`, found on PATH.
ENV PATH=/opt/maturin/bin:${PATH}
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,id=kvpool-python-target,target=/src/target,sharing=locked \
    maturin build --release --locked --strip --zig --compatibility manylinux_2_28 -m crates/python/Cargo.toml \
      --features cuda \
      --interpreter /opt/maturin/bin/python3 --out /wheels \
 && pip install --no-cache-dir --no-deps --no-compile --target /opt/kvpool/python /wheels/*.whl \
 && test -f /opt/kvpool/python/kvpool/__init__.py \
 && chmod -R a+rX /opt/kvpool/python

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kvpool" \
      org.opencontainers.image.description="kvpool: operator, master, conductor, synthetic engines and the Python package for engine pods" \
      org.opencontainers.image.source="https://github.com/kvpool/kvpool" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/kvpool /usr/local/bin/kvpool
COPY LICENSE /usr/share/doc/kvpool/LICENSE
COPY --from=python /opt/kvpool/python /opt/kvpool/python
USER 65532:65532
EXPOSE 9090 50051 8000
ENTRYPOINT ["/usr/local/bin/kvpool"]
