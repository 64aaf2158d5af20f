//! The REST API's request framing (`lucid::rest::parse_request`) on any bytes a client sends:
//! it never panics, a refusal is a 4xx with a message, a whole request's body is within the
//! cap, and every prefix of a whole request is partial or the same refusal-free framing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lucid::rest::{parse_request, Parsed, MAX_BODY};

fuzz_target!(|data: &[u8]| {
    match parse_request(data) {
        Ok(Parsed::Complete(r)) => {
            assert!(r.body.len() <= MAX_BODY);
            assert!(r.body.len() <= data.len());
            // The bytes as they arrived, a few at a time: never refused before the whole.
            for cut in [1, data.len() / 2, data.len().saturating_sub(1)] {
                if cut < data.len() {
                    if let Err(resp) = parse_request(&data[..cut]) {
                        panic!("a prefix of a whole request refused: {resp:?}");
                    }
                }
            }
        }
        Ok(Parsed::Partial) => {}
        Err(resp) => {
            assert!((400..500).contains(&resp.status()), "{resp:?}");
            assert!(!resp.body().is_empty());
        }
    }
});
