//! Pipeline text: parse, canonical print, round trip, and errors that say which, where, and
//! what is known.

use opscope::pass::registered;
use opscope::Pipeline;
use proptest::prelude::*;

#[test]
fn every_registered_default_parses() {
    for p in registered() {
        for o in p.options() {
            // default_value panics on an invalid default; parse it through the grammar too.
            let _ = o.default_value();
            let text = format!("{}{{{}={}}}", p.name(), o.name, o.default);
            Pipeline::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }
}

#[test]
fn canonical_text_round_trips() {
    let cases = [
        ("matmul", "matmul"),
        ("  matmul { hist_bins = 16 } ", "matmul{hist_bins=16}"),
        // options print in declaration order, lists keep their order
        ("matmul{hist_bins=16,sites=attention.*},matmul", "matmul{sites=[attention.*],hist_bins=16},matmul"),
        ("matmul{roles=[out, lhs],stats=[min,hist],hist_range=-1.5:2}", "matmul{roles=[out,lhs],stats=[min,hist],hist_range=-1.5:2}"),
        ("matmul{hist_range=0:1e-45}", "matmul{hist_range=0:1e-45}"),
        ("matmul{}", "matmul"),
        ("matmul{sites=[]}", "matmul{sites=[]}"),
    ];
    for (input, canonical) in cases {
        let p = Pipeline::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
        assert_eq!(p.to_string(), canonical, "print of {input}");
        let again = Pipeline::parse(canonical).unwrap();
        assert_eq!(again, p, "parse(print(p)) == p for {input}");
        assert_eq!(again.to_string(), canonical);
    }
}

fn err(text: &str) -> opscope::pipeline::ParseError {
    Pipeline::parse(text).expect_err(text)
}

#[test]
fn unknown_pass_lists_known_closest_first() {
    let e = err("matmu{hist_bins=3}");
    assert_eq!(e.offset, 0);
    assert!(e.message.contains("unknown pass 'matmu'"), "{e}");
    assert_eq!(e.known.first().map(String::as_str), Some("matmul"));
    let shown = e.to_string();
    assert!(shown.contains("known passes (closest first): matmul"), "{shown}");
    assert!(shown.contains("\n  ^"), "caret under column 1: {shown}");
    // Case does not hide the match.
    assert_eq!(err("MATMUL").known.first().map(String::as_str), Some("matmul"));
}

#[test]
fn naming_count_in_stats_is_accepted_and_selects_nothing_more() {
    // `count` is recorded with every tensor sketch; listing it is not an error.
    assert!(Pipeline::parse("matmul{stats=[count]}").is_ok());
    assert_eq!(Pipeline::parse("matmul{stats=[count,max]}").unwrap().to_string(), "matmul{stats=[count,max]}");
}

#[test]
fn unknown_option_names_the_pass_and_closest_option() {
    let e = err("matmul{hist_bin=16}");
    assert_eq!(e.offset, 7);
    assert!(e.message.contains("unknown option 'hist_bin' of pass 'matmul'"), "{e}");
    assert_eq!(e.known[0], "hist_bins");
}

#[test]
fn bad_values_say_what_was_expected() {
    for (text, needle, offset) in [
        ("matmul{hist_bins=0}", "expected integer 1..=65536", 17),
        ("matmul{hist_bins=lots}", "expected integer", 17),
        ("matmul{roles=[lhs,middle]}", "'middle' is not one of", 13),
        ("matmul{stats=[kurtosys]}", "not one of [kurtosis", 13),
        ("matmul{hist_range=3:1}", "LO < HI", 18),
        ("matmul{hist_range=nan:1}", "LO < HI", 18),
        ("matmul{hist_bins=[1,2]}", "a list is not allowed", 17),
        ("matmul{hist_bins=4,hist_bins=5}", "set twice", 19),
        ("matmul{hist_bins 4}", "expected '='", 17),
        ("matmul{hist_bins=4", "expected ',' or '}'", 18),
        ("matmul,", "expected a pass name", 7),
        ("matmul;attn", "expected ',' or the end", 6),
        ("", "empty pipeline", 0),
        ("matmul{sites=[a[b]}", "expected ',' or ']'", 15),
        ("matmul{roles=[lhs,lhs]}", "'lhs' is listed twice", 13),
        ("matmul{roles=[]}", "an empty list selects nothing: list at least one of [lhs,rhs,out]", 13),
        ("matmul{stats=[]}", "an empty list selects nothing: list at least one of [", 13),
        ("capture{roles=[]}", "an empty list selects nothing", 14),
        ("matmul{sités=[x]}", "unknown option 'sités'", 7),
        ("matmul,skip{blocks=[1]}", "actuation 'skip' comes after tap 'matmul': put actuations first", 7),
        ("skip{blocks=[1,x]}", "'x': expected list of distinct integers", 12),
        ("skip{blocks=[2,2]}", "'2' is listed twice", 12),
        ("fakequant{clip=2}", "'2': expected number 0.01..=1", 15),
        ("fakequant{clip=nan}", "expected number", 15),
        ("attn{topk=0}", "expected integer 1..=", 10),
        ("residual{mask=yes}", "expected one of auto|none", 14),
    ] {
        let e = err(text);
        assert!(e.message.contains(needle), "{text}: {e}");
        assert_eq!(e.offset, offset, "{text}: {e}");
    }
}

proptest! {
    /// Float and integer-list values print back to text that parses to the same pipeline.
    #[test]
    fn actuation_options_round_trip(
        blocks in proptest::sample::subsequence((0u64..12).collect::<Vec<_>>(), 0..=6),
        clip in 1u32..=100,
        bits in 2u64..=8,
    ) {
        let text = format!(
            "skip{{blocks=[{}]}},fakequant{{bits={bits},clip={}}},residual",
            blocks.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(","),
            clip as f32 / 100.0
        );
        let p = Pipeline::parse(&text).unwrap();
        let printed = p.to_string();
        prop_assert_eq!(Pipeline::parse(&printed).unwrap(), p);
        prop_assert_eq!(printed, text);
    }

    /// Any pipeline built from valid option values prints to text that parses back to it.
    #[test]
    fn printed_pipelines_parse_back(
        bins in proptest::option::of(1u64..5000),
        sig in proptest::option::of(1u64..100),
        roles in proptest::sample::subsequence(vec!["lhs", "rhs", "out"], 0..=3),
        stats in proptest::sample::subsequence(vec!["min", "max", "hist", "kurtosis", "pos_sumsq"], 0..=5),
        range in proptest::option::of((-100i32..100, 1i32..100)),
        repeat in 1usize..3,
    ) {
        let mut opts = Vec::new();
        if !roles.is_empty() { opts.push(format!("roles=[{}]", roles.join(","))); }
        if !stats.is_empty() { opts.push(format!("stats=[{}]", stats.join(","))); }
        if let Some(b) = bins { opts.push(format!("hist_bins={b}")); }
        if let Some((lo, w)) = range { opts.push(format!("hist_range={}:{}", lo as f32 / 4.0, (lo + w) as f32 / 4.0)); }
        if let Some(s) = sig { opts.push(format!("elemsig={s}")); }
        let one = if opts.is_empty() { "matmul".to_string() } else { format!("matmul{{{}}}", opts.join(",")) };
        let text = vec![one; repeat].join(",");
        let p = Pipeline::parse(&text).unwrap();
        let printed = p.to_string();
        prop_assert_eq!(Pipeline::parse(&printed).unwrap(), p);
        prop_assert_eq!(printed, text);
    }
}

#[test]
fn site_patterns_match_whole_names_and_slash_suffixes() {
    let p = opscope::pass::SitePatterns(vec![glob::Pattern::new("layer.0/*/query/*").unwrap()]);
    assert!(p.matches("model/encoder/layer.0/attention/self/query/MatMul"));
    assert!(p.matches("layer.0/attention/self/query/MatMul"));
    assert!(!p.matches("model/encoder/layer.1/attention/self/query/MatMul"));
    assert!(!p.matches("xlayer.0/a/query/MatMul"), "suffixes start after a '/'");
}
