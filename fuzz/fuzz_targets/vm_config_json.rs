//! `VmConfig` from JSON (what `--config FILE` and the control API will read): any bytes give a
//! configuration or an error, `validate()` never panics, and an accepted configuration written
//! back as JSON reads back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lucid_vmm::VmConfig;

fuzz_target!(|s: &str| {
    if let Ok(c) = serde_json::from_str::<VmConfig>(s) {
        let _ = c.validate();
        let json = serde_json::to_string(&c).expect("a configuration serialises");
        let again: VmConfig = serde_json::from_str(&json).expect("written-back JSON reads back");
        assert_eq!(serde_json::to_string(&again).unwrap(), json);
    }
});
