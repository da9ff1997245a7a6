//! The pass trait, typed pass options, and the `inventory` registry of passes.
//!
//! A pass is a short type implementing [`Pass`] in its own file under `passes/`, registered at
//! the bottom of that file with `inventory::submit! { PassRegistration(&MyPass) }`. Nothing
//! outside `passes/` names a concrete pass: the pipeline finds passes by name here.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::Error;
use crate::rewrite::Rewrite;

/// What a pass does to the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PassKind {
    /// Observes: appends sketch outputs, leaves the caller's outputs bit-identical.
    Tap,
    /// Changes the model on purpose (fake-quant, layer skip) to measure a decision.
    Actuation,
}

impl fmt::Display for PassKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PassKind::Tap => "tap",
            PassKind::Actuation => "actuation",
        })
    }
}

/// The type of an option's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptionType {
    /// `true` / `false`.
    Bool,
    /// An unsigned integer in `[min, max]`.
    UInt {
        /// Smallest accepted value.
        min: u64,
        /// Largest accepted value.
        max: u64,
    },
    /// One of a fixed set of words.
    Enum(&'static [&'static str]),
    /// A bracketed list `[a,b,c]` whose items are each one of a fixed set of words.
    ListOf(&'static [&'static str]),
    /// A bracketed list of glob patterns (`*` any run, `?` one character), or one pattern.
    Globs,
    /// A histogram range: `absmax`, or `LO:HI` with LO < HI finite floats.
    Range,
    /// A finite float in `[min, max]`.
    Float {
        /// Smallest accepted value.
        min: f32,
        /// Largest accepted value.
        max: f32,
    },
    /// A bracketed list of distinct unsigned integers `[3,5]` (or one integer), each `<= max`.
    UIntList {
        /// Largest accepted item.
        max: u64,
    },
}

impl OptionType {
    /// Human description used in `opscope passes` and in error messages.
    pub fn describe(&self) -> String {
        match self {
            OptionType::Bool => "bool".into(),
            OptionType::UInt { min, max } => format!("integer {min}..={max}"),
            OptionType::Enum(words) => format!("one of {}", words.join("|")),
            OptionType::ListOf(words) => format!("list of {}", words.join("|")),
            OptionType::Globs => "list of glob patterns".into(),
            OptionType::Range => "absmax or LO:HI".into(),
            OptionType::Float { min, max } => format!("number {min}..={max}"),
            OptionType::UIntList { max } => format!("list of distinct integers 0..={max}"),
        }
    }
}

/// A pass option's declaration: name, type, default (as pipeline text) and one line of doc.
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    /// Option name as written in a pipeline (`hist_bins`).
    pub name: &'static str,
    /// Value type.
    pub ty: OptionType,
    /// Default, written as it would be in a pipeline (parsed with the same code).
    pub default: &'static str,
    /// One line of documentation.
    pub doc: &'static str,
}

/// A parsed, validated option value.
#[derive(Debug, Clone, PartialEq)]
pub enum OptionValue {
    /// `true` / `false`.
    Bool(bool),
    /// An unsigned integer.
    UInt(u64),
    /// One word of an enum.
    Word(String),
    /// A list of words or patterns.
    List(Vec<String>),
    /// `absmax`.
    Absmax,
    /// `LO:HI`.
    Range(f32, f32),
    /// A float.
    Float(f32),
    /// A list of unsigned integers, in the order written.
    UIntList(Vec<u64>),
}

impl fmt::Display for OptionValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OptionValue::Bool(b) => write!(f, "{b}"),
            OptionValue::UInt(n) => write!(f, "{n}"),
            OptionValue::Word(w) => f.write_str(w),
            OptionValue::List(items) => write!(f, "[{}]", items.join(",")),
            OptionValue::Absmax => f.write_str("absmax"),
            OptionValue::Range(lo, hi) => write!(f, "{}:{}", short(*lo), short(*hi)),
            OptionValue::Float(x) => f.write_str(&short(*x)),
            OptionValue::UIntList(items) => {
                let t: Vec<String> = items.iter().map(|n| n.to_string()).collect();
                write!(f, "[{}]", t.join(","))
            }
        }
    }
}

