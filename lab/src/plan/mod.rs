//! `opscope plan`: one option per matmul site (fp32, int8, int4, low rank, ... given as pipeline
//! templates) chosen to minimise the measured end-to-end error of the sentence embeddings under a
//! budget of weight bytes, solved exactly as a multiple-choice knapsack ([`mckp`]).
//!
//! **The error minimised** is the embedding noise-to-signal power ratio against fp32,
//! `NSR = sum (e - e_q)^2 / sum e^2` over every embedding value of the corpus, i.e. `1 / SQNR`
//! in linear units (`SQNR_dB = -10 log10 NSR`, what `opscope measure` reports). Noise powers of
//! uncorrelated errors add, so the sum of per-site NSRs predicts the NSR of a plan that changes
//! several sites when their errors are independent and small (the additive-noise model of
//! quantization error; Widrow & Kollar, *Quantization Noise*, 2008, ch. 4); the error of one
//! option at one site is measured end to end with only that site changed, and `opscope measure
//! --plan` measures the chosen plan jointly beside that prediction. Cosine similarity is not
//! additive in this way, which is why it is reported, not minimised.
//!
//! **Bytes** are those of the site's weight `W[K, N]` (the matmul's parameter rhs):
//! - fp32 (the implicit baseline option, error 0): `4 K N`;
//! - a `fakequant` option with `weights=true` and `bits=b`: `ceil(b K N / 8)` codes plus one f32
//!   scale per output channel, `4 N` (per-output-channel symmetric scales, as `fakequant` computes
//!   them); `weights=false` keeps the weight in f32: `4 K N`;
//! - a `lowrank` option with `rank=r`: two f32 factors, `4 r (K + N)`;
//! - any other option: `--bytes-per-elem NAME=X` gives `ceil(X K N)`.

pub mod mckp;

use std::collections::BTreeMap;

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::measure::{compare, embed};
use crate::model::Job;
use opscope::activate::Stage;
use opscope::Pipeline;

/// The placeholder a template's site name goes into.
pub const PLACEHOLDER: &str = "{site}";

/// The name of the implicit baseline option.
pub const FP32: &str = "fp32";

/// One option given on the command line: `NAME=TEMPLATE`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptionSpec {
    /// Its name (`int8`).
    pub name: String,
    /// A pipeline with `{site}` where the site's full name goes
    /// (`fakequant{sites=[{site}],scope=token,weights=true}`).
    pub template: String,
    /// Bytes per weight element when the tool cannot size the option itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_elem: Option<f64>,
}

impl OptionSpec {
    /// Parse `NAME=TEMPLATE`.
    ///
    /// Errors: no `=`, an empty or reserved name (`fp32`), a template without `{site}`.
    pub fn parse(text: &str) -> Result<OptionSpec> {
        let (name, template) = text.split_once('=').with_context(|| format!("--option '{text}': write NAME=PIPELINE_TEMPLATE, e.g. int8=fakequant{{sites=[{{site}}],weights=true}}"))?;
        let name = name.trim();
        ensure!(!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'), "--option '{text}': the name must be letters, digits, '_' or '-'");
        ensure!(name != FP32, "--option '{text}': '{FP32}' is the implicit baseline (the site unchanged, error 0); pick another name");
        ensure!(template.contains(PLACEHOLDER), "--option '{text}': the template has no {PLACEHOLDER} placeholder, so it would change every site at once");
        Ok(OptionSpec { name: name.to_string(), template: template.trim().to_string(), bytes_per_elem: None })
    }

    /// The pipeline text for `site` (its full name).
    pub fn pipeline_for(&self, site: &str) -> String {
        self.template.replace(PLACEHOLDER, site)
    }
}

/// A matmul site with a parameter weight `W[K, N]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightSite {
    /// Full site name (as the `matmul` tap and `fakequant{sites=..}` name it).
    pub site: String,
    /// K: the weight's reduction dimension (its second-to-last axis; leading axes folded in).
    pub k: u64,
    /// N: output channels (the weight's last axis).
    pub n: u64,
}

