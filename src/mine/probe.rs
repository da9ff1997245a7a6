//! Probe verdicts upgraded with measured evidence: a sketch rule can only suspect some
//! structures (`two_four_probe`: a density near 1/2); a host probe on captured tensors
//! (`opscope probe`) counts it exactly, and [`upgrade_two_four`] turns the suspicion into
//! `two_four_confirmed` or `two_four_refuted`.

use super::{tensor::kinds::TWO_FOUR_PROBE, Kind, Verdict};

/// The verdict kinds a probe result gives.
pub mod kinds {
    use super::Kind;

    /// Every group of 4 along K holds >= 2 zeros in every captured run.
    pub const TWO_FOUR_CONFIRMED: Kind = Kind { name: "two_four_confirmed", doc: "every group of 4 consecutive values along the reduction axis K holds >= 2 zeros, in every captured run: the tensor is 2:4 sparse as stored, so NVIDIA Ampere's sparse tensor cores can run it without pruning (Mishra et al., Accelerating Sparse Deep Neural Networks, 2021: the format needs every group)" };
    /// Some group of 4 along K holds fewer than 2 zeros.
    pub const TWO_FOUR_REFUTED: Kind = Kind { name: "two_four_refuted", doc: "some group of 4 along K holds < 2 zeros: the density near 1/2 is not 2:4 structure; a 2:4 kernel would have to prune (the probe's pruned-GEMM SQNR says at what error)" };
}

/// Exact group-of-4 counts of one tensor (site and role as recorded), summed over the runs
/// captured.
#[derive(Debug, Clone, PartialEq)]
pub struct TwoFourEvidence {
    /// Site name.
    pub site: String,
    /// Role (`lhs`, `rhs`, `out`).
    pub role: String,
    /// Groups of 4 consecutive values along the reduction axis.
    pub groups: u64,
    /// Groups holding >= 2 zeros (exact `== 0.0`, either sign).
    pub satisfying: u64,
    /// SQNR (dB) of the GEMM output with the weight pruned to 2:4 (2 largest |w| kept per
    /// group), when measured; `None` when not measured or the error is exactly 0.
    pub pruned_sqnr_db: Option<f64>,
}

/// `verdicts` with every `two_four_probe` verdict for which `evidence` has the same site and
/// role replaced by `two_four_confirmed` (every group satisfies 2:4) or `two_four_refuted`,
/// its evidence extended with `groups_4`, `groups_2_4`, `fraction_2_4` (and `pruned_sqnr_db`).
/// Several evidence entries for one tensor (several runs) are summed. Other verdicts, and
/// probe verdicts without evidence, are returned unchanged. Payoffs are kept.
pub fn upgrade_two_four(verdicts: Vec<Verdict>, evidence: &[TwoFourEvidence]) -> Vec<Verdict> {
    verdicts
        .into_iter()
        .map(|mut v| {
            if v.kind != TWO_FOUR_PROBE {
                return v;
            }
            let mine: Vec<&TwoFourEvidence> = evidence.iter().filter(|e| e.site == v.site && e.role == v.role).collect();
            if mine.is_empty() {
                return v;
            }
            let groups: u64 = mine.iter().map(|e| e.groups).sum();
            let sat: u64 = mine.iter().map(|e| e.satisfying).sum();
            let confirmed = groups > 0 && sat == groups;
            v.kind = if confirmed { kinds::TWO_FOUR_CONFIRMED } else { kinds::TWO_FOUR_REFUTED };
            v.rule = "every group of 4 along K has >= 2 zeros in every captured run";
            v.source = "Mishra et al. 2021 (NVIDIA Ampere 2:4 sparse tensor cores): the format needs every group";
            v.evidence.push(("groups_4".into(), groups as f64));
            v.evidence.push(("groups_2_4".into(), sat as f64));
            v.evidence.push(("fraction_2_4".into(), if groups > 0 { sat as f64 / groups as f64 } else { f64::NAN }));
            if let Some(db) = mine.iter().filter_map(|e| e.pruned_sqnr_db).reduce(f64::min) {
                v.evidence.push(("pruned_sqnr_db".into(), db));
            }
            v
        })
        .collect()
}
