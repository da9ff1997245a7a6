//! Boundary fixtures for every miner rule: statistics planted just inside and just outside each
//! rule's threshold, as the tensor sketch or the probe would record them, and the exact set of
//! verdicts each must produce. The expected verdicts and the threshold arithmetic are written
//! here by hand from the rules' documented thresholds (the `Kind` docs and the README), never
//! read from `src/`: a moved threshold, a dropped clause or a disabled check fails a test.
//!
//! Margins are a few percent of the threshold (or a few hundredths of a dB), far above f32
//! rounding of the recorded values (~1e-7 relative), so each fixture is on the side it claims.
//!
//! Mutation-checked when written (each change applied alone, this file run, reverted): dropping
//! "k <= keys/4" (sparse attention), dropping "5x the uniform share" (sink), disabling the
//! pad_mass > 1e-3 check, moving the layer-skip cut to 0.75 of the median; and moving each
//! tensor threshold a few percent (density 0.35, 2:4 band 0.44-0.56, 5% of channels, 7x the
//! median channel, chan_outlier 3.9, kurtosis 19, +7.9 dB per channel / per token, int4 21.9 dB,
//! kurtosis 2.5, int4 on the best run, 1 LUT hole, delta 0.26 and pairs across blocks, row CV
//! 0.33, scale 1.45x, drift 0.45 rms, rms CV 6%, repeat without sumsq, dead-expert mean 9.5,
//! imbalance 1.9x, top-k mass 0.89, sink mass 0.18): every one fails a test here.

use std::sync::Arc;

use opscope::mine::{mine, series_from_rows};
use opscope::Row;

/// One recording row of `site`/`role` at execution `step`.
fn row(site: &str, role: &str, shape: &str, step: u64, stat: &str, idx: u64, value: f32) -> Row {
    Row {
        run_id: Arc::from("r0"),
        compile: 0,
        step,
        graph: Arc::from("g"),
        pass: Arc::from("p"),
        pass_idx: 0,
        site: Arc::from(site),
        op: Arc::from("MatMul"),
        role: Arc::from(role),
        stat: Arc::from(stat),
        idx,
        value,
        numel: None,
        shape: Arc::from(shape),
        flops: Some(1000),
    }
}

/// Rows of one (site, role) execution: scalars `(stat, value)` and vectors `(stat, values)`.
fn run_rows(site: &str, role: &str, shape: &str, step: u64, scalars: &[(&str, f32)], vectors: &[(&str, &[f32])]) -> Vec<Row> {
    let mut out: Vec<Row> = scalars.iter().map(|&(s, v)| row(site, role, shape, step, s, 0, v)).collect();
    for (s, v) in vectors {
        out.extend(v.iter().enumerate().map(|(i, &x)| row(site, role, shape, step, s, i as u64, x)));
    }
    out
}

/// The verdict kinds the miner gives `rows`, sorted, deduplicated.
fn kinds(rows: &[Row]) -> Vec<&'static str> {
    let mut k: Vec<&'static str> = mine(&series_from_rows(rows)).into_iter().map(|v| v.kind.name).collect();
    k.sort();
    k.dedup();
    k
}

/// A one-run tensor series at `mm/lhs` (`[64,128]`) with `count` = 1000 unless given.
fn tensor(scalars: &[(&str, f32)], vectors: &[(&str, &[f32])]) -> Vec<Row> {
    tensor_as("lhs", scalars, vectors)
}

fn tensor_as(role: &str, scalars: &[(&str, f32)], vectors: &[(&str, &[f32])]) -> Vec<Row> {
    let mut s: Vec<(&str, f32)> = scalars.to_vec();
    if !s.iter().any(|(n, _)| *n == "count") {
        s.push(("count", 1000.0));
    }
    run_rows("mm", role, "[64,128]", 0, &s, vectors)
}

const NONE: &[&str] = &[];

// ---------------------------------------------------------------- attention probe

/// One run of the attention probe over `heads` heads: `keys` non-padding keys per sequence,
/// `topk` with the same top-k mass in every head, first/last-key mass in head 0 (the other heads
/// 0.01), and padding mass in head 1.
fn attn(keys: f32, topk: f32, topk_mass: f32, sink_first: f32, sink_last: f32, pad: f32) -> Vec<Row> {
    let h = 4;
    let mass = vec![topk_mass; h];
    let head0 = |v: f32| (0..h).map(|i| if i == 0 { v } else { 0.01 }).collect::<Vec<f32>>();
    let (first, last) = (head0(sink_first), head0(sink_last));
    let pads: Vec<f32> = (0..h).map(|i| if i == 1 { pad } else { 0.0 }).collect();
    run_rows(
        "attn.0",
        "probs",
        "[2,4,64,64]",
        0,
        &[("queries", 128.0), ("keys", keys), ("topk", topk)],
        &[("topk_mass", &mass), ("sink_first", &first), ("sink_last", &last), ("pad_mass", &pads)],
    )
}