/// The matmul sites of the deployed program whose rhs is a parameter weight, in execution order,
/// those whose full or short name matches one of `globs` (all when empty). They are the sites a
/// dry run of `fakequant{weights=true}` changes (it skips a matmul whose rhs is an activation),
/// named as actuation passes name them: RLX's horizontally merged Q/K/V projection is ONE site
/// there, `<query>+<key>+<value>`, whose weight is the three weights side by side (K equal, N
/// summed), sized from the `matmul` tap's rhs shapes of the three logical sites.
///
/// Errors: a rewrite fails; a glob is malformed; a weight shape is symbolic or its parts
/// disagree on K; no site matches.
pub fn weight_sites(graph: &rlx_ir::Graph, globs: &[String]) -> Result<Vec<WeightSite>> {
    let options = rlx_runtime::CompileOptions::default();
    let tap = Pipeline::parse("matmul{roles=[rhs],stats=[min]}")?;
    let (_, m) = opscope::activate::rewrite(&tap, graph, Stage::Deployed, &options, 0)?;
    let mut dims: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for o in m.outputs.iter().filter(|o| o.invariant) {
        let d: Vec<u64> = o
            .shape
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .map(|d| d.trim().parse::<u64>())
            .collect::<std::result::Result<_, _>>()
            .with_context(|| format!("weight shape {} is not static", o.shape))?;
        ensure!(d.len() >= 2, "weight shape {} has rank < 2", o.shape);
        for u in o.uses.iter().filter(|u| u.role == opscope::Role::RHS) {
            dims.insert(u.site.clone(), (d[..d.len() - 1].iter().product(), d[d.len() - 1]));
        }
    }
    let fq = Pipeline::parse("fakequant{weights=true}")?;
    let (_, m) = opscope::activate::rewrite(&fq, graph, Stage::Deployed, &options, 0)?;
    let patterns = globs.iter().map(|g| glob::Pattern::new(g).with_context(|| format!("--sites '{g}'"))).collect::<Result<Vec<_>>>()?;
    let mut out: Vec<WeightSite> = Vec::new();
    for a in &m.actuations {
        if out.iter().any(|w| w.site == a.site) {
            continue;
        }
        let parts: Vec<&str> = a.site.split('+').collect();
        let matches = patterns.is_empty() || patterns.iter().any(|p| p.matches(&a.site) || parts.iter().any(|s| p.matches(s) || p.matches(short(s))));
        if !matches {
            continue;
        }
        let (mut k, mut n) = (None, 0u64);
        for part in &parts {
            let &(pk, pn) = dims.get(*part).with_context(|| format!("site {part}: the matmul tap found no parameter weight there"))?;
            ensure!(k.is_none_or(|k| k == pk), "site {}: its parts have different K", a.site);
            k = Some(pk);
            n += pn;
        }
        out.push(WeightSite { site: a.site.clone(), k: k.unwrap_or(0), n });
    }
    ensure!(!out.is_empty(), "no matmul site with a parameter weight matches --sites {globs:?} (`opscope sites` lists them)");
    Ok(out)
}

/// `layer.0/attention/...` from a full ONNX node path (the name `opscope sites` prints first).
fn short(site: &str) -> &str {
    site.find("layer.").map(|i| &site[i..]).unwrap_or(site)
}

/// [`short`] of every part of a merged site, joined with '+'.
fn short_all(site: &str) -> String {
    site.split('+').map(short).collect::<Vec<_>>().join("+")
}

