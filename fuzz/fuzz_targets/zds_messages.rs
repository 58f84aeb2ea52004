//! What ztunnel sends over ZDS: its hello and its answers (any bytes, with
//! 0–2 fds announced), and requests as our own decoder reads them back. None
//! may panic; a request that decodes must encode to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::zds::{proto, server};

fuzz_target!(|data: &[u8]| {
    let (fds, msg) = match data.split_first() {
        Some((f, rest)) => (usize::from(*f % 3), rest),
        None => (0, data),
    };
    let _ = server::parse_hello(msg, fds);
    let _ = server::parse_answer(msg, fds);
    if let Ok(req) = proto::decode::<proto::WorkloadRequest>(msg) {
        let again: proto::WorkloadRequest =
            proto::decode(&proto::encode(&req)).expect("our own encoding decodes");
        assert_eq!(again, req);
        let _ = req.kind();
    }
});
