//! Pipeline text: `name`, `name{key=value,key=[a,b]}`, comma-separated.
//!
//! ```text
//! pipeline := pass (',' pass)*
//! pass     := NAME ('{' option (',' option)* '}')?
//! option   := NAME '=' value
//! value    := WORD | '[' (WORD (',' WORD)*)? ']'
//! ```
//! `NAME` is a run of letters, digits, `_` and `-` (registered names are lowercase ASCII); a
//! `WORD` is any run of characters other than `,{}[]=` and whitespace.
//! Whitespace around tokens is ignored. A pipeline prints back to canonical text (passes in
//! order; per pass only the options that were set, in declaration order); parsing canonical
//! text gives the same pipeline.

use std::fmt;

use rlx_ir::Graph;

pub use crate::error::ParseError;
use crate::error::{closest, Error};
use crate::manifest::Manifest;
use crate::pass::{lookup, registered, OptionValue, Options, Pass, PassKind, RawValue};
use crate::rewrite::Rewrite;

/// One pass of a pipeline with its options.
#[derive(Clone)]
pub struct PassInstance {
    /// The registered pass.
    pub pass: &'static dyn Pass,
    /// Options set explicitly, in declaration order (what the canonical text prints).
    pub set: Vec<(&'static str, OptionValue)>,
    /// All options, defaults filled in.
    pub options: Options,
}

impl fmt::Debug for PassInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl PartialEq for PassInstance {
    fn eq(&self, other: &Self) -> bool {
        self.pass.name() == other.pass.name() && self.set == other.set
    }
}

impl fmt::Display for PassInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.pass.name())?;
        if !self.set.is_empty() {
            let opts: Vec<String> = self.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
            write!(f, "{{{}}}", opts.join(","))?;
        }
        Ok(())
    }
}

/// A typed pipeline of passes.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Pipeline {
    /// Passes in the order they run.
    pub passes: Vec<PassInstance>,
}

impl fmt::Display for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.passes.iter().map(|p| p.to_string()).collect();
        f.write_str(&parts.join(","))
    }
}