/// The shortest text that parses back to `x`: plain decimals in [1e-4, 1e7), else exponent form.
fn short(x: f32) -> String {
    if x == 0.0 || (1e-4..1e7).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// Raw text of a value as the pipeline parser saw it.
#[derive(Debug, Clone, PartialEq)]
pub enum RawValue {
    /// `key=word`.
    Scalar(String),
    /// `key=[a,b]`.
    List(Vec<String>),
}

impl OptionSpec {
    /// Parse and validate a raw value against this declaration. The error text says what was
    /// expected; the pipeline parser adds where.
    pub fn parse_value(&self, raw: &RawValue) -> Result<OptionValue, String> {
        let expected = || format!("expected {}", self.ty.describe());
        match (&self.ty, raw) {
            (OptionType::Bool, RawValue::Scalar(s)) => match s.as_str() {
                "true" => Ok(OptionValue::Bool(true)),
                "false" => Ok(OptionValue::Bool(false)),
                _ => Err(format!("'{s}': {}", expected())),
            },
            (OptionType::UInt { min, max }, RawValue::Scalar(s)) => match s.parse::<u64>() {
                Ok(n) if n >= *min && n <= *max => Ok(OptionValue::UInt(n)),
                _ => Err(format!("'{s}': {}", expected())),
            },
            (OptionType::Enum(words), RawValue::Scalar(s)) => {
                if words.contains(&s.as_str()) {
                    Ok(OptionValue::Word(s.clone()))
                } else {
                    Err(format!("'{s}': {}", expected()))
                }
            }
            (OptionType::ListOf(words), raw) => {
                let items = match raw {
                    RawValue::List(items) => items.clone(),
                    RawValue::Scalar(s) => vec![s.clone()],
                };
                if let Some(dup) = items.iter().enumerate().find(|(i, it)| items[..*i].contains(it)) {
                    return Err(format!("'{}' is listed twice", dup.1));
                }
                for it in &items {
                    if !words.contains(&it.as_str()) {
                        let near = crate::error::closest(it, words.iter().copied());
                        return Err(format!("'{it}' is not one of [{}]", near.join(",")));
                    }
                }
                Ok(OptionValue::List(items))
            }
            (OptionType::Globs, raw) => {
                let items = match raw {
                    RawValue::List(items) => items.clone(),
                    RawValue::Scalar(s) => vec![s.clone()],
                };
                for it in &items {
                    glob::Pattern::new(it).map_err(|e| format!("'{it}': bad glob pattern: {e}"))?;
                }
                Ok(OptionValue::List(items))
            }
            (OptionType::Range, RawValue::Scalar(s)) => {
                if s == "absmax" {
                    return Ok(OptionValue::Absmax);
                }
                let parsed = s.split_once(':').and_then(|(a, b)| {
                    Some((a.trim().parse::<f32>().ok()?, b.trim().parse::<f32>().ok()?))
                });
                match parsed {
                    Some((lo, hi)) if lo.is_finite() && hi.is_finite() && lo < hi => {
                        Ok(OptionValue::Range(lo, hi))
                    }
                    _ => Err(format!("'{s}': {} (LO < HI, both finite)", expected())),
                }
            }
            (OptionType::Float { min, max }, RawValue::Scalar(s)) => match s.trim().parse::<f32>() {
                Ok(x) if x.is_finite() && x >= *min && x <= *max => Ok(OptionValue::Float(x)),
                _ => Err(format!("'{s}': {}", expected())),
            },
            (OptionType::UIntList { max }, raw) => {
                let items = match raw {
                    RawValue::List(items) => items.clone(),
                    RawValue::Scalar(s) => vec![s.clone()],
                };
                let mut out: Vec<u64> = Vec::with_capacity(items.len());
                for it in &items {
                    match it.trim().parse::<u64>() {
                        Ok(n) if n <= *max => {
                            if out.contains(&n) {
                                return Err(format!("'{n}' is listed twice"));
                            }
                            out.push(n);
                        }
                        _ => return Err(format!("'{it}': {}", expected())),
                    }
                }
                Ok(OptionValue::UIntList(out))
            }
            (_, RawValue::List(_)) => Err(format!("a list is not allowed here: {}", expected())),
        }
    }

    /// The parsed default. Panics only if a pass declares an invalid default, which the
    /// registry test (`every_default_parses`) rules out.
    pub fn default_value(&self) -> OptionValue {
        let raw = if self.default.starts_with('[') {
            RawValue::List(crate::pipeline::split_list(self.default))
        } else {
            RawValue::Scalar(self.default.to_string())
        };
        self.parse_value(&raw)
            .unwrap_or_else(|e| panic!("option '{}' has an invalid default: {e}", self.name))
    }
}

/// The resolved options of one pass instance: every declared option has a value.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    values: BTreeMap<&'static str, OptionValue>,
}

