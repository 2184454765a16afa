# syntax=docker/dockerfile:1.7
# kvpool-operator image. Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvpool/kvpool-operator:0.1.0 .
# The chart runs it as `/usr/local/bin/kvpool-operator run ...` as UID 65532 with a read-only
# root filesystem. See docs/images.md.

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
    cargo build --release --locked -p kvpool-operator --bin kvpool-operator \
 && install -D -m 0755 target/release/kvpool-operator /out/kvpool-operator

# glibc + libgcc + CA certificates, no shell, UID 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kvpool-operator" \
      org.opencontainers.image.description="Kubernetes operator for KVCachePool, PrefillPool and DecodePool" \
      org.opencontainers.image.source="https://github.com/kvpool/kvpool" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/kvpool-operator /usr/local/bin/kvpool-operator
USER 65532:65532
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/kvpool-operator"]
CMD ["run"]
