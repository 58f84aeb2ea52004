//! One control-socket request line, as the agent parses it. Never a panic;
//! a line that parses serialises to a line that parses to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::control::parse_envelope;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(env) = parse_envelope(line) {
        let text = serde_json::to_string(&env).expect("requests serialise");
        let again = parse_envelope(&text).expect("our own serialisation parses");
        assert_eq!(serde_json::to_string(&again).unwrap(), text);
    }
});