impl Options {
    /// Defaults overlaid with `set`.
    pub fn resolve(specs: &[OptionSpec], set: &[(&'static str, OptionValue)]) -> Options {
        let mut values: BTreeMap<&'static str, OptionValue> =
            specs.iter().map(|s| (s.name, s.default_value())).collect();
        for (k, v) in set {
            values.insert(k, v.clone());
        }
        Options { values }
    }

    fn get(&self, name: &str) -> Result<&OptionValue, Error> {
        self.values
            .get(name)
            .ok_or_else(|| Error::Internal(format!("option '{name}' is not declared")))
    }

    /// An unsigned option.
    pub fn uint(&self, name: &str) -> Result<u64, Error> {
        match self.get(name)? {
            OptionValue::UInt(n) => Ok(*n),
            v => Err(Error::Internal(format!("option '{name}' is {v:?}, not an integer"))),
        }
    }

    /// A boolean option.
    pub fn bool(&self, name: &str) -> Result<bool, Error> {
        match self.get(name)? {
            OptionValue::Bool(b) => Ok(*b),
            v => Err(Error::Internal(format!("option '{name}' is {v:?}, not a bool"))),
        }
    }

    /// A float option.
    pub fn float(&self, name: &str) -> Result<f32, Error> {
        match self.get(name)? {
            OptionValue::Float(x) => Ok(*x),
            v => Err(Error::Internal(format!("option '{name}' is {v:?}, not a number"))),
        }
    }

    /// An integer-list option.
    pub fn uint_list(&self, name: &str) -> Result<&[u64], Error> {
        match self.get(name)? {
            OptionValue::UIntList(items) => Ok(items),
            v => Err(Error::Internal(format!("option '{name}' is {v:?}, not an integer list"))),
        }
    }

    /// A word (enum) option.
    pub fn word(&self, name: &str) -> Result<&str, Error> {
        match self.get(name)? {
            OptionValue::Word(w) => Ok(w),
            v => Err(Error::Internal(format!("option '{name}' is {v:?}, not a word"))),
        }
    }

    /// A glob-list option, compiled (the values were checked when the pipeline was parsed).
    pub fn globs(&self, name: &str) -> Result<Vec<glob::Pattern>, Error> {
        self.list(name)?
            .iter()
            .map(|p| glob::Pattern::new(p).map_err(|e| Error::Internal(format!("option '{name}': {e}"))))
            .collect()
    }

    /// A statistics-list option: `all` means `all`, else each named statistic.
    pub fn stats(&self, name: &str, all: &[crate::sketch::Stat]) -> Result<Vec<crate::sketch::Stat>, Error> {
        let words = self.list(name)?;
        Ok(if words.iter().any(|w| w == "all") {
            all.to_vec()
        } else {
            words.iter().filter_map(|w| crate::sketch::Stat::parse(w)).collect()
        })
    }

    /// A list option.
    pub fn list(&self, name: &str) -> Result<&[String], Error> {
        match self.get(name)? {
            OptionValue::List(items) => Ok(items),
            v => Err(Error::Internal(format!("option '{name}' is {v:?}, not a list"))),
        }
    }

    /// A value of any type.
    pub fn value(&self, name: &str) -> Result<&OptionValue, Error> {
        self.get(name)
    }
}

/// An opscope pass: a name, a kind, typed options, and a rewrite of an RLX graph.
pub trait Pass: Sync {
    /// Registered name, used in pipelines (`matmul`).
    fn name(&self) -> &'static str;
    /// Tap or actuation.
    fn kind(&self) -> PassKind;
    /// One line of documentation.
    fn doc(&self) -> &'static str;
    /// Declared options.
    fn options(&self) -> &'static [OptionSpec];
    /// Rewrite the graph held by `rw`, appending taps through [`Rewrite::tap`] (tap passes)
    /// or rewriting nodes (actuation passes).
    ///
    /// Errors: only for internal inconsistencies; a site that cannot be handled is recorded
    /// with [`Rewrite::skip`] and the pass goes on.
    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error>;
}

/// An entry in the pass registry (`inventory::submit! { PassRegistration(&MyPass) }`).
pub struct PassRegistration(pub &'static dyn Pass);

inventory::collect!(PassRegistration);

/// Every registered pass, sorted by name.
pub fn registered() -> Vec<&'static dyn Pass> {
    crate::passes::link();
    let mut v: Vec<&'static dyn Pass> = inventory::iter::<PassRegistration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    v.sort_by_key(|p| p.name());
    v
}

/// Look a pass up by name.
pub fn lookup(name: &str) -> Option<&'static dyn Pass> {
    registered().into_iter().find(|p| p.name() == name)
}