/// Weight bytes of `option` at `site` (see the module doc for the rules).
///
/// Errors: the template does not parse; the option cannot be sized and has no `bytes_per_elem`.
pub fn option_bytes(option: &OptionSpec, site: &WeightSite) -> Result<u64> {
    let kn = site.k * site.n;
    if let Some(x) = option.bytes_per_elem {
        ensure!(x.is_finite() && x > 0.0, "--bytes-per-elem {}={x}: give a positive number", option.name);
        return Ok((x * kn as f64).ceil() as u64);
    }
    let p = Pipeline::parse(&option.pipeline_for(&site.site)).with_context(|| format!("--option {}", option.name))?;
    for inst in &p.passes {
        match inst.pass.name() {
            "fakequant" => {
                let weights = matches!(inst.options.value("weights")?, opscope::pass::OptionValue::Bool(true));
                let opscope::pass::OptionValue::UInt(bits) = *inst.options.value("bits")? else { bail!("fakequant bits is not an integer") };
                return Ok(if weights { (bits * kn).div_ceil(8) + 4 * site.n } else { 4 * kn });
            }
            "lowrank" => {
                if let Ok(opscope::pass::OptionValue::UInt(r)) = inst.options.value("rank") {
                    return Ok(4 * r * (site.k + site.n));
                }
            }
            _ => {}
        }
    }
    bail!(
        "option '{}' ({}) changes no weight format the tool can size: give --bytes-per-elem {}=X (bytes per weight element, e.g. 1.0 for int8)",
        option.name,
        option.template,
        option.name
    )
}

/// Noise-to-signal power ratio of `got` against `want`: `sum (w - g)^2 / sum w^2` (1/SQNR, linear).
pub fn nsr(want: &[Vec<f32>], got: &[Vec<f32>]) -> f64 {
    let (mut s, mut n) = (0f64, 0f64);
    for (a, b) in want.iter().zip(got) {
        for (&x, &y) in a.iter().zip(b) {
            s += (x as f64).powi(2);
            n += (x as f64 - y as f64).powi(2);
        }
    }
    n / s
}

/// One measured option at one site.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// Option name (`fp32` first).
    pub option: String,
    /// Weight bytes of the site under this option.
    pub bytes: u64,
    /// Embedding NSR against fp32 with only this site changed (0 for fp32).
    pub nsr: f64,
}

/// One site of the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SitePlan {
    /// The site and its weight dims.
    #[serde(flatten)]
    pub weight: WeightSite,
    /// Every option measured, `fp32` first.
    pub cells: Vec<Cell>,
    /// The option chosen.
    pub chosen: String,
}

/// What `opscope plan` writes and `opscope measure --plan` reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// What the error column is.
    pub metric: String,
    /// Sentences the errors were measured on.
    pub sentences: usize,
    /// The options offered (besides fp32).
    pub options: Vec<OptionSpec>,
    /// The budget, bytes of weights over the planned sites.
    pub budget_bytes: u64,
    /// Their bytes in fp32.
    pub fp32_bytes: u64,
    /// The chosen plan's bytes (<= budget).
    pub plan_bytes: u64,
    /// Sum over sites of the chosen options' NSRs: the plan's predicted NSR.
    pub predicted_nsr: f64,
    /// The chosen plan as one pipeline (empty when every site stays fp32).
    pub pipeline: String,
    /// Per site, in execution order.
    pub sites: Vec<SitePlan>,
}

/// The metric's description stored in a plan.
pub const METRIC: &str = "nsr = sum (e - e_fp32)^2 / sum e_fp32^2 over every sentence-embedding value (1/SQNR, linear); errors add for independent noise";

impl Plan {
    /// The MCKP instance of the table: per site, (bytes, nsr) per option.
    pub fn instance(&self) -> Vec<Vec<mckp::Choice>> {
        self.sites.iter().map(|s| s.cells.iter().map(|c| mckp::Choice { cost: c.bytes, error: c.nsr }).collect()).collect()
    }

    /// Solve the table under `budget` and fill in the choice, bytes, prediction and pipeline.
    ///
    /// Errors: no plan fits (the smallest achievable byte count named).
    pub fn choose(&mut self, budget: u64) -> Result<()> {
        let sol = mckp::solve(&self.instance(), budget).map_err(|e| anyhow::anyhow!("{e}"))?;
        self.budget_bytes = budget;
        self.plan_bytes = sol.cost;
        self.predicted_nsr = sol.error;
        let mut parts = Vec::new();
        for (s, &pick) in self.sites.iter_mut().zip(&sol.picks) {
            s.chosen = s.cells[pick].option.clone();
            if let Some(o) = self.options.iter().find(|o| o.name == s.chosen) {
                parts.push(o.pipeline_for(&s.weight.site));
            }
        }
        self.pipeline = parts.join(",");
        Ok(())
    }