#[test]
fn sparse_attention_needs_90_percent_mass_within_a_quarter_of_the_keys() {
    // 32 keys: k = 8 is keys/4 exactly (on the line, inside); k = 9 is outside however
    // concentrated the mass.
    assert_eq!(kinds(&attn(32.0, 8.0, 0.905, 0.01, 0.01, 0.0)), vec!["sparse_attention"]);
    assert_eq!(kinds(&attn(32.0, 9.0, 0.99, 0.01, 0.01, 0.0)), NONE);
    // The mass line: 0.895 < 0.9 with k = 4 <= 8.
    assert_eq!(kinds(&attn(32.0, 4.0, 0.895, 0.01, 0.01, 0.0)), NONE);
}

#[test]
fn an_attention_sink_needs_five_times_the_uniform_share_and_a_fifth_of_the_mass() {
    // 16 keys: the uniform share is 1/16, 5x is 0.3125, above the 0.2 line, so 5x decides.
    assert_eq!(kinds(&attn(16.0, 8.0, 0.5, 0.32, 0.01, 0.0)), vec!["attention_sink"]);
    assert_eq!(kinds(&attn(16.0, 8.0, 0.5, 0.30, 0.01, 0.0)), NONE);
    // The last key, same line.
    assert_eq!(kinds(&attn(16.0, 8.0, 0.5, 0.01, 0.32, 0.0)), vec!["attention_sink"]);
    assert_eq!(kinds(&attn(16.0, 8.0, 0.5, 0.01, 0.30, 0.0)), NONE);
    // 64 keys: 5x the uniform share is 0.078, so the 0.2 line decides.
    assert_eq!(kinds(&attn(64.0, 32.0, 0.5, 0.21, 0.01, 0.0)), vec!["attention_sink"]);
    assert_eq!(kinds(&attn(64.0, 32.0, 0.5, 0.19, 0.01, 0.0)), NONE);
}

/// With the probe's lift recorded (sink mass x the keys each query may see, 1 for uniform
/// attention), 5x is judged on it, not on `1 / keys`: a causal prefix gives its first key a large
/// mean share without any sink.
#[test]
fn an_attention_sink_with_a_recorded_lift_needs_a_lift_of_five() {
    let with_lift = |first: f32, lift: f32| {
        let mut rows = attn(64.0, 32.0, 0.5, first, 0.01, 0.0);
        let lifts: Vec<f32> = (0..4).map(|i| if i == 0 { lift } else { 0.3 }).collect();
        let last: Vec<f32> = vec![0.3; 4];
        rows.extend(run_rows("attn.0", "probs", "[2,4,64,64]", 0, &[], &[("sink_first_lift", &lifts), ("sink_last_lift", &last)]));
        rows
    };
    // Mass 0.5 over 64 keys would be 32x the 1/keys share; the lift says 4.9x: no sink.
    assert_eq!(kinds(&with_lift(0.5, 4.9)), NONE);
    assert_eq!(kinds(&with_lift(0.5, 5.1)), vec!["attention_sink"]);
    // The 0.2 mass line still holds with a large lift.
    assert_eq!(kinds(&with_lift(0.19, 40.0)), NONE);
    assert_eq!(kinds(&with_lift(0.21, 40.0)), vec!["attention_sink"]);
}

#[test]
fn attention_mass_on_padding_keys_above_1e_3_is_a_health_verdict() {
    assert_eq!(kinds(&attn(32.0, 16.0, 0.5, 0.01, 0.01, 1.1e-3)), vec!["health"]);
    assert_eq!(kinds(&attn(32.0, 16.0, 0.5, 0.01, 0.01, 0.9e-3)), NONE);
}

// ---------------------------------------------------------------- residual probe

/// One run of the residual probe at `block.0`: the largest |h| entry `top` (row 0, channel 7)
/// and the median |h| `median`.
fn massive(top: f32, median: f32) -> Vec<Row> {
    let top3 = [top, 0.0, 7.0, 1.0, 0.0, 1.0, 0.5, 0.0, 2.0, 0.25, 0.0, 3.0];
    run_rows("block.0", "block", "[8,576]", 0, &[("rows", 8.0), ("out_median_abs", median)], &[("out_top", &top3)])
}

#[test]
fn a_massive_activation_needs_100_and_1000_times_the_median() {
    // Sun et al. 2024: |h| > 100 and about 1000x the median magnitude.
    assert_eq!(kinds(&massive(101.0, 0.1)), vec!["massive_activation"]);
    assert_eq!(kinds(&massive(-101.0, 0.1)), vec!["massive_activation"], "the sign does not matter");
    assert_eq!(kinds(&massive(99.0, 0.01)), NONE, "below 100");
    assert_eq!(kinds(&massive(200.0, 0.201)), NONE, "995x the median");
    assert_eq!(kinds(&massive(200.0, 0.199)), vec!["massive_activation"]);
}

/// Over several runs the rule judges the largest |h| of any run, with that run's median: a
/// massive entry in the second run of two is found whichever run comes first.
#[test]
fn a_massive_activation_in_any_run_is_found() {
    let at = |step: u64, top: f32, median: f32| {
        let top3 = [top, 0.0, 7.0, 1.0, 0.0, 1.0, 0.5, 0.0, 2.0, 0.25, 0.0, 3.0];
        run_rows("block.0", "block", "[8,576]", step, &[("rows", 8.0), ("out_median_abs", median)], &[("out_top", &top3)])
    };
    let mut rows = at(0, 2.0, 0.1);
    rows.extend(at(1, 150.0, 0.1));
    assert_eq!(kinds(&rows), vec!["massive_activation"]);
    let mut rows = at(0, 150.0, 0.1);
    rows.extend(at(1, 2.0, 0.1));
    assert_eq!(kinds(&rows), vec!["massive_activation"]);
}

