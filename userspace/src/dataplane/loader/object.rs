//! The eBPF object this process loads, and a loader set for the kernel's
//! features.

use std::borrow::Cow;

use aya::EbpfLoader;

use crate::dataplane::features::Features;

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at compile time.
static EMBEDDED_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("SLUICE_EBPF_OBJECT"));

/// The object this process loads: the embedded one, or in a test build
/// (`fault-injection`) the file `SLUICE_EBPF_OBJECT_FILE` names — so the
/// upgrade tests can run "another build" of the programs.
pub fn ebpf_object() -> Cow<'static, [u8]> {
    #[cfg(feature = "fault-injection")]
    if let Some(path) = std::env::var_os("SLUICE_EBPF_OBJECT_FILE") {
        return Cow::Owned(std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "SLUICE_EBPF_OBJECT_FILE {}: {e}",
                std::path::Path::new(&path).display()
            )
        }));
    }
    Cow::Borrowed(EMBEDDED_OBJECT)
}

/// The object compiled into this binary.
pub fn embedded_object() -> &'static [u8] {
    EMBEDDED_OBJECT
}

/// An `EbpfLoader` whose programs' feature globals follow `features`.
pub fn loader_for(features: Features) -> EbpfLoader<'static> {
    static VALUES: [u8; 2] = [0, 1];
    let mut l = EbpfLoader::new();
    let cookie = &VALUES[usize::from(features.netns_cookie_in_tc)];
    l.override_global("NETNS_COOKIE_IN_TC", cookie, true);
    l
}