    /// Read a plan written by `opscope plan`.
    ///
    /// Errors: unreadable, not a plan, or a chosen option that is not in the table.
    pub fn load(path: &std::path::Path) -> Result<Plan> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let plan: Plan = serde_json::from_str(&text).with_context(|| format!("{} is not a plan written by `opscope plan`", path.display()))?;
        for s in &plan.sites {
            ensure!(s.cells.iter().any(|c| c.option == s.chosen), "{}: site {} chose '{}', which its table lacks", path.display(), s.weight.site, s.chosen);
        }
        Ok(plan)
    }
}

/// Check that every manifest of a run of `pipeline` changed `site`; an option that changes
/// nothing there would enter the table as a free, lossless choice.
fn check_actuated(manifests: &[opscope::Manifest], site: &str, what: &str) -> Result<()> {
    ensure!(!manifests.is_empty(), "{what}: no graph was compiled");
    for m in manifests {
        if !m.actuations.iter().any(|a| a.site == site) {
            let why: Vec<String> = m.skipped.iter().filter(|s| s.site == site).map(|s| s.reason.clone()).collect();
            let changed: Vec<&str> = m.actuations.iter().map(|a| a.site.as_str()).collect();
            bail!(
                "{what} did not change site {site} in graph '{}'{}; it changed: [{}]",
                m.graph,
                if why.is_empty() { String::new() } else { format!(": {}", why.join("; ")) },
                changed.join(", ")
            );
        }
    }
    Ok(())
}