// ---------------------------------------------------------------- routing probe

fn route(load: &[f32]) -> Vec<Row> {
    run_rows("moe.0", "router", "[64,4]", 0, &[("tokens", 40.0)], &[("load", load)])
}

#[test]
fn a_dead_expert_needs_a_uniform_share_of_at_least_ten() {
    // Mean load 40 / 4 = 10 (on the line): expert 0 got nothing.
    assert_eq!(kinds(&route(&[0.0, 14.0, 13.0, 13.0])), vec!["dead_expert"]);
    // Mean 39 / 4 = 9.75: too few assignments to call it dead.
    assert_eq!(kinds(&route(&[0.0, 13.0, 13.0, 13.0])), NONE);
}

#[test]
fn expert_imbalance_is_a_busiest_load_of_twice_the_mean() {
    // Mean 10: 20 is 2x (on the line), 19 is not.
    assert_eq!(kinds(&route(&[20.0, 10.0, 5.0, 5.0])), vec!["expert_imbalance"]);
    assert_eq!(kinds(&route(&[19.0, 11.0, 5.0, 5.0])), NONE);
}

// ---------------------------------------------------------------- residual probe

/// One run of the residual probe per block with influence 1 - cos = `influence[i]`.
fn blocks(influence: &[f32]) -> Vec<Row> {
    influence
        .iter()
        .enumerate()
        .flat_map(|(i, b)| run_rows(&format!("block.{i}"), "block", "[16,32]", 0, &[("rows", 16.0), ("cos", 1.0 - b)], &[]))
        .collect()
}

fn skipped(rows: &[Row]) -> Vec<String> {
    mine(&series_from_rows(rows)).into_iter().filter(|v| v.kind.name == "layer_skip_probe").map(|v| v.site).collect()
}

#[test]
fn a_layer_skip_candidate_has_at_most_half_the_median_block_influence() {
    // Median influence 0.2 (the upper median of five), so the cut is 0.1.
    assert_eq!(skipped(&blocks(&[0.2, 0.2, 0.099, 0.2, 0.2])), vec!["block.2"]);
    assert_eq!(kinds(&blocks(&[0.2, 0.2, 0.099, 0.2, 0.2])), vec!["layer_skip_probe"]);
    assert_eq!(skipped(&blocks(&[0.2, 0.2, 0.101, 0.2, 0.2])), Vec::<String>::new());
    // Between half and three quarters of the median: not a candidate.
    assert_eq!(skipped(&blocks(&[0.2, 0.2, 0.14, 0.2, 0.2])), Vec::<String>::new());
    // Two blocks are too few to have a median to compare against.
    assert_eq!(skipped(&blocks(&[0.2, 0.01])), Vec::<String>::new());
}

// ---------------------------------------------------------------- tensor rules, one run

#[test]
fn sparse_gemm_is_density_at_most_0_3_and_two_four_is_density_0_45_to_0_55() {
    assert_eq!(kinds(&tensor(&[("nnz", 299.0)], &[])), vec!["sparse_gemm"]);
    assert_eq!(kinds(&tensor(&[("nnz", 301.0)], &[])), NONE);
    assert_eq!(kinds(&tensor(&[("nnz", 451.0)], &[])), vec!["two_four_probe"]);
    assert_eq!(kinds(&tensor(&[("nnz", 449.0)], &[])), NONE);
    assert_eq!(kinds(&tensor(&[("nnz", 549.0)], &[])), vec!["two_four_probe"]);
    assert_eq!(kinds(&tensor(&[("nnz", 551.0)], &[])), NONE);
}

/// 100 channel maxima: `n` of them at `big`, the rest at 1.
fn channels(n: usize, big: f32) -> Vec<f32> {
    (0..100).map(|i| if i < n { big } else { 1.0 }).collect()
}

#[test]
fn channel_outliers_need_chan_outlier_4_and_at_most_4_percent_of_channels_above_8x() {
    let c = |chan: f32, ch: &[f32]| kinds(&tensor(&[("chan_outlier", chan)], &[("chan_maxabs", ch)]));
    assert_eq!(c(4.0, &channels(4, 9.0)), vec!["channel_outliers"]);
    // 5% of the channels: a broad spread, not a few outlier channels.
    assert_eq!(c(4.0, &channels(5, 9.0)), NONE);
    // chan_outlier just under 4.
    assert_eq!(c(3.99, &channels(4, 9.0)), NONE);
    // 8x the median is on the line, not above it: no elevated channel.
    assert_eq!(c(4.0, &channels(4, 8.0)), NONE);
    assert_eq!(c(4.0, &channels(1, 8.1)), vec!["channel_outliers"]);
}

