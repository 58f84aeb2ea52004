# syntax=docker/dockerfile:1
# The sluice node agent image: `sluice` and `sluice-cni` side by side in
# /usr/local/bin (the agent copies sluice-cni from next to its own executable
# into the node's CNI bin dir; it is static, so it runs on any host
# distribution). Build with `cargo xtask image [--tag T]`.

# --- build: the project's own xtask does the toolchain setup and eBPF build.
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
# `cargo xtask setup` expects a toolchain named `nightly` to exist; it adds
# rust-src to it, builds bpf-linker against its LLVM and installs the Debian
# packages the tests use (as root, with apt-get: fine in a build stage).
RUN rustup toolchain install nightly --profile minimal
WORKDIR /src
COPY . .
RUN cargo xtask setup \
 && cargo xtask build-ebpf \
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