/// Measure the table: for each site and option, the embedding NSR with only that site changed
/// (one pass of the corpus each), and the bytes. `progress(done, total, what)` is told each run.
///
/// Errors: a template does not parse or does not change its site; an option cannot be sized;
/// a run fails.
pub fn measure_table(
    job: &Job,
    sites: &[WeightSite],
    options: &[OptionSpec],
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<Plan> {
    let total = 1 + sites.len() * options.len();
    progress(0, total, "fp32");
    let (fp32, _, _) = embed(job, &Pipeline::default())?;
    let mut out = Vec::new();
    let mut done = 1;
    for w in sites {
        let mut cells = vec![Cell { option: FP32.into(), bytes: 4 * w.k * w.n, nsr: 0.0 }];
        for o in options {
            let text = o.pipeline_for(&w.site);
            progress(done, total, &format!("{} at {}", o.name, short_all(&w.site)));
            let p = Pipeline::parse(&text).with_context(|| format!("--option {} at {}", o.name, w.site))?;
            let bytes = option_bytes(o, w)?;
            let (q, _, manifests) = embed(job, &p)?;
            check_actuated(&manifests, &w.site, &format!("--option {}", o.name))?;
            cells.push(Cell { option: o.name.clone(), bytes, nsr: nsr(&fp32, &q) });
            done += 1;
        }
        out.push(SitePlan { weight: w.clone(), cells, chosen: FP32.into() });
    }
    let fp32_bytes = sites.iter().map(|w| 4 * w.k * w.n).sum();
    Ok(Plan {
        metric: METRIC.into(),
        sentences: fp32.len(),
        options: options.to_vec(),
        budget_bytes: fp32_bytes,
        fp32_bytes,
        plan_bytes: fp32_bytes,
        predicted_nsr: 0.0,
        pipeline: String::new(),
        sites: out,
    })
}

/// The chosen plan measured jointly against fp32.
#[derive(Debug, Clone, Serialize)]
pub struct Applied {
    /// The pipeline run.
    pub pipeline: String,
    /// Sentences.
    pub sentences: usize,
    /// Mean cos(embedding, fp32 embedding) over sentences.
    pub cos_mean: f64,
    /// Worst sentence's cosine.
    pub cos_min: f64,
    /// SQNR of the embeddings, dB.
    pub sqnr_db: f64,
    /// Measured NSR of the whole plan (`10^(-sqnr_db/10)`).
    pub joint_nsr: f64,
    /// The plan's prediction: the sum of the chosen per-site NSRs.
    pub predicted_nsr: f64,
    /// Weight bytes of the plan and of fp32 over the planned sites.
    pub plan_bytes: u64,
    /// fp32 bytes of the planned sites.
    pub fp32_bytes: u64,
}

/// Run `plan`'s pipeline over `job`'s corpus and compare with fp32.
///
/// Errors: the pipeline does not parse or does not change a site the plan changes; a run fails.
pub fn apply(job: &Job, plan: &Plan) -> Result<Applied> {
    let (fp32, _, _) = embed(job, &Pipeline::default())?;
    let (q, manifests) = if plan.pipeline.trim().is_empty() {
        (fp32.clone(), Vec::new())
    } else {
        let p = Pipeline::parse(&plan.pipeline).context("the plan's pipeline")?;
        let (q, _, m) = embed(job, &p)?;
        (q, m)
    };
    for s in plan.sites.iter().filter(|s| s.chosen != FP32) {
        check_actuated(&manifests, &s.weight.site, "the plan's pipeline")?;
    }
    let (cos_mean, cos_min, sqnr_db) = compare(&fp32, &q);
    Ok(Applied {
        pipeline: plan.pipeline.clone(),
        sentences: fp32.len(),
        cos_mean,
        cos_min,
        sqnr_db,
        joint_nsr: nsr(&fp32, &q),
        predicted_nsr: plan.predicted_nsr,
        plan_bytes: plan.plan_bytes,
        fp32_bytes: plan.fp32_bytes,
    })
}

impl Plan {
    /// The table and the choice as Markdown.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "{} sites, {} sentences; budget {} B of {} B fp32 ({:.1}%); plan {} B ({:.1}%); predicted NSR {:.3e} (SQNR {:.1} dB)\n\n",
            self.sites.len(),
            self.sentences,
            self.budget_bytes,
            self.fp32_bytes,
            100.0 * self.budget_bytes as f64 / self.fp32_bytes as f64,
            self.plan_bytes,
            100.0 * self.plan_bytes as f64 / self.fp32_bytes as f64,
            self.predicted_nsr,
            -10.0 * self.predicted_nsr.log10(),
        );
        let names: Vec<String> = self.sites.first().map(|f| f.cells.iter().map(|c| c.option.clone()).collect()).unwrap_or_default();
        s.push_str(&format!("| site | K x N | {} | chosen |\n|---|---|{}---|\n", names.iter().map(|n| format!("{n} B / NSR")).collect::<Vec<_>>().join(" | "), "---|".repeat(names.len())));
        for site in &self.sites {
            let cells: Vec<String> = site.cells.iter().map(|c| format!("{} / {:.2e}", c.bytes, c.nsr)).collect();
            s.push_str(&format!("| {} | {}x{} | {} | {} |\n", short_all(&site.weight.site), site.weight.k, site.weight.n, cells.join(" | "), site.chosen));
        }
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for site in &self.sites {
            *counts.entry(&site.chosen).or_default() += 1;
        }
        s.push_str(&format!("\nchosen: {}\n", counts.iter().map(|(k, v)| format!("{k} x{v}")).collect::<Vec<_>>().join(", ")));
        s
    }
}

impl Applied {
    /// The joint measurement beside the prediction, as text.
    pub fn markdown(&self) -> String {
        format!(
            "plan applied to {} sentences: mean cos {:.6}, worst cos {:.5}, SQNR {:.2} dB\n\
             joint NSR {:.4e} measured vs {:.4e} predicted (sum of per-site NSRs): ratio {:.3}\n\
             weights {} B of {} B fp32 ({:.1}%)\n",
            self.sentences,
            self.cos_mean,
            self.cos_min,
            self.sqnr_db,
            self.joint_nsr,
            self.predicted_nsr,
            self.joint_nsr / self.predicted_nsr,
            self.plan_bytes,
            self.fp32_bytes,
            100.0 * self.plan_bytes as f64 / self.fp32_bytes as f64
        )
    }
}
