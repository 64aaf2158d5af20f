//! One syntax for every comma-separated sub-option of Lucid's command line
//! (`HEAD,KEY=VALUE,...`), declared once per option in an [`OptSpec`] table: the parser refuses
//! what the table does not list, and the CLI's help text is generated from the same table, so
//! an option's spelling lives in one place.

/// One `KEY=VALUE` of an option.
#[derive(Clone, Copy, Debug)]
pub struct OptKey {
    pub key: &'static str,
    /// Other spellings accepted for `key`.
    pub aliases: &'static [&'static str],
    /// The value's syntax, as the help shows it (`on|off`, `MiB`).
    pub value: &'static str,
    /// What it means, one short clause.
    pub help: &'static str,
    /// Must be given.
    pub required: bool,
    /// The value is itself a comma list: key-less items after it continue it (`cpus=0,2-3`).
    pub list: bool,
}

impl OptKey {
    /// An optional key with no aliases.
    pub const fn new(key: &'static str, value: &'static str, help: &'static str) -> Self {
        OptKey {
            key,
            aliases: &[],
            value,
            help,
            required: false,
            list: false,
        }
    }

    pub const fn required(mut self) -> Self {
        self.required = true;
        self
    }

    pub const fn aliases(mut self, aliases: &'static [&'static str]) -> Self {
        self.aliases = aliases;
        self
    }

    pub const fn list(mut self) -> Self {
        self.list = true;
        self
    }
}

/// The first, key-less item of an option (`vtd` in `--iommu vtd,pin=map`).
#[derive(Clone, Copy, Debug)]
pub struct OptHead {
    /// How the help names it (`MODEL`, `NAME`).
    pub name: &'static str,
    /// The values it takes. A capitalised part is a placeholder: `file:PATH` takes `file:`
    /// followed by anything non-empty, `NAME` any non-empty value.
    pub choices: &'static [&'static str],
}

impl OptHead {
    /// The choice `value` is, with what its placeholder stands for (`file:PATH` and
    /// `file:/x` give `("file:PATH", "/x")`; a literal choice gives itself and `""`).
    pub fn matches<'a>(&self, value: &'a str) -> Option<(&'static str, &'a str)> {
        let placeholder = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_uppercase());
        self.choices.iter().find_map(|&c| {
            let (prefix, ph) = match c.split_once(':') {
                Some((prefix, ph)) if placeholder(ph) => (Some(prefix), ph),
                _ => (None, c),
            };
            match prefix {
                Some(prefix) => value
                    .strip_prefix(prefix)
                    .and_then(|r| r.strip_prefix(':'))
                    .filter(|r| !r.is_empty())
                    .map(|r| (c, r)),
                None if placeholder(ph) => (!value.is_empty()).then_some((c, value)),
                None => (value == c).then_some((c, "")),
            }
        })
    }
}

/// An option: its flag, what it is, and its keys.
#[derive(Clone, Copy, Debug)]
pub struct OptSpec {
    pub flag: &'static str,
    /// One sentence for the help text.
    pub about: &'static str,
    pub head: Option<OptHead>,
    pub keys: &'static [OptKey],
}

/// An option string that does not follow its table, saying which part and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptError {
    #[error("{opt} {input:?}: {pair:?} is not KEY=VALUE")]
    NotKeyValue {
        opt: &'static str,
        input: String,
        pair: String,
    },
    #[error("{opt}: unknown option {key:?} (options: {known})")]
    UnknownKey {
        opt: &'static str,
        key: String,
        known: String,
    },
    #[error("{opt}: {key} given twice")]
    Duplicate {
        opt: &'static str,
        key: &'static str,
    },
    #[error("{opt} {key}={value}: expected {expected}")]
    BadValue {
        opt: &'static str,
        key: &'static str,
        value: String,
        expected: String,
    },
    #[error("{opt} {input:?}: {what} is required")]
    Missing {
        opt: &'static str,
        input: String,
        what: String,
    },
    #[error("{opt} {value:?}: expected {choices}")]
    BadHead {
        opt: &'static str,
        value: String,
        choices: String,
    },
}

impl OptSpec {
    /// The keys' names, for error messages.
    pub fn known(&self) -> String {
        let names: Vec<&str> = self.keys.iter().map(|k| k.key).collect();
        match names.is_empty() {
            true => "none".into(),
            false => names.join(", "),
        }
    }

    /// The option's syntax on one line: `HEAD[,key=VALUE]...`.
    pub fn syntax(&self) -> String {
        let mut s = String::new();
        if let Some(h) = &self.head {
            s.push_str(&h.choices.join("|"));
        }
        for k in self.keys {
            let item = format!("{}={}", k.key, k.value);
            let sep = if s.is_empty() { "" } else { "," };
            match k.required {
                true => s.push_str(&format!("{sep}{item}")),
                false => s.push_str(&format!("[{sep}{item}]")),
            }
        }
        s
    }

    /// The help text clap shows: the sentence, the syntax, then one line per key.
    pub fn help(&self) -> String {
        let mut s = format!("{}\n{}", self.about, self.syntax());
        for k in self.keys {
            let also = match k.aliases {
                [] => String::new(),
                a => format!(" (also {})", a.join(", ")),
            };
            s.push_str(&format!("\n  {}={}{also}: {}", k.key, k.value, k.help));
        }
        s
    }

    /// `expected` for a bad value of `key`: its syntax from the table.
    pub fn bad(&self, key: &'static str, value: &str, expected: impl Into<String>) -> OptError {
        OptError::BadValue {
            opt: self.flag,
            key,
            value: value.into(),
            expected: expected.into(),
        }
    }