#[test]
fn scattered_outliers_are_kurtosis_20_on_a_dense_tensor_without_channel_structure() {
    assert_eq!(kinds(&tensor(&[("kurtosis", 20.0)], &[])), vec!["scattered_outliers"]);
    assert_eq!(kinds(&tensor(&[("kurtosis", 19.9)], &[])), NONE);
    // Density 0.6 is not dense (> 0.6 is).
    assert_eq!(kinds(&tensor(&[("kurtosis", 25.0), ("nnz", 600.0)], &[])), NONE);
    assert_eq!(kinds(&tensor(&[("kurtosis", 25.0), ("nnz", 601.0)], &[])), vec!["scattered_outliers"]);
    // With channel structure the outliers are channel outliers instead.
    assert_eq!(
        kinds(&tensor(&[("kurtosis", 25.0), ("chan_outlier", 4.0)], &[("chan_maxabs", &channels(1, 9.0))])),
        vec!["channel_outliers"]
    );
}

/// `n` values: one at 10 (the tensor's absmax), the rest at `c`.
fn one_big(n: usize, c: f32) -> Vec<f32> {
    (0..n).map(|i| if i == 0 { 10.0 } else { c }).collect()
}

#[test]
fn per_channel_int8_pays_8_db_over_per_tensor() {
    // Per tensor: SQNR = 10 log10(12 P 127^2 / absmax^2); per channel: 10 log10(12 P 127^2 /
    // mean(c^2)). The gain is 10 log10(absmax^2 / mean(c^2)), P cancels. One channel at 10 and
    // 99 at c: c = 3.85 gives mean(c^2) = 15.674, a gain of 8.05 dB; c = 3.90 gives 16.058,
    // 7.94 dB.
    let base = [("count", 6400.0), ("sumsq", 6400.0), ("min", -1.0), ("max", 10.0)];
    assert_eq!(kinds(&tensor(&base, &[("chan_maxabs", &one_big(100, 3.85))])), vec!["per_channel_int8"]);
    assert_eq!(kinds(&tensor(&base, &[("chan_maxabs", &one_big(100, 3.90))])), NONE);
    // A weight too.
    assert_eq!(kinds(&tensor_as("rhs", &base, &[("chan_maxabs", &one_big(100, 3.85))])), vec!["per_channel_int8"]);
}

#[test]
fn per_token_int8_pays_8_db_over_per_tensor_on_activations_only() {
    // One row at 10 and 63 at c: c = 3.78 gives mean(c^2) = 15.627, 8.06 dB; c = 3.84 gives
    // 16.078, 7.94 dB.
    let base = [("count", 6400.0), ("sumsq", 6400.0), ("min", -1.0), ("max", 10.0)];
    assert_eq!(kinds(&tensor(&base, &[("row_absmax", &one_big(64, 3.78))])), vec!["per_token_int8"]);
    assert_eq!(kinds(&tensor(&base, &[("row_absmax", &one_big(64, 3.84))])), NONE);
    // A weight's rows are its input channels: no per-token verdict.
    assert_eq!(kinds(&tensor_as("rhs", &base, &[("row_absmax", &one_big(64, 3.78))])), NONE);
    assert_eq!(kinds(&tensor_as("out", &base, &[("row_absmax", &one_big(64, 3.78))])), vec!["per_token_int8"]);
}

#[test]
fn int4_needs_22_db_in_every_run_and_kurtosis_at_most_2_4() {
    // Int4 SQNR = 10 log10(12 P 7^2 / absmax^2) with absmax 1: P = 0.272 gives 22.04 dB,
    // P = 0.267 gives 21.96 dB.
    let run = |step: u64, sumsq: f32, kurt: f32| {
        run_rows("mm", "lhs", "[64,128]", step, &[("count", 1000.0), ("sumsq", sumsq), ("min", -1.0), ("max", 1.0), ("kurtosis", kurt)], &[])
    };
    assert_eq!(kinds(&run(0, 272.0, 2.39)), vec!["int4"]);
    assert_eq!(kinds(&run(0, 267.0, 2.39)), NONE);
    assert_eq!(kinds(&run(0, 272.0, 2.41)), NONE);
    // Two runs, one below 22 dB: the worst run decides, not the median.
    let mut two = run(0, 280.0, 2.0);
    two.extend(run(1, 267.0, 2.0));
    assert_eq!(kinds(&two), NONE);
    let mut two = run(0, 280.0, 2.0);
    two.extend(run(1, 272.0, 2.0));
    assert_eq!(kinds(&two), vec!["int4"]);
}

#[test]
fn lut_is_two_empty_bins_between_the_10_and_90_percent_quantiles() {
    // 16 bins of 10 values; emptying bins 6 and 9 leaves two holes in the central 80%.
    let hist = |empty: &[usize]| (0..16).map(|i| if empty.contains(&i) { 0.0 } else { 10.0 }).collect::<Vec<f32>>();
    assert_eq!(kinds(&tensor(&[], &[("hist", &hist(&[6, 9]))])), vec!["lut"]);
    assert_eq!(kinds(&tensor(&[], &[("hist", &hist(&[6]))])), NONE);
    // Empty bins in the tails (outside the 10%-90% bins) are not holes.
    assert_eq!(kinds(&tensor(&[], &[("hist", &hist(&[0, 15]))])), NONE);
    // A sparse tensor (density <= 0.6) is not judged.
    assert_eq!(kinds(&tensor(&[("nnz", 600.0)], &[("hist", &hist(&[6, 9]))])), NONE);
}

