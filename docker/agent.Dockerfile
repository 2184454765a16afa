# syntax=docker.io/docker/dockerfile:1.7
# Node agent image: the one `kvpool` binary, built with the `rdma` feature, plus the RDMA
# user-space runtime; the DaemonSet runs `kvpool agent run`. Build from the repository root:
#   docker build -f docker/agent.Dockerfile -t ghcr.io/kvpool/kvpool-agent:0.1.0 .
# Runs as root on purpose: the agent pins its DRAM tier for RDMA (CAP_IPC_LOCK, which Kubernetes
# does not give a non-root process) and writes hostPath directories (the engine socket
# directory, the SSD tier). The operator's DaemonSet drops every capability except IPC_LOCK.
# See docs/images.md.
# Base images are written out in full (no build arguments) so that scripts/pin-images.sh can pin
# each one to its digest (`image:tag@sha256:...`) and later refresh the pins; the rust tag is the
# toolchain rust-toolchain.toml pins (tests/packaging.rs checks both).

FROM docker.io/library/rust:1.95.0-bookworm AS build
# rdma-sys generates its bindings with bindgen (libclang) from the verbs headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev libclang-dev pkg-config \
      libibverbs-dev librdmacm-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p kvpool --bin kvpool --features rdma \
 && install -D -m 0755 target/release/kvpool /out/kvpool

FROM docker.io/library/debian:bookworm-slim
# Runtime RDMA libraries: verbs, the user-space providers (mlx5, efa, rxe, ...) and rdmacm.
# Without libibverbs1 a binary built with the rdma feature does not start at all.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
LABEL org.opencontainers.image.title="kvpool-agent" \
      org.opencontainers.image.description="kvpool node agent (kvpool agent run): DRAM and SSD tiers, RDMA/TCP transfer engine" \
      org.opencontainers.image.source="https://github.com/kvpool/kvpool" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/kvpool /usr/local/bin/kvpool
COPY LICENSE /usr/share/doc/kvpool/LICENSE
USER 0:0
EXPOSE 9090 15500
ENTRYPOINT ["/usr/local/bin/kvpool"]