    /// A whole value that is only a head, commas and all (`--serial file:/a,b`): the choice it
    /// matches and what the choice's placeholder stands for.
    pub fn parse_whole<'a>(&self, s: &'a str) -> Result<(&'static str, &'a str), OptError> {
        self.head
            .as_ref()
            .and_then(|h| h.matches(s))
            .ok_or_else(|| self.bad_head(s))
    }

    fn bad_head(&self, value: &str) -> OptError {
        OptError::BadHead {
            opt: self.flag,
            value: value.into(),
            choices: self
                .head
                .map_or_else(String::new, |h| h.choices.join(" or ")),
        }
    }

    /// Splits `s` by the table: the head (if the option has one), then each `KEY=VALUE` with its
    /// key in canonical spelling. Empty items are skipped; an unknown, repeated or missing
    /// required key is refused. Never panics, whatever the input.
    pub fn parse<'a>(&self, s: &'a str) -> Result<Parsed<'a>, OptError> {
        let mut items = s.split(',');
        let head = match &self.head {
            None => None,
            Some(h) => {
                let first = items.by_ref().find(|p| !p.is_empty()).unwrap_or_default();
                if h.matches(first).is_none() {
                    return Err(self.bad_head(first));
                }
                Some(first)
            }
        };
        let mut pairs: Vec<(&'static str, String)> = Vec::new();
        let mut in_list = false;
        for item in items.filter(|p| !p.is_empty()) {
            let Some((k, v)) = item.split_once('=') else {
                if in_list {
                    if let Some((_, v)) = pairs.last_mut() {
                        v.push(',');
                        v.push_str(item);
                        continue;
                    }
                }
                return Err(OptError::NotKeyValue {
                    opt: self.flag,
                    input: s.into(),
                    pair: item.into(),
                });
            };
            let Some(key) = self
                .keys
                .iter()
                .find(|d| d.key == k || d.aliases.contains(&k))
            else {
                return Err(OptError::UnknownKey {
                    opt: self.flag,
                    key: k.into(),
                    known: self.known(),
                });
            };
            if pairs.iter().any(|(p, _)| *p == key.key) {
                return Err(OptError::Duplicate {
                    opt: self.flag,
                    key: key.key,
                });
            }
            in_list = key.list;
            pairs.push((key.key, v.to_string()));
        }
        if let Some(k) = self
            .keys
            .iter()
            .find(|k| k.required && !pairs.iter().any(|(p, _)| *p == k.key))
        {
            return Err(OptError::Missing {
                opt: self.flag,
                input: s.into(),
                what: format!("{}={}", k.key, k.value),
            });
        }
        Ok(Parsed { head, pairs })
    }
}

/// An option string split by its table.
#[derive(Debug)]
pub struct Parsed<'a> {
    /// The head, when the option has one.
    pub head: Option<&'a str>,
    /// Each given key (canonical spelling) with its value, in the order given.
    pub pairs: Vec<(&'static str, String)>,
}

impl Parsed<'_> {
    /// The value of `key`, if given.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// `on`/`off` and their usual synonyms.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "on" | "true" | "1" | "yes" => Some(true),
        "off" | "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: OptSpec = OptSpec {
        flag: "--x",
        about: "An x.",
        head: Some(OptHead {
            name: "MODEL",
            choices: &["a", "b"],
        }),
        keys: &[
            OptKey::new("path", "FILE", "the file")
                .required()
                .aliases(&["file"]),
            OptKey::new("cpus", "LIST", "CPUs").list(),
            OptKey::new("ro", "on|off", "read-only"),
        ],
    };

    #[test]
    fn parses_by_the_table() {
        let p = SPEC.parse("a,file=/x,cpus=0,2-3,ro=on").unwrap();
        assert_eq!(p.head, Some("a"));
        assert_eq!(p.get("path"), Some("/x"));
        assert_eq!(p.get("cpus"), Some("0,2-3"));
        assert_eq!(p.get("ro"), Some("on"));
        for (bad, what) in [
            ("c,path=x", "head"),
            ("a", "missing"),
            ("a,path=x,path=y", "twice"),
            ("a,path=x,colour=red", "unknown"),
            ("a,path=x,ro", "not key=value"),
        ] {
            assert!(SPEC.parse(bad).is_err(), "{what}");
        }
        let e = SPEC.parse("a,path=x,colour=red").unwrap_err().to_string();
        assert_eq!(
            e,
            "--x: unknown option \"colour\" (options: path, cpus, ro)"
        );
    }

    #[test]
    fn placeholders_in_the_head() {
        let h = OptHead {
            name: "OUT",
            choices: &["stdio", "file:PATH", "NAME"],
        };
        assert_eq!(h.matches("stdio"), Some(("stdio", "")));
        assert_eq!(h.matches("file:/a,b"), Some(("file:PATH", "/a,b")));
        assert_eq!(h.matches("file:"), Some(("NAME", "file:")));
        assert_eq!(h.matches("io"), Some(("NAME", "io")));
        assert_eq!(h.matches(""), None);
        let lit = OptHead {
            name: "M",
            choices: &["vtd"],
        };
        assert_eq!(lit.matches("VTD"), None);
    }

    #[test]
    fn help_comes_from_the_table() {
        assert_eq!(SPEC.syntax(), "a|b,path=FILE[,cpus=LIST][,ro=on|off]");
        let h = SPEC.help();
        assert!(h.starts_with("An x.\na|b,path=FILE"), "{h}");
        assert!(h.contains("\n  path=FILE (also file): the file"), "{h}");
    }
}