#[test]
fn delta_compute_is_adjacent_row_energy_at_most_a_quarter() {
    // 8 rows of energy 1 in one block of 8 ([8,4]): 7 adjacent pairs of energy 2, 14 in all.
    let r = |adj: f32| run_rows("mm", "lhs", "[8,4]", 0, &[("count", 32.0), ("adj_sumsq", adj)], &[("pos_sumsq", &[1.0; 8])]);
    assert_eq!(kinds(&r(3.4)), vec!["delta_compute"]); // 0.243
    assert_eq!(kinds(&r(3.6)), NONE); // 0.257
    // Two blocks of 4 ([2,4,4]): pairs never cross the block edge, 6 pairs, 12 in all.
    let r2 = |adj: f32| run_rows("mm", "lhs", "[2,4,4]", 0, &[("count", 32.0), ("adj_sumsq", adj)], &[("pos_sumsq", &[1.0; 8])]);
    assert_eq!(kinds(&r2(2.9)), vec!["delta_compute"]); // 0.242 (0.207 if the edge pair counted)
    assert_eq!(kinds(&r2(3.1)), NONE); // 0.258
}

/// `rows` without the values of vector `stat` at `idx`: what the recording holds for a padding
/// row or a sampled element in padding (the sketch writes no value there).
fn without(rows: Vec<Row>, stat: &str, idx: &[u64]) -> Vec<Row> {
    rows.into_iter().filter(|r| !(&*r.stat == stat && idx.contains(&r.idx))).collect()
}

#[test]
fn padding_rows_leave_the_row_rules_to_the_recorded_rows() {
    // [2,4,4] with the last row of each sequence padding (rows 3 and 7 not recorded): the
    // kernel's adj_sumsq takes the pairs (0,1), (1,2), (4,5), (5,6), energy 2 each, 8 in all.
    let r = |adj: f32| {
        let rows = run_rows("mm", "lhs", "[2,4,4]", 0, &[("count", 24.0), ("adj_sumsq", adj)], &[("pos_sumsq", &[1.0; 8])]);
        kinds(&without(rows, "pos_sumsq", &[3, 7]))
    };
    assert_eq!(r(1.9), vec!["delta_compute"]); // 0.2375
    assert_eq!(r(2.1), NONE); // 0.2625
    // Row-energy CV over the recorded rows: 1 - x and 1 + x alternating, a padding row between
    // (rows of 256 values: the fixed 0.35 line binds, the i.i.d. null's twice being 0.177).
    let cv = |x: f32| {
        let e: Vec<f32> = (0..8).map(|i| if i % 2 == 0 { 1.0 - x } else { 1.0 + x }).collect();
        let rows = run_rows("mm", "lhs", "[8,256]", 0, &[("count", 6.0 * 256.0), ("kurtosis", 3.0)], &[("pos_sumsq", &e)]);
        kinds(&without(rows, "pos_sumsq", &[6, 7]))
    };
    assert_eq!(cv(0.36), vec!["low_rank_probe"]);
    assert_eq!(cv(0.34), NONE);
}

#[test]
fn each_run_pairs_rows_by_its_own_shape() {
    // One site in two compiles: a prefill [2,4,4] (6 pairs within sequences, energy 12) and a
    // decode step [2,1,4] (one token of each of two sequences: no pair at all, adj_sumsq 0).
    // The decode run must not borrow the prefill's shape (3 pairs of energy 6 and a ratio of 0).
    let mut rows = run_rows("mm", "lhs", "[2,4,4]", 0, &[("count", 32.0), ("adj_sumsq", 3.6)], &[("pos_sumsq", &[1.0; 8])]);
    for step in 0..3 {
        let mut d = run_rows("mm", "lhs", "[2,1,4]", step, &[("count", 8.0), ("adj_sumsq", 0.0)], &[("pos_sumsq", &[1.0; 2])]);
        d.iter_mut().for_each(|r| r.compile = 1);
        rows.extend(d);
    }
    assert_eq!(kinds(&rows), NONE); // the prefill's 0.3 alone
    rows[1].value = 2.9; // adj_sumsq 2.9 / 12 = 0.242
    assert_eq!(kinds(&rows), vec!["delta_compute"]);
}

