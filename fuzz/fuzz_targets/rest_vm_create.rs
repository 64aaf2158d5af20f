//! The body of `vm.create` (Cloud Hypervisor's `VmConfig`) mapped onto Lucid's
//! (`lucid::rest::config::map`): any JSON gives a valid configuration or a refusal that names
//! what to fix, never a panic, and an accepted configuration serialises and reads back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lucid_vmm::VmConfig;

fuzz_target!(|s: &str| {
    let Ok(body) = serde_json::from_str::<serde_json::Value>(s) else {
        return;
    };
    match lucid::rest::config::map(body) {
        Ok(c) => {
            c.validate().expect("map returns only valid configurations");
            let json = serde_json::to_string(&c).expect("a configuration serialises");
            let again: VmConfig =
                serde_json::from_str(&json).expect("written-back JSON reads back");
            assert_eq!(serde_json::to_string(&again).unwrap(), json);
        }
        Err(e) => assert!(!e.0.is_empty()),
    }
});
