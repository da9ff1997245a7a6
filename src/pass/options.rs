//! Pass options: declarations with types, defaults and docs; parsed values; typed keys.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use crate::error::{closest, Error};
use crate::sketch::Stat;

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
    /// A bracketed list of statistic names from a table, or `all` (the whole table).
    Stats(&'static [Stat]),
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
    /// One free word, such as a file path: any text without whitespace or `,{}[]=` (the
    /// pipeline grammar's separators).
    Text,
}

impl OptionType {
    /// Human description used in `opscope passes` and in error messages.
    pub fn describe(&self) -> String {
        match self {
            OptionType::Bool => "bool".into(),
            OptionType::UInt { min, max } => format!("integer {min}..={max}"),
            OptionType::Enum(words) => format!("one of {}", words.join("|")),
            OptionType::ListOf(words) => format!("list of {}", words.join("|")),
            OptionType::Stats(table) => {
                let names: Vec<&str> = std::iter::once("all").chain(table.iter().map(|s| s.as_str())).collect();
                format!("list of {}", names.join("|"))
            }
            OptionType::Globs => "list of glob patterns".into(),
            OptionType::Range => "absmax or LO:HI".into(),
            OptionType::Float { min, max } => format!("number {min}..={max}"),
            OptionType::UIntList { max } => format!("list of distinct integers 0..={max}"),
            OptionType::Text => "text without whitespace or ,{}[]=".into(),
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
            (OptionType::ListOf(words), raw) => word_list(raw, words.to_vec()),
            (OptionType::Stats(table), raw) => {
                // `count` is recorded with every tensor sketch; naming it selects nothing more.
                let count = (*table == crate::sketch::TAP_STATS).then_some(crate::sketch::tensor::COUNT.as_str());
                word_list(raw, std::iter::once("all").chain(count).chain(table.iter().map(|s| s.as_str())).collect())
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
            (OptionType::Text, RawValue::Scalar(s)) => Ok(OptionValue::Word(s.clone())),
            (_, RawValue::List(_)) => Err(format!("a list is not allowed here: {}", expected())),
        }
    }

    /// The parsed default. Panics only if a pass declares an invalid default, which the
    /// registry test (`every_default_parses`) rules out.
    pub fn default_value(&self) -> OptionValue {
        let raw = if self.default.starts_with('[') {
            RawValue::List(split_list(self.default))
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

    fn raw(&self, name: &str) -> Result<&OptionValue, Error> {
        self.values
            .get(name)
            .ok_or_else(|| Error::Internal(format!("option '{name}' is not declared by this pass")))
    }

    /// The value of a declared option, typed by its key.
    ///
    /// Errors: [`Error::Internal`] if the pass did not declare `key` in
    /// [`Pass::options`](super::Pass::options) (a bug in the pass).
    pub fn get<T: OptionKind>(&self, key: &Opt<T>) -> Result<T::Value, Error> {
        let v = self.raw(key.spec.name)?;
        T::read(v).ok_or_else(|| Error::Internal(format!("option '{}' holds {v:?}, not {}", key.spec.name, key.spec.ty.describe())))
    }

    /// A value of any type, by name (for code that handles options generically).
    ///
    /// Errors: the option is not declared.
    pub fn value(&self, name: &str) -> Result<&OptionValue, Error> {
        self.raw(name)
    }

}


/// A list of distinct items, each one of `allowed` (an unknown item lists the allowed words,
/// closest first).
fn word_list(raw: &RawValue, allowed: Vec<&str>) -> Result<OptionValue, String> {
    let items = match raw {
        RawValue::List(items) => items.clone(),
        RawValue::Scalar(s) => vec![s.clone()],
    };
    if items.is_empty() {
        // `roles=[]` or `stats=[]` would tap nothing and fail only after the model ran.
        return Err(format!("an empty list selects nothing: list at least one of [{}]", allowed.join(",")));
    }
    if let Some(dup) = items.iter().enumerate().find(|(i, it)| items[..*i].contains(it)) {
        return Err(format!("'{}' is listed twice", dup.1));
    }
    for it in &items {
        if !allowed.contains(&it.as_str()) {
            let near = closest(it, allowed.iter().copied());
            return Err(format!("'{it}' is not one of [{}]", near.join(",")));
        }
    }
    Ok(OptionValue::List(items))
}

/// Split `[a,b,c]` (or `a`) into trimmed items; used for option defaults and by the pipeline
/// parser's printer.
pub fn split_list(text: &str) -> Vec<String> {
    let inner = text.trim().trim_start_matches('[').trim_end_matches(']');
    inner
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// How an option's value reads in Rust: the type parameter of a typed key [`Opt`].
pub trait OptionKind {
    /// The Rust value.
    type Value;
    /// Read a validated value; `None` if it is of another type.
    fn read(v: &OptionValue) -> Option<Self::Value>;
}

/// A typed option key: the declaration a pass lists in [`Pass::options`](super::Pass::options)
/// and the type its value reads as through [`Options::get`]. Declare each option once as a
/// `const` and build the pass's option list from the keys' `spec`s, so a name is written once
/// and a misspelt key is a compile error:
///
/// ```
/// use opscope::pass::{Opt, OptionSpec};
/// const TOPK: Opt<u64> = Opt::uint("topk", 1, 65536, "8", "k of topk_mass");
/// const OPTIONS: &[OptionSpec] = &[TOPK.spec];
/// # assert_eq!(OPTIONS[0].name, "topk");
/// ```
pub struct Opt<T> {
    /// The declaration.
    pub spec: OptionSpec,
    _t: PhantomData<fn() -> T>,
}

/// Marker: a one-word option ([`OptionType::Enum`]), read as a `String`.
pub struct Word;
/// Marker: a list of words ([`OptionType::ListOf`]), read as `Vec<String>`.
pub struct Words;
/// Marker: glob patterns ([`OptionType::Globs`]), read compiled as [`SitePatterns`].
pub struct Globs;
/// Marker: statistics ([`OptionType::Stats`]), read as `Vec<Stat>` (`all` expanded).
pub struct Stats;
/// Marker: a histogram range ([`OptionType::Range`]), read as `None` for `absmax` or
/// `Some((lo, hi))`.
pub struct Range;
/// Marker: one free word such as a path ([`OptionType::Text`]), read as a `String`.
pub struct Text;

const fn spec(name: &'static str, ty: OptionType, default: &'static str, doc: &'static str) -> OptionSpec {
    OptionSpec { name, ty, default, doc }
}

impl Opt<bool> {
    /// A `true`/`false` option.
    pub const fn bool(name: &'static str, default: &'static str, doc: &'static str) -> Opt<bool> {
        Opt { spec: spec(name, OptionType::Bool, default, doc), _t: PhantomData }
    }
}
impl Opt<u64> {
    /// An integer in `[min, max]`.
    pub const fn uint(name: &'static str, min: u64, max: u64, default: &'static str, doc: &'static str) -> Opt<u64> {
        Opt { spec: spec(name, OptionType::UInt { min, max }, default, doc), _t: PhantomData }
    }
}
impl Opt<f32> {
    /// A finite number in `[min, max]`.
    pub const fn float(name: &'static str, min: f32, max: f32, default: &'static str, doc: &'static str) -> Opt<f32> {
        Opt { spec: spec(name, OptionType::Float { min, max }, default, doc), _t: PhantomData }
    }
}
impl Opt<Vec<u64>> {
    /// A list of distinct integers `<= max`.
    pub const fn uint_list(name: &'static str, max: u64, default: &'static str, doc: &'static str) -> Opt<Vec<u64>> {
        Opt { spec: spec(name, OptionType::UIntList { max }, default, doc), _t: PhantomData }
    }
}
impl Opt<Word> {
    /// One of `words`.
    pub const fn word(name: &'static str, words: &'static [&'static str], default: &'static str, doc: &'static str) -> Opt<Word> {
        Opt { spec: spec(name, OptionType::Enum(words), default, doc), _t: PhantomData }
    }
}
impl Opt<Words> {
    /// A list of items from `words`.
    pub const fn words(name: &'static str, words: &'static [&'static str], default: &'static str, doc: &'static str) -> Opt<Words> {
        Opt { spec: spec(name, OptionType::ListOf(words), default, doc), _t: PhantomData }
    }
}
impl Opt<Globs> {
    /// Glob patterns.
    pub const fn globs(name: &'static str, default: &'static str, doc: &'static str) -> Opt<Globs> {
        Opt { spec: spec(name, OptionType::Globs, default, doc), _t: PhantomData }
    }
}
impl Opt<Stats> {
    /// Statistic names from `table`, or `all`.
    pub const fn stats(name: &'static str, table: &'static [Stat], default: &'static str, doc: &'static str) -> Opt<Stats> {
        Opt { spec: spec(name, OptionType::Stats(table), default, doc), _t: PhantomData }
    }
}
impl Opt<Text> {
    /// One free word (a path): any text without whitespace or `,{}[]=`.
    pub const fn text(name: &'static str, default: &'static str, doc: &'static str) -> Opt<Text> {
        Opt { spec: spec(name, OptionType::Text, default, doc), _t: PhantomData }
    }
}
impl Opt<Range> {
    /// `absmax` or `LO:HI`.
    pub const fn range(name: &'static str, default: &'static str, doc: &'static str) -> Opt<Range> {
        Opt { spec: spec(name, OptionType::Range, default, doc), _t: PhantomData }
    }
}

/// `OptionKind` for a marker whose value is one `OptionValue` variant, cloned out.
macro_rules! option_kind {
    ($($marker:ty => $value:ty, $variant:ident;)*) => {$(
        impl OptionKind for $marker {
            type Value = $value;
            fn read(v: &OptionValue) -> Option<$value> {
                match v {
                    OptionValue::$variant(x) => Some(x.clone()),
                    _ => None,
                }
            }
        }
    )*};
}

option_kind! {
    bool => bool, Bool;
    u64 => u64, UInt;
    f32 => f32, Float;
    Vec<u64> => Vec<u64>, UIntList;
    Word => String, Word;
    Words => Vec<String>, List;
    Text => String, Word;
}

impl OptionKind for Globs {
    type Value = SitePatterns;
    fn read(v: &OptionValue) -> Option<SitePatterns> {
        match v {
            // Checked when the pipeline was parsed.
            OptionValue::List(items) => {
                let patterns: Option<Vec<glob::Pattern>> = items.iter().map(|p| glob::Pattern::new(p).ok()).collect();
                patterns.map(SitePatterns)
            }
            _ => None,
        }
    }
}

/// Compiled glob patterns over site names (`*` any run, `?` one character). A pattern selects a
/// site when it matches the whole name or the name with leading `/`-separated components
/// removed, so the short names `opscope record` prints (`layer.0/attention/self/query/MatMul`)
/// select the same sites as the full ONNX names.
#[derive(Debug, Clone)]
pub struct SitePatterns(pub Vec<glob::Pattern>);

impl SitePatterns {
    /// True if any pattern selects `site`.
    pub fn matches(&self, site: &str) -> bool {
        let mut suffixes = std::iter::once(site).chain(site.match_indices('/').map(|(i, _)| &site[i + 1..]));
        suffixes.any(|s| self.0.iter().any(|p| p.matches(s)))
    }

    /// For a pass that rewrites a site's op as a whole (an actuation): whether the patterns
    /// select the op whose logical sites are `parts` (one name; or several for an op RLX's
    /// fusion merged, such as the horizontally merged Q/K/V GEMM `x @ [Wq|Wk|Wv]`, named
    /// `q+k+v`). Each part is matched alone ([`Globs::matches`]); a pattern for the merged
    /// name itself (`q+k+v`, as `opscope plan` writes it) selects the op whole.
    ///
    /// Errors: the patterns select some parts of a merged op but not all: rewriting the op
    /// would rewrite the parts not selected too. The message (prefixed by `pass`) names both
    /// and the fixes.
    pub fn selects_op(&self, pass: &str, parts: &[&str]) -> Result<bool, Error> {
        if parts.len() > 1 && self.0.iter().any(|p| Self::names_whole(p.as_str(), parts)) {
            return Ok(true);
        }
        let (hit, miss): (Vec<&str>, Vec<&str>) = parts.iter().partition(|p| self.matches(p));
        match (hit.is_empty(), miss.is_empty()) {
            (true, _) => Ok(false),
            (false, true) => Ok(true),
            (false, false) => Err(Error::Graph(format!(
                "{pass}: sites=[..] selects {} but not {}: RLX's fusion merged them into one op in the deployed program, \
                 so rewriting it would rewrite every part. Select all of them (add the others to sites=[..], or name the \
                 merged site as `opscope plan` prints it, parts joined by '+'), or rewrite the source program, where they \
                 are separate ops (opscope record --stage source; Stage::Source)",
                hit.join(", "),
                miss.join(", ")
            ))),
        }
    }

    /// True if `pattern` names the merged op of `parts` whole: its '+'-separated pieces, in any
    /// order, each select a different part (full or short names, globs allowed), and every part
    /// is selected (`a/q/MatMul+a/k/MatMul+a/v/MatMul`, `*+*+*`).
    fn names_whole(pattern: &str, parts: &[&str]) -> bool {
        let pieces: Vec<SitePatterns> = pattern.split('+').filter_map(|p| glob::Pattern::new(p).ok()).map(|p| SitePatterns(vec![p])).collect();
        if pieces.len() != parts.len() || pattern.split('+').count() != parts.len() {
            return false;
        }
        // A matching of pieces to parts, one to one (n is 3 for Q/K/V: try the permutations).
        fn assign(pieces: &[SitePatterns], parts: &[&str], used: &mut Vec<bool>) -> bool {
            let Some((first, rest)) = pieces.split_first() else { return true };
            for (i, part) in parts.iter().enumerate() {
                if !used[i] && first.matches(part) {
                    used[i] = true;
                    if assign(rest, parts, used) {
                        return true;
                    }
                    used[i] = false;
                }
            }
            false
        }
        assign(&pieces, parts, &mut vec![false; parts.len()])
    }
}
impl OptionKind for Range {
    type Value = Option<(f32, f32)>;
    fn read(v: &OptionValue) -> Option<Option<(f32, f32)>> {
        match v {
            OptionValue::Absmax => Some(None),
            OptionValue::Range(lo, hi) => Some(Some((*lo, *hi))),
            _ => None,
        }
    }
}
/// `Stats` needs its table to expand `all`: read through [`Options::stats`].
impl OptionKind for Stats {
    type Value = Vec<String>;
    fn read(v: &OptionValue) -> Option<Vec<String>> {
        Words::read(v)
    }
}

impl Options {
    /// A statistics option, `all` expanded to its table (in table order; without the opt-in
    /// statistics, [`crate::sketch::OPT_IN`]), else each named
    /// statistic.
    ///
    /// Errors: as [`Options::get`].
    pub fn stats(&self, key: &Opt<Stats>) -> Result<Vec<Stat>, Error> {
        let OptionType::Stats(table) = key.spec.ty else {
            return Err(Error::Internal(format!("option '{}' is not a statistics list", key.spec.name)));
        };
        let words = self.get(key)?;
        Ok(if words.iter().any(|w| w == "all") {
            // `all` leaves the opt-in statistics out (`hash`: selected by name only).
            table.iter().copied().filter(|s| !crate::sketch::OPT_IN.contains(s)).collect()
        } else {
            words.iter().filter_map(|w| table.iter().copied().find(|s| s.as_str() == w)).collect()
        })
    }
}
