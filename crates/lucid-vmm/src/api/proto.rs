//! The control API's wire types, shared by the server ([`super::ApiServer`]) and its client
//! (`lucid sym`): one JSON object per line each way.
//!
//! A request names its operation in `op` ([`Request`]). A reply is a [`Reply`]: `"ok":true`
//! beside the fields of the operation's answer, or `"ok":false` and an `error` in words.

use std::path::PathBuf;

use lucid_sym::abi;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::sym::{ModuleInfo, SymReturn};

/// One request line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Runs a SymCall on `vcpu`; answered by a [`SymReturn`].
    Symcall {
        #[serde(default)]
        vcpu: u32,
        call: CallName,
        /// Up to 5 (rdi, rsi, rdx, r10, r8).
        #[serde(default)]
        args: Vec<u64>,
        /// The call's time bound in ms (default: the VM's, `Symbiotic::call_limits`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
    },
    /// Loads a module from a file Lucid reads, or a built-in one; answered by a
    /// [`ModuleInfo`].
    ModuleLoad {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        path: Option<PathBuf>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        builtin: Option<String>,
        #[serde(default)]
        read_only: bool,
    },
    /// Answered by [`Unloaded`].
    ModuleUnload { id: u32 },
    /// Answered by [`ModuleList`].
    Modules,
    /// Answered by the SymSpy pages (`Symbiotic::spy_snapshot`).
    Spy,
    /// Answered by [`Counters`].
    Stats,
    /// Answered by [`Stopping`].
    Stop,
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

/// One reply line: the answer's fields beside `ok`, or `error` when `ok` is false.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply<T> {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(flatten)]
    pub answer: Option<T>,
}

impl<T> Reply<T> {
    pub fn answer(answer: T) -> Self {
        Reply {
            ok: true,
            error: None,
            answer: Some(answer),
        }
    }

    pub fn error(msg: impl Into<String>) -> Self {
        Reply {
            ok: false,
            error: Some(msg.into()),
            answer: None,
        }
    }

    /// The answer, or the error the server gave.
    pub fn into_result(self) -> Result<T, String> {
        match (self.ok, self.answer) {
            (true, Some(a)) => Ok(a),
            (true, None) => Err("the API's reply has no answer".into()),
            (false, _) => Err(self
                .error
                .unwrap_or_else(|| "the API refused the request without saying why".into())),
        }
    }
}

/// The answer to [`Request::ModuleUnload`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unloaded {
    pub id: u32,
}

/// The answer to [`Request::Modules`]: the modules loaded now.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModuleList {
    pub modules: Vec<ModuleInfo>,
}

/// The answer to [`Request::Stats`]: the counters as a tree (`lucid_stats::nest`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub counters: Value,
}

/// The answer to [`Request::Stop`]: nothing but `ok`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stopping {}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(s: &str) -> Result<Request, String> {
        serde_json::from_str(s).map_err(|e| e.to_string())
    }

    #[test]
    fn requests_parse_and_bad_ones_say_why() {
        match parse(r#"{"op":"symcall","vcpu":1,"call":"echo","args":[1,2,3]}"#).unwrap() {
            Request::Symcall {
                vcpu,
                call,
                args,
                timeout_ms,
            } => {
                assert_eq!((vcpu, call.number().unwrap(), args), (1, 0, vec![1, 2, 3]));
                assert_eq!(timeout_ms, None);
            }
            r => panic!("{r:?}"),
        }
        match parse(r#"{"op":"symcall","call":257,"timeout_ms":5000}"#).unwrap() {
            Request::Symcall {
                vcpu,
                call,
                args,
                timeout_ms,
            } => {
                assert_eq!((vcpu, call.number().unwrap(), args.len()), (0, 257, 0));
                assert_eq!(timeout_ms, Some(5000));
            }
            r => panic!("{r:?}"),
        }
        assert!(matches!(
            parse(r#"{"op":"module_load","path":"/x.o","read_only":true}"#).unwrap(),
            Request::ModuleLoad {
                read_only: true,
                ..
            }
        ));
        assert!(matches!(parse(r#"{"op":"stats"}"#), Ok(Request::Stats)));
        let e = parse(r#"{"op":"frobnicate"}"#).unwrap_err();
        assert!(e.contains("unknown variant `frobnicate`"), "{e}");
        let e = parse(r#"{"op":"symcall","call":"echo","arg":[1]}"#).unwrap_err();
        assert!(e.contains("unknown field `arg`"), "{e}");
        assert!(parse("{not json").is_err());
        assert!(parse(r#"{"op":"module_unload"}"#).is_err());
    }

    #[test]
    fn requests_serialise_to_what_the_server_parses() {
        let to = |r: &Request| serde_json::to_value(r).unwrap();
        let call = Request::Symcall {
            vcpu: 1,
            call: CallName::Name("echo".into()),
            args: vec![1, 16],
            timeout_ms: None,
        };
        assert_eq!(
            to(&call),
            json!({"op":"symcall","vcpu":1,"call":"echo","args":[1,16]})
        );
        let load = Request::ModuleLoad {
            path: None,
            builtin: Some("hello".into()),
            read_only: true,
        };
        assert_eq!(
            to(&load),
            json!({"op":"module_load","builtin":"hello","read_only":true})
        );
        assert_eq!(to(&Request::Stop), json!({"op":"stop"}));
        for r in [call, load, Request::ModuleUnload { id: 3 }, Request::Spy] {
            assert_eq!(parse(&serde_json::to_string(&r).unwrap()).unwrap(), r);
        }
    }

    #[test]
    fn replies_have_ok_beside_the_answer_or_an_error() {
        let v = serde_json::to_value(Reply::answer(Unloaded { id: 4 })).unwrap();
        assert_eq!(v, json!({"ok":true,"id":4}));
        let v = serde_json::to_value(Reply::answer(Stopping {})).unwrap();
        assert_eq!(v, json!({"ok":true}));
        let v = serde_json::to_value(Reply::<Stopping>::error("no")).unwrap();
        assert_eq!(v, json!({"ok":false,"error":"no"}));
        let r: Reply<Unloaded> = serde_json::from_value(json!({"ok":true,"id":4})).unwrap();
        assert_eq!(r.into_result(), Ok(Unloaded { id: 4 }));
        let r: Reply<Unloaded> = serde_json::from_value(json!({"ok":false,"error":"x"})).unwrap();
        assert_eq!(r.into_result(), Err("x".into()));
        let r: Reply<Value> = serde_json::from_value(json!({"ok":true,"a":{"b":1}})).unwrap();
        assert_eq!(r.into_result(), Ok(json!({"a":{"b":1}})));
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