#[test]
fn runs_of_two_compiles_keep_their_own_shape_and_flops_in_any_row_order() {
    // A site in a prefill compile ([2,8,4], 1000 FLOPs, absmax 1) and a decode compile
    // ([2,1,4], 125 FLOPs, absmax 0.4, six steps), and a second site with prefill runs only.
    let run = |compile: u32, step: u64, shape: &str, flops: u64, absmax: f32| {
        let mut r = run_rows("mm", "lhs", shape, step, &[("count", 8.0), ("nnz", 1.0), ("min", -absmax), ("max", absmax), ("mean", 0.0), ("sumsq", 4.0)], &[]);
        r.iter_mut().for_each(|x| {
            x.compile = compile;
            x.flops = Some(flops);
        });
        r
    };
    let mut rows = run(1, 0, "[2,8,4]", 1000, 1.0);
    rows.extend(run(1, 1, "[2,8,4]", 1000, 1.0));
    for step in 0..6 {
        rows.extend(run(2, step, "[2,1,4]", 125, 0.4 + 0.001 * step as f32));
    }
    let mut other = run(1, 0, "[2,8,4]", 1000, 1.0);
    other.iter_mut().for_each(|x| x.site = "other".into());
    rows.extend(other);
    let verdicts = mine(&series_from_rows(&rows));
    // The absmax falls from 1 to 0.4 at the change of compile: not a drift of the data (the
    // decode runs alone are compared, 0.400..0.405).
    assert!(!verdicts.iter().any(|v| v.kind.name == "scale_drift"), "{verdicts:?}");
    // The series' shape and FLOPs are its first run's, whatever row comes first in the file.
    let mut reversed = rows.clone();
    reversed.reverse();
    let (a, b) = (series_from_rows(&rows), series_from_rows(&reversed));
    for (k, s) in &a {
        assert_eq!((&s.shape, s.flops), (&b[k].shape, b[k].flops), "{k:?}");
    }
    assert_eq!(a[&("mm".to_string(), "lhs".to_string(), 0)].shape, "[2,8,4]");
    assert_eq!(format!("{:?}", mine(&a)), format!("{:?}", mine(&b)));
    // Payoff shares: mm ran 2 x 1000 + 6 x 125 = 2750 FLOPs, other 1000: mm's share is 2750/3750.
    let sparse = mine(&a).into_iter().find(|v| v.site == "mm" && v.kind.name == "sparse_gemm").expect("density 1/8: sparse_gemm");
    assert!(sparse.fraction > 0.0 && (sparse.payoff - 2750.0 / 3750.0 * sparse.fraction).abs() < 1e-12, "{sparse:?}");
}

#[test]
fn low_rank_probe_is_row_energy_cv_at_least_0_35_and_twice_the_iid_null() {
    // Rows at 1 - x and 1 + x: mean 1, population standard deviation x, CV x; 8 rows of `c`
    // values each.
    let rows = |x: f32| (0..8).map(|i| if i % 2 == 0 { 1.0 - x } else { 1.0 + x }).collect::<Vec<f32>>();
    let at = |c: usize, x: f32, kurt: f32| {
        kinds(&run_rows("mm", "lhs", &format!("[8,{c}]"), 0, &[("count", 8.0 * c as f32), ("kurtosis", kurt)], &[("pos_sumsq", &rows(x))]))
    };
    // C = 256, Gaussian kurtosis: twice the null sqrt(2/256) is 0.177, so 0.35 is the line.
    let r = |x: f32, kurt: f32| at(256, x, kurt);
    assert_eq!(r(0.36, 3.0), vec!["low_rank_probe"]);
    assert_eq!(r(0.34, 3.0), NONE);
    // Heavy tails explain uneven rows: scattered outliers, not low rank (a CV above the line
    // kurtosis 20 gives, 2 sqrt(19/256) = 0.545; kurtosis exactly 20 is not under 20).
    assert_eq!(r(0.36, 20.0), vec!["scattered_outliers"]);
    assert_eq!(r(0.6, 20.0), vec!["scattered_outliers"]);
    assert_eq!(r(0.6, 19.9), vec!["low_rank_probe"]);
    // Density must exceed 0.6 (zeros spread row energies by themselves): 768 of 1280 values
    // non-zero is 0.6 exactly.
    let dense = |nnz: f32| {
        kinds(&run_rows("mm", "lhs", "[8,160]", 0, &[("count", 1280.0), ("nnz", nnz), ("kurtosis", 3.0)], &[("pos_sumsq", &rows(0.36))]))
    };
    assert_eq!(dense(768.0), NONE);
    assert_eq!(dense(769.0), vec!["low_rank_probe"]);
    // Narrow rows: C = 16, kurtosis 3: the line is 2 sqrt(2/16) = 0.7071.
    assert_eq!(at(16, 0.72, 3.0), vec!["low_rank_probe"]);
    assert_eq!(at(16, 0.70, 3.0), NONE);
    // Heavier tails: C = 64, kurtosis 9: 2 sqrt(8/64) = 0.7071 too; at kurtosis 3 the same CV is
    // far above its line (0.354).
    assert_eq!(at(64, 0.72, 9.0), vec!["low_rank_probe"]);
    assert_eq!(at(64, 0.70, 9.0), NONE);
    assert_eq!(at(64, 0.40, 3.0), vec!["low_rank_probe"]);
    assert_eq!(at(64, 0.35, 3.0), NONE);
    // The evidence names the line it was held to.
    let v = opscope::mine::mine(&opscope::mine::series_from_rows(&run_rows("mm", "lhs", "[8,16]", 0, &[("count", 128.0), ("kurtosis", 3.0)], &[("pos_sumsq", &rows(0.8))])));
    let line = v.iter().find(|v| v.kind.name == "low_rank_probe").and_then(|v| v.evidence.iter().find(|e| e.0 == "row_energy_cv_line").map(|e| e.1));
    assert!(line.is_some_and(|l| (l - 2.0 * (2.0f64 / 16.0).sqrt()).abs() < 1e-12), "{v:?}");
}

