//! Statistics: the one table of names, lengths and docs.
//!
//! A [`Stat`] is a handle on a static [`StatDef`]. The tensor statistics every tap can ask
//! the sketch kernel for are the table [`tensor`] below; a probe pass declares its own table
//! next to its kernel with the same [`stats!`](crate::stats) macro and registers it with
//! `inventory::submit! { StatTable(..) }`, so that a recording's `stat` column can be read back
//! into typed statistics ([`Stat::parse`]) by any program that links the pass. Names are the
//! `stat` column of a recording and the words of a pass's `stats=[..]` option; they are unique
//! across every linked table (a test checks it).

use std::cmp::Ordering;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How many values a statistic occupies in a sketch's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatLen {
    /// One value (its row has `idx` 0).
    One,
    /// A vector whose length the spec or probe geometry gives (histogram bins, channels, rows,
    /// heads, experts); its rows carry `idx`.
    Vector,
}

/// The definition of one statistic: name, length kind, position in its table, documentation.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct StatDef {
    /// Name in the `stat` column and in `stats=[..]` options (`chan_maxabs`).
    pub name: &'static str,
    /// Scalar or vector.
    pub len: StatLen,
    /// Position in its table: a sketch lays its statistics out in this order.
    pub order: u16,
    /// Documentation: meaning, shape, unit.
    pub doc: &'static str,
}

/// A statistic (a handle on its static [`StatDef`]). Compared and hashed by definition, ordered
/// by (table position, name); serialized as its name.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stat(pub &'static StatDef);

impl Stat {
    /// The name (`stat` column).
    pub fn as_str(self) -> &'static str {
        self.0.name
    }
    /// The definition.
    pub fn def(self) -> &'static StatDef {
        self.0
    }
    /// True if the statistic is a vector (its rows carry `idx`), false for one value.
    pub fn is_vector(self) -> bool {
        self.0.len == StatLen::Vector
    }
    /// Look a statistic up by name in every linked table ([`StatTable`]); `None` if no linked
    /// table has it.
    pub fn parse(name: &str) -> Option<Stat> {
        tables().find_map(|t| t.0.iter().copied().find(|s| s.as_str() == name))
    }
}

impl PartialOrd for Stat {
    fn partial_cmp(&self, other: &Stat) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Stat {
    fn cmp(&self, other: &Stat) -> Ordering {
        (self.0.order, self.0.name).cmp(&(other.0.order, other.0.name))
    }
}
impl fmt::Debug for Stat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}
impl fmt::Display for Stat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}
impl Serialize for Stat {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.name)
    }
}
impl<'de> Deserialize<'de> for Stat {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Stat, D::Error> {
        let name = String::deserialize(d)?;
        Stat::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown statistic '{name}': no linked pass declares it (link the crate that defines the pass)"
            ))
        })
    }
}

/// A table of statistics, registered with `inventory::submit! { StatTable(&[..]) }`.
pub struct StatTable(pub &'static [Stat]);

inventory::collect!(StatTable);

/// Every linked statistics table (the tensor table first).
pub fn tables() -> impl Iterator<Item = &'static StatTable> {
    std::iter::once(&TENSOR_TABLE).chain(inventory::iter::<StatTable>)
}

static TENSOR_TABLE: StatTable = StatTable(tensor::ALL);

