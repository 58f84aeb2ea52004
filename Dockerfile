# syntax=docker/dockerfile:1
# The sluice node agent image: `sluice` and `sluice-cni` side by side in
# /usr/local/bin (the agent copies sluice-cni from next to its own executable
# into the node's CNI bin dir; it is static, so it runs on any host
# distribution). Build with `cargo xtask image [--tag T]` or plain
# `docker build .`; for amd64 and arm64 at once:
#   docker buildx build --platform linux/amd64,linux/arm64 --tag REGISTRY/sluice:TAG --push .
# (each platform's build stage runs natively or under QEMU emulation: slow,
# but the same steps; the plugin is built for that platform's musl target).

# --- build: the project's own xtask does the toolchain setup and eBPF build.
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# The toolchain first, from the workspace's manifests and xtask alone, so a
# source change reuses this layer instead of rebuilding bpf-linker. The other
# members get empty sources: cargo only needs to load the workspace.
# `setup --build-only` installs the pinned nightly (xtask/src/setup.rs
# NIGHTLY, the one pin), its rust-src, the musl target, bpf-linker against
# that nightly's LLVM and a C linker; none of the tests' packages.
COPY Cargo.toml Cargo.lock ./
COPY .cargo .cargo
COPY xtask xtask
COPY common/Cargo.toml common/
COPY ebpf/Cargo.toml ebpf/
COPY userspace/Cargo.toml userspace/
COPY cni/Cargo.toml cni/
COPY tests/Cargo.toml tests/
RUN for d in common ebpf userspace cni tests; do mkdir -p "$d/src" && touch "$d/src/lib.rs"; done \
 && cargo xtask setup --build-only
COPY . .
RUN cargo xtask build-ebpf \
 && cargo build --release -p sluice --bins \
 && cargo xtask build-cni \
 && install -D -m 0755 target/release/sluice /out/sluice \
 && install -D -m 0755 "target/$(uname -m)-unknown-linux-musl/release/sluice-cni" /out/sluice-cni

# --- runtime: a small base plus iptables, whose iptables-save/ip6tables-save
# the agent runs to find and remove istio-cni's in-pod rules when it takes a
# pod over from istio-cni.
FROM debian:bookworm-slim
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/sluice /out/sluice-cni /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["--help"]