impl std::str::FromStr for Pipeline {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Pipeline::parse(s)
    }
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, offset: usize, message: impl Into<String>) -> ParseError {
        ParseError {
            text: self.text.to_string(),
            offset,
            message: message.into(),
            known: Vec::new(),
            known_what: String::new(),
        }
    }

    fn skip_ws(&mut self) {
        while let Some(c) = self.text[self.pos..].chars().next() {
            if c.is_whitespace() {
                self.pos += c.len_utf8();
            } else {
                break;
            }
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.text[self.pos..].chars().next()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }

    /// A name: letters (any script, so that a typo is shown whole), digits, `_`, `-`.
    fn name(&mut self, what: &str) -> Result<(usize, &'a str), ParseError> {
        self.skip_ws();
        let start = self.pos;
        let rest = &self.text[start..];
        let len = rest
            .char_indices()
            .find(|(_, c)| !(c.is_alphanumeric() || *c == '_' || *c == '-'))
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        if len == 0 {
            let found = rest.chars().next().map(|c| format!("'{c}'")).unwrap_or("the end".into());
            return Err(self.err(start, format!("expected {what}, found {found}")));
        }
        self.pos += len;
        Ok((start, &rest[..len]))
    }

    fn word(&mut self) -> Result<(usize, String), ParseError> {
        self.skip_ws();
        let start = self.pos;
        let rest = &self.text[start..];
        let len = rest
            .char_indices()
            .find(|(_, c)| ",{}[]=".contains(*c) || c.is_whitespace())
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        if len == 0 {
            let found = rest.chars().next().map(|c| format!("'{c}'")).unwrap_or("the end".into());
            return Err(self.err(start, format!("expected a value, found {found}")));
        }
        self.pos += len;
        Ok((start, rest[..len].to_string()))
    }

    fn value(&mut self) -> Result<(usize, RawValue), ParseError> {
        let start = {
            self.skip_ws();
            self.pos
        };
        if self.eat('[') {
            let mut items = Vec::new();
            if self.eat(']') {
                return Ok((start, RawValue::List(items)));
            }
            loop {
                items.push(self.word()?.1);
                if self.eat(']') {
                    break;
                }
                if !self.eat(',') {
                    let at = self.pos;
                    return Err(self.err(at, "expected ',' or ']' in a list"));
                }
            }
            Ok((start, RawValue::List(items)))
        } else {
            let (at, w) = self.word()?;
            Ok((at, RawValue::Scalar(w)))
        }
    }

    fn pass(&mut self) -> Result<PassInstance, ParseError> {
        let (at, name) = self.name("a pass name")?;
        let pass = lookup(name).ok_or_else(|| {
            let names: Vec<&str> = registered().iter().map(|p| p.name()).collect();
            let mut e = self.err(at, format!("unknown pass '{name}'"));
            e.known = closest(name, names).into_iter().map(String::from).collect();
            e.known_what = "passes".into();
            e
        })?;
        let specs = pass.options();
        let mut set: Vec<(&'static str, OptionValue)> = Vec::new();
        if self.eat('{') && !self.eat('}') {
            loop {
                let (kat, key) = self.name("an option name")?;
                let spec = specs.iter().find(|s| s.name == key).ok_or_else(|| {
                    let mut e = self.err(kat, format!("unknown option '{key}' of pass '{}'", pass.name()));
                    e.known = closest(key, specs.iter().map(|s| s.name))
                        .into_iter()
                        .map(String::from)
                        .collect();
                    e.known_what = format!("options of {}", pass.name());
                    e
                })?;
                if set.iter().any(|(k, _)| *k == spec.name) {
                    return Err(self.err(kat, format!("option '{key}' is set twice")));
                }
                if !self.eat('=') {
                    let at = self.pos;
                    return Err(self.err(at, format!("expected '=' after option '{key}'")));
                }
                let (vat, raw) = self.value()?;
                let value = spec.parse_value(&raw).map_err(|m| {
                    self.err(vat, format!("bad value for option '{key}' of pass '{}': {m}", pass.name()))
                })?;
                set.push((spec.name, value));
                if self.eat('}') {
                    break;
                }
                if !self.eat(',') {
                    let at = self.pos;
                    return Err(self.err(at, "expected ',' or '}' after an option"));
                }
            }
        }
        set.sort_by_key(|(k, _)| specs.iter().position(|s| s.name == *k));
        let options = Options::resolve(specs, &set);
        Ok(PassInstance { pass, set, options })
    }
}

impl Pipeline {
    /// Parse pipeline text. Errors name the problem, its column, and what is known there
    /// (closest first).
    pub fn parse(text: &str) -> Result<Pipeline, ParseError> {
        let mut p = Parser { text, pos: 0 };
        let mut passes = Vec::new();
        if p.peek().is_none() {
            let mut e = p.err(0, "empty pipeline");
            e.known = registered().iter().map(|p| p.name().to_string()).collect();
            e.known_what = "passes".into();
            return Err(e);
        }
        let mut first_tap: Option<&'static str> = None;
        loop {
            let at = {
                p.skip_ws();
                p.pos
            };
            let pass = p.pass()?;
            match pass.pass.kind() {
                PassKind::Tap => {
                    first_tap.get_or_insert(pass.pass.name());
                }
                PassKind::Setting => {}
                PassKind::Actuation => {
                    if let Some(tap) = first_tap {
                        // A tap observes the program that runs; a tap placed before an actuation
                        // would observe (and keep alive) what the actuation changes or removes.
                        return Err(p.err(
                            at,
                            format!(
                                "actuation '{}' comes after tap '{tap}': put actuations first, so that taps observe the changed program (e.g. skip{{blocks=[2]}},residual)",
                                pass.pass.name()
                            ),
                        ));
                    }
                }
            }
            passes.push(pass);
            match p.peek() {
                None => break,
                Some(',') => {
                    p.pos += 1;
                }
                Some(c) => {
                    let at = p.pos;
                    return Err(p.err(at, format!("expected ',' or the end, found '{c}'")));
                }
            }
        }
        Ok(Pipeline { passes })
    }

    /// The pass instances, in order.
    pub fn instances(&self) -> &[PassInstance] {
        &self.passes
    }

    /// True if the pipeline holds at least one tap (an actuation alone records nothing).
    pub fn has_tap(&self) -> bool {
        self.passes.iter().any(|p| p.pass.kind() == PassKind::Tap)
    }

    /// The tap instances that found no site in the graph `manifest` describes, as
    /// `(position, canonical text, what the pass looks for)`.
    pub fn idle_taps(&self, manifest: &Manifest) -> Vec<(usize, String, &'static str)> {
        self.passes
            .iter()
            .enumerate()
            .filter(|(i, p)| p.pass.kind() == PassKind::Tap && !manifest.sites.iter().any(|s| s.pass_idx == *i))
            .map(|(i, p)| (i, p.to_string(), p.pass.doc()))
            .collect()
    }

    /// The tap instances that found no site in any of the graphs `manifests` describe, each with
    /// the warning to print (position, text, what the pass looks for); empty when no tap found a
    /// site at all (that is said as "nothing to record") or no graph was compiled.
    pub fn idle_taps_warnings(&self, manifests: &[std::sync::Arc<Manifest>]) -> Vec<String> {
        let found = |i: usize| manifests.iter().any(|m| m.sites.iter().any(|s| s.pass_idx == i));
        let taps: Vec<usize> = (0..self.passes.len()).filter(|&i| self.passes[i].pass.kind() == PassKind::Tap).collect();
        if manifests.is_empty() || !taps.iter().any(|&i| found(i)) {
            return Vec::new();
        }
        taps.into_iter()
            .filter(|&i| !found(i))
            .map(|i| {
                let p = &self.passes[i];
                format!(
                    "the tap '{p}' (pass {i}) found no site in the {} graph(s) compiled, so it recorded nothing (it looks \
                     for: {}); check its sites=[..] patterns against the site names the other taps recorded",
                    manifests.len(),
                    p.pass.doc()
                )
            })
            .collect()
    }

    /// Every warning of a pass that did nothing in the graphs `manifests` describe (the compiles
    /// of a scope or of the environment mode): the idle taps ([`Pipeline::idle_taps_warnings`])
    /// and the idle actuations ([`Pipeline::idle_actuations`]); empty without a compile.
    pub fn idle_warnings(&self, manifests: &[std::sync::Arc<Manifest>]) -> Vec<String> {
        if manifests.is_empty() {
            return Vec::new();
        }
        let mut w = self.idle_taps_warnings(manifests);
        w.extend(self.idle_actuations(manifests).iter().map(|idle| self.idle_actuation_warning(idle, manifests.len())));
        w
    }

    /// The actuation instances that changed no site in any of the graphs `manifests` describe
    /// (the model ran unchanged by them), each as `(position, canonical text, the distinct
    /// reasons it gave for the sites it skipped)`; no reason when it found no site at all. An
    /// instance given an empty list (`skip{blocks=[]}`, `fakequant{sites=[]}`) asked for no
    /// change (a reference run through the same compile path) and is not listed.
    pub fn idle_actuations(&self, manifests: &[std::sync::Arc<Manifest>]) -> Vec<(usize, String, Vec<String>)> {
        let asked_for_nothing = |p: &PassInstance| p.set.iter().any(|(_, v)| matches!(v, OptionValue::List(l) if l.is_empty()));
        self.passes
            .iter()
            .enumerate()
            .filter(|(_, p)| !asked_for_nothing(p))
            .filter(|(i, p)| p.pass.kind() == PassKind::Actuation && !manifests.iter().any(|m| m.actuations.iter().any(|a| a.pass_idx == *i)))
            .map(|(i, p)| {
                let mut reasons: Vec<String> = Vec::new();
                for s in manifests.iter().flat_map(|m| &m.skipped).filter(|s| s.pass_idx == Some(i)) {
                    if !reasons.contains(&s.reason) {
                        reasons.push(s.reason.clone());
                    }
                }
                (i, p.to_string(), reasons)
            })
            .collect()
    }

    /// The warning for an actuation that changed no site ([`Pipeline::idle_actuations`]), in
    /// the `compiles` graphs compiled with this pipeline.
    pub fn idle_actuation_warning(&self, (i, text, reasons): &(usize, String, Vec<String>), compiles: usize) -> String {
        let why = match reasons.len() {
            0 => format!("it found no site (it looks for: {})", self.passes[*i].pass.doc()),
            1 => format!("every site it found was left unchanged: {}", reasons[0]),
            n => format!("every site it found was left unchanged ({n} reasons): {}", reasons.iter().take(3).cloned().collect::<Vec<_>>().join("; ")),
        };
        format!("the actuation '{text}' (pass {i}) changed nothing in the {compiles} graph(s) compiled, so the model ran unchanged by it: {why}")
    }

    /// True if the pipeline holds no pass.
    pub fn is_empty(&self) -> bool {
        self.passes.is_empty()
    }

    /// Rewrite `graph` with every pass in order. Returns the rewritten graph and the manifest
    /// of what was appended (site, role, stat layout per appended output) and what was skipped.
    ///
    /// The graph's own outputs keep their count, order and node ids; tap outputs follow them.
    /// The manifest's compile tag is 0, which a [`crate::record::Recorder`] refuses (it could not tell
    /// this graph's outputs from another's): to record, use [`Pipeline::apply_tagged`] with a
    /// tag from [`crate::record::Recorder::next_tag`], or let a scope or the environment mode compile.
    ///
    /// Errors: [`Error::Graph`] when a pass's options do not fit each other or the graph (a
    /// `skip` block that does not exist, `sites=[..]` selecting one part of an op RLX's fusion
    /// merged, `sparseattn` without `topk` or `window`, a `capture` budget it cannot read, a
    /// `lowrank` energy no rank reaches) or two `sample` entries disagree; [`Error::Table`] when
    /// `staticquant`'s calibration table is unreadable or lacks a site. Each message names the
    /// fix.
    pub fn apply(&self, graph: &Graph) -> Result<(Graph, Manifest), Error> {
        self.apply_tagged(graph, None, 0)
    }

    /// [`Pipeline::apply`] on `graph`, the fused form of `source` when given (site names are
    /// then recovered from `source`), with a compile tag written as the first value of every
    /// sketch, so that a recorder receiving outputs can tell which compiled graph produced them.
    ///
    /// Errors: as [`Pipeline::apply`].
    pub fn apply_tagged(&self, graph: &Graph, source: Option<&Graph>, tag: u32) -> Result<(Graph, Manifest), Error> {
        self.apply_on(graph, source, tag, rlx_runtime::Device::Cpu)
    }

    /// [`Pipeline::apply_tagged`] for a compile on `device`: where the device has no native
    /// sketch kernel ([`crate::sketch::lower::native_kernel`]: every device but the CPU), tensor
    /// and probe sketches are lowered into RLX primitive ops; statistics (or whole probes) with
    /// no lowering are listed in the manifest's `skipped` with the reason.
    ///
    /// Errors: as [`Pipeline::apply`].
    pub fn apply_on(
        &self,
        graph: &Graph,
        source: Option<&Graph>,
        tag: u32,
        device: rlx_runtime::Device,
    ) -> Result<(Graph, Manifest), Error> {
        let (g, m, _) = self.apply_mapped(graph, source, tag, device)?;
        Ok((g, m))
    }

    /// [`Pipeline::apply_on`], also returning where each node of `graph` is in the rewritten
    /// graph (entry `i`: the new id of node `i`; `None` when an actuation removed it as dead).
    ///
    /// Errors: as [`Pipeline::apply`].
    pub fn apply_mapped(
        &self,
        graph: &Graph,
        source: Option<&Graph>,
        tag: u32,
        device: rlx_runtime::Device,
    ) -> Result<(Graph, Manifest, Vec<Option<rlx_ir::NodeId>>), Error> {
        self.apply_owned(graph.clone(), source, tag, device)
    }

    /// [`Pipeline::apply_mapped`] rewriting `graph` itself instead of a copy (a compile's
    /// fused graph, which nothing else needs).
    pub(crate) fn apply_owned(
        &self,
        graph: Graph,
        source: Option<&Graph>,
        tag: u32,
        device: rlx_runtime::Device,
    ) -> Result<(Graph, Manifest, Vec<Option<rlx_ir::NodeId>>), Error> {
        crate::sketch::register_kernels();
        let mut rw = Rewrite::new_owned(graph, source, self.to_string(), tag);
        rw.set_native_kernel(crate::sketch::lower::native_kernel(device));
        for (i, p) in self.passes.iter().enumerate() {
            rw.begin_pass(i, p.pass.name());
            p.pass.run(&p.options, &mut rw)?;
        }
        rw.apply_sampling()?;
        Ok(rw.finish_mapped())
    }
}
