//! The wire types of Lucid's `/api/v1/lucid.*` endpoints (docs/api.md), shared by the VMM
//! side ([`super`]) and the client (`lucid sym`): a request body is a JSON object of the
//! operation's fields (unknown fields refused), an answer is the operation's JSON object; a
//! refusal is Cloud Hypervisor's error body, a JSON array of messages.

use std::path::PathBuf;

use lucid_sym::abi;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::sym::{ModuleInfo, SymReturn};

/// `PUT lucid.symcall`: runs a SymCall on `vcpu`; answered by a [`SymReturn`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Symcall {
    #[serde(default)]
    pub vcpu: u32,
    pub call: CallName,
    /// Up to 5 (rdi, rsi, rdx, r10, r8).
    #[serde(default)]
    pub args: Vec<u64>,
    /// The call's time bound in ms (default: the VM's, `Symbiotic::call_limits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// `PUT lucid.module-load`: loads a module from a file Lucid reads, or a built-in one;
/// answered by a [`ModuleInfo`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleLoad {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<String>,
    #[serde(default)]
    pub read_only: bool,
}

/// `PUT lucid.module-unload`; answered by [`Unloaded`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleUnload {
    pub id: u32,
}

/// A SymCall by name (`echo`, `page_state`, `read_counter`, `slot_live`) or number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CallName {
    Number(u64),
    Name(String),
}

impl CallName {
    /// The call's number; an unknown name is an error in words.
    pub fn number(&self) -> Result<u64, String> {
        match self {
            CallName::Number(n) => Ok(*n),
            CallName::Name(s) => call_number(s),
        }
    }
}

/// The SymCall number of `name`: a name, or a number (decimal or 0x hex).
pub fn call_number(name: &str) -> Result<u64, String> {
    Ok(match name {
        "echo" => abi::call::ECHO,
        "page_state" => abi::call::PAGE_STATE,
        "read_counter" => abi::call::READ_COUNTER,
        "slot_live" => abi::call::SLOT_LIVE,
        s => match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16),
            None => s.parse(),
        }
        .map_err(|_| {
            format!("no SymCall {s:?}: echo, page_state, read_counter, slot_live or a number")
        })?,
    })
}

/// The answer to [`ModuleUnload`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unloaded {
    pub id: u32,
}

/// The answer to `GET lucid.modules`: the modules loaded now.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModuleList {
    pub modules: Vec<ModuleInfo>,
}

/// The answer to `GET lucid.stats`: the counters as a tree (`lucid_stats::nest`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub counters: Value,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bodies_parse_and_bad_ones_say_why() {
        let c: Symcall =
            serde_json::from_value(json!({"vcpu":1,"call":"echo","args":[1,2,3]})).unwrap();
        assert_eq!(
            (c.vcpu, c.call.number().unwrap(), c.args),
            (1, 0, vec![1, 2, 3])
        );
        assert_eq!(c.timeout_ms, None);
        let c: Symcall = serde_json::from_value(json!({"call":257,"timeout_ms":5000})).unwrap();
        assert_eq!(
            (c.vcpu, c.call.number().unwrap(), c.timeout_ms),
            (0, 257, Some(5000))
        );
        let e = serde_json::from_value::<Symcall>(json!({"call":"echo","arg":[1]})).unwrap_err();
        assert!(e.to_string().contains("unknown field `arg`"), "{e}");
        let m: ModuleLoad =
            serde_json::from_value(json!({"path":"/x.o","read_only":true})).unwrap();
        assert!(m.read_only && m.builtin.is_none());
        assert!(serde_json::from_value::<ModuleUnload>(json!({})).is_err());
        let load = ModuleLoad {
            path: None,
            builtin: Some("hello".into()),
            read_only: true,
        };
        assert_eq!(
            serde_json::to_value(&load).unwrap(),
            json!({"builtin":"hello","read_only":true})
        );
    }

    #[test]
    fn call_names_and_numbers() {
        assert_eq!(call_number("echo"), Ok(abi::call::ECHO));
        assert_eq!(call_number("page_state"), Ok(abi::call::PAGE_STATE));
        assert_eq!(call_number("read_counter"), Ok(abi::call::READ_COUNTER));
        assert_eq!(call_number("slot_live"), Ok(abi::call::SLOT_LIVE));
        assert_eq!(call_number("0x101"), Ok(0x101));
        assert_eq!(call_number("7"), Ok(7));
        assert!(call_number("ech0").unwrap_err().contains("no SymCall"));
    }
}
