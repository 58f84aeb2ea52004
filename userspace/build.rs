//! Generates the ZDS messages and embeds the eBPF object built by
//! `cargo xtask build-ebpf`, so `sluice` is one file to ship.

use std::path::PathBuf;

fn main() {
    // ZDS messages, generated from the project's own .proto (no protoc needed).
    println!("cargo:rerun-if-changed=proto/zds.proto");
    let fds = protox::compile(["proto/zds.proto"], ["proto"]).expect("compiling proto/zds.proto");
    prost_build::Config::new()
        .compile_fds(fds)
        .expect("generating ZDS messages");

    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| manifest.join("../target"));
    let obj = target.join("bpfel-unknown-none/release/sluice-ebpf");
    println!("cargo:rerun-if-changed={}", obj.display());
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    if obj.exists() {
        println!("cargo:rustc-env=SLUICE_EBPF_OBJECT={}", obj.display());
    } else {
        // `cargo check`, `clippy` and docs work without the BPF toolchain; a
        // binary built this way says so when it would load the programs.
        println!(
            "cargo:warning=the eBPF object {} is missing: this build cannot load the \
             dataplane (run `cargo xtask build-ebpf`, then build again)",
            obj.display()
        );
        let empty = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("no-ebpf-object");
        std::fs::write(&empty, b"").expect("writing the empty eBPF placeholder");
        println!("cargo:rustc-env=SLUICE_EBPF_OBJECT={}", empty.display());
    }
}
