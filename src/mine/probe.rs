//! Probe verdicts upgraded with measured evidence: a sketch rule can only suspect some
//! structures (`two_four_probe`: a density near 1/2; `low_rank_probe`: widely varying row
//! energies); a host probe on captured tensors (`opscope probe`) measures them exactly, and
//! [`upgrade_two_four`] / [`upgrade_low_rank`] turn the suspicion into `*_confirmed` or
//! `*_refuted`.

use super::{
    tensor::kinds::{LOW_RANK_PROBE, TWO_FOUR_PROBE},
    Kind, Verdict,
};

/// The verdict kinds a probe result gives.
pub mod kinds {
    use super::Kind;

    /// Every group of 4 along K holds >= 2 zeros in every captured run.
    pub const TWO_FOUR_CONFIRMED: Kind = Kind { name: "two_four_confirmed", doc: "every group of 4 consecutive values along the reduction axis K holds >= 2 zeros, in every captured run: the tensor is 2:4 sparse as stored, so NVIDIA Ampere's sparse tensor cores can run it without pruning (Mishra et al., Accelerating Sparse Deep Neural Networks, 2021: the format needs every group)" };
    /// Some group of 4 along K holds fewer than 2 zeros.
    pub const TWO_FOUR_REFUTED: Kind = Kind { name: "two_four_refuted", doc: "some group of 4 along K holds < 2 zeros: the density near 1/2 is not 2:4 structure; a 2:4 kernel would have to prune (the probe's pruned-GEMM SQNR says at what error)" };
    /// The 99%-energy rank is small enough that a factored GEMM does at most half the work.
    pub const LOW_RANK_CONFIRMED: Kind = Kind { name: "low_rank_confirmed", doc: "in every captured run the rank r keeping 99% of the energy (Eckart-Young) satisfies r (rows + cols) <= rows cols / 2: a rank-r factorization does at most half the multiply-adds of the dense GEMM. 99% of the energy (relative Frobenius error 10%, sqrt(0.01)) and half the work are opscope's lines; Eckart-Young makes the truncation the best rank-r approximation, not the level; the `lowrank` actuation measures the model's accuracy at a chosen rank" };
    /// The 99%-energy rank is too large for a factorization to pay.
    pub const LOW_RANK_REFUTED: Kind = Kind { name: "low_rank_refuted", doc: "in some captured run the rank keeping 99% of the energy exceeds rows cols / (2 (rows + cols)): the varying row energies are not low rank that a factored GEMM could exploit" };
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
    upgrade(verdicts, TWO_FOUR_PROBE, |v| {
        let mine: Vec<&TwoFourEvidence> = evidence.iter().filter(|e| e.site == v.site && e.role == v.role).collect();
        if mine.is_empty() {
            return;
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
    })
}

/// The singular-value spectrum of one captured tensor seen as a `[rows, cols]` matrix (rows =
/// numel / last dim), one run.
#[derive(Debug, Clone, PartialEq)]
pub struct LowRankEvidence {
    /// Site name.
    pub site: String,
    /// Role (`lhs`, `rhs`, `out`).
    pub role: String,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix (the last dim).
    pub cols: usize,
    /// Smallest rank keeping >= 99% of the squared Frobenius norm; `None` when the singular
    /// values computed (a randomized top-k) hold less than that, so the rank exceeds k.
    pub energy_rank_99: Option<usize>,
}

impl LowRankEvidence {
    /// The largest rank at which a factorization does at most half the dense GEMM's
    /// multiply-adds: `rows cols / (2 (rows + cols))`, from the count `r (rows + cols)` of a
    /// rank-`r` factor pair against `rows cols` for the dense matrix (for a weight `W[K, N]`,
    /// `x U V` costs `m r (K + N)` against `m K N`; for an activation `X[M, K] = A B`,
    /// `A (B W)` costs `r n (M + K)` against `M K n`). The factor 2 is a margin for the thin
    /// GEMMs running below the dense one's efficiency.
    pub fn max_paying_rank(&self) -> f64 {
        (self.rows * self.cols) as f64 / (2.0 * (self.rows + self.cols) as f64)
    }
}

/// `verdicts` with every `low_rank_probe` verdict for which `evidence` has the same site and
/// role replaced by `low_rank_confirmed` (in every run the 99%-energy rank is at most
/// [`LowRankEvidence::max_paying_rank`]) or `low_rank_refuted`, its evidence extended with
/// the deciding run's `energy_rank_99` (the first run that does not fit, else the largest
/// rank; NaN when above a randomized SVD's rank) and `max_paying_rank`, and `runs_probed`. Other verdicts, and probe verdicts without evidence,
/// are returned unchanged. Payoffs are kept.
pub fn upgrade_low_rank(verdicts: Vec<Verdict>, evidence: &[LowRankEvidence]) -> Vec<Verdict> {
    upgrade(verdicts, LOW_RANK_PROBE, |v| {
        let mine: Vec<&LowRankEvidence> = evidence.iter().filter(|e| e.site == v.site && e.role == v.role).collect();
        if mine.is_empty() {
            return;
        }
        let fits = |e: &&LowRankEvidence| e.energy_rank_99.is_some_and(|r| r as f64 <= e.max_paying_rank());
        let confirmed = mine.iter().all(fits);
        // The run that decides: the first that does not fit, else the one with the largest rank.
        let worst = mine.iter().find(|e| !fits(e)).or_else(|| mine.iter().max_by_key(|e| e.energy_rank_99)).expect("not empty");
        v.kind = if confirmed { kinds::LOW_RANK_CONFIRMED } else { kinds::LOW_RANK_REFUTED };
        v.rule = "in every captured run the 99%-energy rank r satisfies r (rows + cols) <= rows cols / 2";
        v.source = "Eckart-Young (best rank-r approximation); multiply-add count of a rank-r factor pair against the dense GEMM, with a 2x margin";
        v.evidence.push(("energy_rank_99".into(), worst.energy_rank_99.map_or(f64::NAN, |r| r as f64)));
        v.evidence.push(("max_paying_rank".into(), worst.max_paying_rank()));
        v.evidence.push(("runs_probed".into(), mine.len() as f64));
    })
}

/// Apply `decide` to every verdict of kind `probe`: it rewrites a verdict with evidence in
/// place and leaves one without evidence unchanged.
fn upgrade(mut verdicts: Vec<Verdict>, probe: Kind, mut decide: impl FnMut(&mut Verdict)) -> Vec<Verdict> {
    for v in verdicts.iter_mut().filter(|v| v.kind == probe) {
        decide(v);
    }
    verdicts
}