/// Declare a table of statistics: one `const` per statistic and `ALL` in table order.
///
/// ```
/// opscope::stats! {
///     /// Statistics of my probe.
///     pub mod my_stats {
///         /// Tokens seen (1 value).
///         TOKENS_SEEN = "tokens_seen", One;
///         /// Per expert: tokens (`E` values).
///         PER_EXPERT = "per_expert", Vector;
///     }
/// }
/// assert_eq!(my_stats::ALL.len(), 2);
/// assert!(my_stats::TOKENS_SEEN < my_stats::PER_EXPERT);
/// ```
#[macro_export]
macro_rules! stats {
    ($(#[$m:meta])* $vis:vis mod $table:ident { $( $(#[doc = $doc:literal])* $konst:ident = $name:literal, $len:ident; )* }) => {
        $(#[$m])*
        $vis mod $table {
            #[allow(non_camel_case_types, clippy::upper_case_acronyms, dead_code)]
            #[repr(u16)]
            enum Order { $($konst),* }
            $(
                $(#[doc = $doc])*
                pub const $konst: $crate::Stat = $crate::Stat(&$crate::sketch::StatDef {
                    name: $name,
                    len: $crate::sketch::StatLen::$len,
                    order: Order::$konst as u16,
                    doc: concat!($($doc, "\n"),*),
                });
            )*
            /// Every statistic of this table, in layout order.
            pub const ALL: &[$crate::Stat] = &[$($konst),*];
        }
    };
}

crate::stats! {
    /// The tensor statistics of the sketch kernel ([`crate::sketch::SKETCH_OP`]), in layout order.
    ///
    /// Non-finite values are counted in `nan_count`, `posinf_count`, `neginf_count` and
    /// excluded from every other statistic.
    pub mod tensor {
        /// Number of finite elements (1 value). Always present: every other statistic is over it.
        COUNT = "count", One;
        /// Smallest finite value (1 value).
        MIN = "min", One;
        /// Largest finite value (1 value).
        MAX = "max", One;
        /// Mean of the finite values (1 value, units of x). Within 1e-6 relative of the exact
        /// mean, or of mean|x| where it cancels to ~0 (see the kernel module).
        MEAN = "mean", One;
        /// Sum of |x| over finite values (1 value, units of x). Within 1e-6 relative; left out
        /// when above f32's range.
        L1 = "l1", One;
        /// Sum of x^2 over finite values (1 value, units of x^2). Within 1e-6 relative; left out
        /// when f32 cannot hold it (above 3.4e38, or non-zero below 1.2e-38).
        SUMSQ = "sumsq", One;
        /// Number of finite non-zero values (1 value); density = nnz / count.
        NNZ = "nnz", One;
        /// Kurtosis E[(x-mu)^4] / E[(x-mu)^2]^2 over finite values (1 value, no unit, >= 1; 3
        /// for a Gaussian). Two-pass in f64: within 1e-6 relative, scale-invariant; left out
        /// for a constant.
        KURTOSIS = "kurtosis", One;
        /// Value histogram (`hist_bins` values, counts). Range given by `hist_lo` / `hist_hi`;
        /// bins as `numpy.histogram` assigns them (edges `np.linspace(lo, hi, bins + 1)` in
        /// f64, a value on an interior edge in the upper bin, `hi` in the last).
        HIST = "hist", Vector;
        /// Lower edge of the histogram range (1 value).
        HIST_LO = "hist_lo", One;
        /// Upper edge of the histogram range (1 value).
        HIST_HI = "hist_hi", One;
        /// Finite values outside a fixed histogram range (1 value; always 0 for the absmax range).
        HIST_OUTSIDE = "hist_outside", One;
        /// `elemsig_k` elements at evenly spaced flat indices `floor(j * numel / k)` (raw values).
        ELEMSIG = "elemsig", Vector;
        /// max |x| per last-axis channel (`C` values).
        CHAN_MAXABS = "chan_maxabs", Vector;
        /// max(chan_maxabs) / mean(chan_maxabs) (1 value, a unitless ratio; NaN, not recorded,
        /// when every channel's max|x| is 0).
        CHAN_OUTLIER = "chan_outlier", One;
        /// Sum of x^2 per row, all leading axes flattened (`R = numel / C` values, units of
        /// x^2). Each as `sumsq`: within 1e-6 relative, left out where f32 cannot hold it.
        POS_SUMSQ = "pos_sumsq", Vector;
        /// max |x| per row, all leading axes flattened (`R = numel / C` values, units of x):
        /// the per-token absmax that sets a per-token (dynamic, row-wise) int8 scale, as in
        /// LLM.int8()'s vector-wise quantization (Dettmers et al. 2022). Over finite values (0 for a
        /// row of none, as `chan_maxabs`); not recorded for a padding row.
        ROW_ABSMAX = "row_absmax", Vector;
        /// Sum over adjacent row pairs of ||x_r - x_{r-1}||^2 (1 value, units of x^2). Rows are
        /// adjacent along the second-to-last axis; pairs never cross a leading (batch/head)
        /// index. As `sumsq`: within 1e-6 relative, left out where f32 cannot hold it.
        ADJ_SUMSQ = "adj_sumsq", One;
        /// Number of NaN elements (1 value).
        NAN_COUNT = "nan_count", One;
        /// Number of +Inf elements (1 value).
        POSINF_COUNT = "posinf_count", One;
        /// Number of -Inf elements (1 value).
        NEGINF_COUNT = "neginf_count", One;
        /// XXH3-64 (seed 0) of the tensor's bytes (every element, row-major little-endian f32,
        /// padding rows and non-finite values included: the bytes a memo would key on), as 4
        /// values, the hash's 16-bit limbs, least significant first (`idx` 0..3), each exact in
        /// f32. Equal hashes: the same content up to a 2^-64 collision, so the exact repeat rate
        /// of a site ([`crate::mine::repeat_rate`]). Opt-in: not part of `stats=[all]`; no
        /// lowering (a device without the native kernel skips it with the reason).
        HASH = "hash", Vector;
    }
}

/// Statistics that `stats=[all]` leaves out: they are selected by name only (`hash` reads every
/// byte of the tensor once more, and has no lowering).
pub const OPT_IN: &[Stat] = &[tensor::HASH];

/// The statistics `stats=[all]` selects, in recording order, followed by `$extra`: one list
/// for [`SELECTABLE`] and [`TAP_STATS`], so the two cannot drift apart.
macro_rules! selectable {
    ($($extra:expr),*) => {
        &[
            tensor::MIN,
            tensor::MAX,
            tensor::MEAN,
            tensor::L1,
            tensor::SUMSQ,
            tensor::NNZ,
            tensor::KURTOSIS,
            tensor::HIST,
            tensor::ELEMSIG,
            tensor::CHAN_MAXABS,
            tensor::CHAN_OUTLIER,
            tensor::POS_SUMSQ,
            tensor::ROW_ABSMAX,
            tensor::ADJ_SUMSQ,
            tensor::NAN_COUNT,
            tensor::POSINF_COUNT,
            tensor::NEGINF_COUNT,
            $($extra),*
        ]
    };
}

/// [`SELECTABLE`] and the opt-in statistics ([`OPT_IN`]): what a tensor tap's `stats=[..]`
/// accepts by name.
pub const TAP_STATS: &[Stat] = selectable!(tensor::HASH);

/// Statistics a user selects by name in a tensor tap's `stats=[..]`; `hist` brings `hist_lo`,
/// `hist_hi`, `hist_outside` along, and `count` is always included.
pub const SELECTABLE: &[Stat] = selectable!();

