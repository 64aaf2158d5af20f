//! `lucid bench sym`, part `swapbypass`. LEAD: stand-in; its lane replaces this file.

use super::{Figures, Opts};

pub fn run(opts: &Opts) -> Result<Figures, String> {
    let _ = opts.quick;
    Err("not built yet".into())
}