#[test]
fn nan_or_inf_is_a_health_verdict() {
    assert_eq!(kinds(&tensor(&[("nan_count", 1.0)], &[])), vec!["health"]);
    assert_eq!(kinds(&tensor(&[("posinf_count", 1.0)], &[])), vec!["health"]);
    assert_eq!(kinds(&tensor(&[("nan_count", 0.0), ("posinf_count", 0.0), ("neginf_count", 0.0)], &[])), NONE);
}

// ---------------------------------------------------------------- tensor rules across runs

/// One run: mean square `p` over 1000 values, the given mean and absmax, and an `elemsig`.
fn across(step: u64, mean: f32, p: f32, absmax: f32, sig: &[f32]) -> Vec<Row> {
    run_rows(
        "mm",
        "lhs",
        "[64,128]",
        step,
        &[("count", 1000.0), ("mean", mean), ("sumsq", 1000.0 * p), ("min", -absmax), ("max", absmax)],
        &[("elemsig", sig)],
    )
}

/// `runs` runs where run `i` has mean `mean(i)`, mean square `p(i)`, absmax `absmax(i)`, and
/// elemsig `[i, 1, 2]` (different every run).
fn runs(n: u64, mean: impl Fn(f32) -> f32, p: impl Fn(f32) -> f32, absmax: impl Fn(f32) -> f32) -> Vec<Row> {
    (0..n).flat_map(|i| across(i, mean(i as f32), p(i as f32), absmax(i as f32), &[i as f32, 1.0, 2.0])).collect()
}

#[test]
fn scale_drift_is_an_absmax_trend_of_1_5x() {
    // Absmax 1 + s i over 4 runs is its own least-squares line: end / start = 1 + 3 s.
    assert_eq!(kinds(&runs(4, |_| 0.0, |_| 1.0, |i| 4.0 * (1.0 + 0.17 * i))), vec!["scale_drift"]); // 1.51x
    // 1.48x: a static scale is still fine, and the rms is constant: stationary.
    assert_eq!(kinds(&runs(4, |_| 0.0, |_| 1.0, |i| 4.0 * (1.0 + 0.16 * i))), vec!["stationary"]);
    // Shrinking ranges count too (1 / 1.5).
    assert_eq!(kinds(&runs(4, |_| 0.0, |_| 1.0, |i| 4.0 * (1.0 - 0.112 * i))), vec!["scale_drift"]); // 0.664x
    assert_eq!(kinds(&runs(4, |_| 0.0, |_| 1.0, |i| 4.0 * (1.0 - 0.108 * i))), vec!["stationary"]); // 0.676x
}

#[test]
fn drifting_is_a_mean_trend_of_half_the_rms() {
    // Rms 1; the mean moves linearly by d over 4 runs (its own least-squares line).
    assert_eq!(kinds(&runs(4, |i| 0.51 * i / 3.0, |_| 1.0, |_| 4.0)), vec!["drifting"]);
    assert_eq!(kinds(&runs(4, |i| 0.49 * i / 3.0, |_| 1.0, |_| 4.0)), vec!["stationary"]);
    // Needs MIN_STEPS = 4 runs.
    assert_eq!(kinds(&runs(3, |i| 2.0 * i, |_| 1.0, |_| 4.0)), NONE);
}

#[test]
fn stationary_is_a_per_run_rms_cv_of_at_most_5_percent() {
    // Rms alternating 1 - x, 1 + x: CV x (population standard deviation over the mean).
    let alt = |x: f32| move |i: f32| if i as u32 % 2 == 0 { (1.0 - x) * (1.0 - x) } else { (1.0 + x) * (1.0 + x) };
    assert_eq!(kinds(&runs(4, |_| 0.0, alt(0.049), |_| 4.0)), vec!["stationary"]);
    assert_eq!(kinds(&runs(4, |_| 0.0, alt(0.051), |_| 4.0)), NONE);
    assert_eq!(kinds(&runs(3, |_| 0.0, |_| 1.0, |_| 4.0)), NONE);
}

