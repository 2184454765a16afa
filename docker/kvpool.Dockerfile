# syntax=docker/dockerfile:1.7
# The `kvpool` image: the one `kvpool` binary (default features) for the operator
# (`kvpool operator run`), the master, the conductor and the synthetic engines.
# Build from the repository root:
#   docker build -f docker/kvpool.Dockerfile -t ghcr.io/kvpool/kvpool:0.1.0 .
# Runs as UID 65532. See docs/images.md.

ARG RUST_VERSION=1.95.0
ARG DEBIAN_RELEASE=bookworm

FROM docker.io/library/rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
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

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kvpool" \
      org.opencontainers.image.description="kvpool: operator, master, conductor and synthetic engines" \
      org.opencontainers.image.source="https://github.com/kvpool/kvpool" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/kvpool /usr/local/bin/kvpool
USER 65532:65532
EXPOSE 9090 50051 8000
ENTRYPOINT ["/usr/local/bin/kvpool"]