#[test]
fn exact_repeat_is_the_same_elemsig_and_sumsq_in_every_run() {
    let same = |n: u64| (0..n).flat_map(|i| across(i, 0.0, 1.0, 4.0, &[0.5, 1.0, 2.0])).collect::<Vec<Row>>();
    assert_eq!(kinds(&same(4)), vec!["exact_repeat"]);
    assert_eq!(kinds(&same(3)), NONE);
    // One element of one run's elemsig differs by one ulp: a stationary tensor, not a repeat.
    let mut near = same(3);
    near.extend(across(3, 0.0, 1.0, 4.0, &[0.5, f32::from_bits(1.0f32.to_bits() + 1), 2.0]));
    assert_eq!(kinds(&near), vec!["stationary"]);
    // The same elemsig with a different sumsq is not a repeat either.
    let mut near = same(3);
    near.extend(across(3, 0.0, 1.001, 4.0, &[0.5, 1.0, 2.0]));
    assert_eq!(kinds(&near), vec!["stationary"]);
    // A sampled element in padding is not recorded in any run (a NaN hole in every elemsig):
    // still a repeat.
    assert_eq!(kinds(&without(same(4), "elemsig", &[1])), vec!["exact_repeat"]);
    // ... and a hole in one run only is a different elemsig.
    let mut holed = same(3);
    holed.extend(without(across(3, 0.0, 1.0, 4.0, &[0.5, 1.0, 2.0]), "elemsig", &[1]));
    assert_eq!(kinds(&holed), vec!["stationary"]);
    // A weight the writer memoizes (an rhs recorded at step 0 of each compile only) is the same
    // in every compile because it is a parameter: neither a repeat to memoize nor a stationary
    // activation to calibrate (a helper's 300 compiles topped `mine` with their weights).
    let weight = |compiles: u32, role: &str| -> Vec<Row> {
        (1..=compiles)
            .flat_map(|c| {
                let mut r = across(0, 0.0, 1.0, 4.0, &[0.5, 1.0, 2.0]);
                r.iter_mut().for_each(|r| {
                    r.compile = c;
                    r.role = role.into();
                });
                r
            })
            .collect()
    };
    assert_eq!(kinds(&weight(5, "rhs")), NONE);
    // The same rows as an activation (lhs), or an rhs recorded at later steps: a repeat.
    assert_eq!(kinds(&weight(5, "lhs")), vec!["exact_repeat"]);
    let mut stepped = weight(4, "rhs");
    stepped.extend(across(1, 0.0, 1.0, 4.0, &[0.5, 1.0, 2.0]).into_iter().map(|mut r| {
        r.compile = 4;
        r.role = "rhs".into();
        r
    }));
    assert_eq!(kinds(&stepped), vec!["exact_repeat"]);
}

#[test]
fn mean_row_energy_is_over_the_runs_whose_rows_line_up_in_either_load() {
    // One site in a prefill compile ([1,4,2]: row i is token i), a compile of batch 2 with the
    // same sequence length ([2,4,2]: rows 0..3 are the same tokens of sequence 0, rows 4..7 of
    // sequence 1) and a decode compile ([1,1,2]: row 0 is the new token). Per-row means over the
    // first two: rows 0..3 (1+3+5)/3 .. (4+6+8)/3 = 3, 4, 5, 6; rows 4..7 the batch-2 run's 9.
    // The decode runs' energy (100) must not enter row 0.
    let run = |compile: u32, step: u64, shape: &str, energy: &[f32]| {
        let mut r = run_rows("mm", "lhs", shape, step, &[("count", 2.0 * energy.len() as f32)], &[("pos_sumsq", energy)]);
        r.iter_mut().for_each(|x| x.compile = compile);
        r
    };
    let prefill = [run(1, 0, "[1,4,2]", &[1.0, 2.0, 3.0, 4.0]), run(1, 1, "[1,4,2]", &[3.0, 4.0, 5.0, 6.0])].concat();
    let batch2 = run(3, 0, "[2,4,2]", &[5.0, 6.0, 7.0, 8.0, 9.0, 9.0, 9.0, 9.0]);
    let decode: Vec<Row> = (0..3).flat_map(|step| run(2, step, "[1,1,2]", &[100.0])).collect();
    let want = vec![3.0, 4.0, 5.0, 6.0, 9.0, 9.0, 9.0, 9.0];
    let key = ("mm".to_string(), "lhs".to_string(), 0);
    let dir = tempfile::tempdir().unwrap();
    // Prefill rows first in the file, and decode rows first (the series' shape is its first
    // run's in (compile, step) order either way).
    for (name, rows) in [("prefill_first", [prefill.clone(), decode.clone(), batch2.clone()].concat()), ("decode_first", [decode.clone(), batch2.clone(), prefill.clone()].concat())] {
        let full = series_from_rows(&rows);
        assert_eq!(full[&key].mean_row_energy(), Some(want.clone()), "{name}: full load");
        assert_eq!(full[&key].runs_of_other_rows(), 3, "{name}");
        let path = dir.path().join(format!("{name}.csv"));
        let mut sink = opscope::recording::open(&path).unwrap();
        // One flush a run, as the recorder writes them.
        for chunk in rows.chunk_by(|a, b| (a.compile, a.step) == (b.compile, b.step)) {
            sink.write(chunk).unwrap();
            sink.flush().unwrap();
        }
        sink.finish().unwrap();
        let compact = opscope::mine::load_compact(&path).unwrap();
        assert_eq!(compact[&key].shape, "[1,4,2]", "{name}");
        assert_eq!(compact[&key].mean_row_energy(), Some(want.clone()), "{name}: compact load");
    }
    // A series of decode runs only has their rows.
    assert_eq!(series_from_rows(&decode)[&key].mean_row_energy(), Some(vec![100.0]));
    // Rank 2: a flattened [4,2] and a [1,2] (or [8,2]) cannot be told from a change of batch;
    // only equal shapes line up.
    use opscope::mine::row_layout;
    assert_eq!(row_layout(&[2, 4, 2]), row_layout(&[1, 4, 2]));
    assert_ne!(row_layout(&[1, 1, 2]), row_layout(&[1, 4, 2]));
    assert_ne!(row_layout(&[4, 2]), row_layout(&[8, 2]));
    assert_ne!(row_layout(&[4, 2]), row_layout(&[1, 4, 2]));
}
