//! The manifest: what every appended output of a tapped graph is, in typed form.
//!
//! Strings for sites and roles appear here because they are names; statistics stay typed
//! ([`Stat`]) until a sink writes them.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::sketch::{SketchSpec, Slot};

/// The role a tensor plays at a site (the `role` column): a name a pass declares as a
/// `const` next to its statistics (`Role::new("lhs")`), so the core knows no concrete role.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Role(Cow<'static, str>);

impl Role {
    /// A role named `name`.
    pub const fn new(name: &'static str) -> Role {
        Role(Cow::Borrowed(name))
    }

    /// Left operand of a binary op (the activation `x` of `x @ W`).
    pub const LHS: Role = Role::new("lhs");
    /// Right operand (the weight `W` of `x @ W`, or the second activation of a batched matmul
    /// such as attention scores `Q @ K^T`).
    pub const RHS: Role = Role::new("rhs");
    /// The op's output.
    pub const OUT: Role = Role::new("out");

    /// Name used in the `role` column.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An op site found by a pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Site {
    /// Site name: the node's own name (ONNX node name, leading '/' removed) or `{op}.{k}`.
    pub site: String,
    /// Op name as RLX prints it (`matmul`, `dequant_matmul`, ...).
    pub op: String,
    /// Node id in the graph the pass saw.
    pub node: u32,
    /// Floating-point operations of one execution (2 x batch x M x K x N for a matmul), or
    /// `None` when a dim is symbolic.
    pub flops: Option<u64>,
    /// Pass that found the site.
    pub pass: String,
    /// Position of that pass in the pipeline (0-based).
    pub pass_idx: usize,
}

/// One use of an appended sketch output: the same tensor tapped at several sites with the same
/// spec (the shared input of Q, K and V projections) is computed once and listed once per use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TapUse {
    /// Pass that asked for it.
    pub pass: String,
    /// Position of that pass in the pipeline (0-based): two passes may sketch one tensor
    /// differently, and rows are told apart by it.
    pub pass_idx: usize,
    /// Site name.
    pub site: String,
    /// Role of the tensor there.
    pub role: Role,
}

/// One appended output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TapOutput {
    /// Index of this output among the graph's outputs (after the caller's own); `None` for a
    /// zero-size tensor, which gets no node and is recorded as `count = 0` on every run.
    pub output_index: Option<usize>,
    /// Node id of the tapped tensor.
    pub tensor: u32,
    /// Shape of the tapped tensor (`[2,16,384]`).
    pub shape: String,
    /// Number of elements, `None` if the shape is symbolic (the recorded `count` plus the
    /// non-finite counts give it per run).
    pub numel: Option<u64>,
    /// Where it is used.
    pub uses: Vec<TapUse>,
    /// The tensor depends on parameters and constants only (a weight): its sketch is the same
    /// on every run, is recorded at step 0 only, and is computed once when RLX hoists
    /// param-invariant work (`cache_param_invariant`).
    pub invariant: bool,
    /// What is computed.
    pub spec: SketchSpec,
    /// Where each statistic sits in the output vector.
    pub layout: Vec<Slot>,
}

/// A site or role that could not be tapped, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// Site name.
    pub site: String,
    /// Role, if the problem is one operand's.
    pub role: Option<Role>,
    /// Shape of the tensor, if known.
    pub shape: Option<String>,
    /// The one statistic left out, when the sketch was taken without it (a statistic the
    /// lowered sketch cannot compute exactly); `None` when the whole site or role is skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stat: Option<String>,
    /// Why.
    pub reason: String,
    /// Position in the pipeline (0-based) of the pass that skipped it; `None` in manifests
    /// written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_idx: Option<usize>,
}

/// Everything a pipeline appended to one graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Graph name.
    pub graph: String,
    /// Canonical pipeline text.
    pub pipeline: String,
    /// Compile tag written into every sketch output (value 0): unique in the process.
    pub tag: u32,
    /// This compile's number in its recording, 1, 2, ... in compile order: the `compile`
    /// column (0 until a recorder registers the manifest).
    #[serde(default)]
    pub compile: u32,
    /// Number of the caller's own outputs (tap outputs follow them).
    pub user_outputs: usize,
    /// Sites found, in graph order.
    pub sites: Vec<Site>,
    /// Appended outputs, in output order.
    pub outputs: Vec<TapOutput>,
    /// Sites or roles that could not be tapped.
    pub skipped: Vec<Skipped>,
    /// Changes made on purpose by actuation passes, in pipeline order.
    #[serde(default)]
    pub actuations: Vec<Actuation>,
    /// The padding mask taps read to leave padding rows out, if any (which input, its shape
    /// and dtype).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding: Option<String>,
    /// Sampled recording (`sample{every=N}`): `N`, when the sketches of this compile are gated
    /// (computed and recorded on the runs whose inputs hash to 0 mod N, see
    /// [`crate::sketch::sample`]); `None` when every run is recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_every: Option<u64>,
    /// Whole tensors appended as extra outputs by a `capture` pass, after every sketch output
    /// (so value 0 of the first extra output is still a sketch's compile tag).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub captures: Vec<CaptureOutput>,
}

/// One whole tensor a `capture` pass appended as an extra graph output. The recorder writes it
/// as `.npy` on the runs the pass samples, within the pass's byte budget (see
/// [`crate::capture`]); it never becomes rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureOutput {
    /// Index of this output among the graph's outputs (after the caller's own and the sketches).
    pub output_index: usize,
    /// Node id of the tensor.
    pub tensor: u32,
    /// Site name.
    pub site: String,
    /// Role of the tensor there.
    pub role: Role,
    /// Static dims of the tensor.
    pub dims: Vec<usize>,
    /// The tensor depends on parameters and constants only (a weight): written once per compile.
    pub invariant: bool,
    /// Position of the capture pass in the pipeline.
    pub pass_idx: usize,
    /// Write the tensor on runs whose step is a multiple of this (1 = every run).
    pub every: u64,
    /// Byte budget of the capture pass (whole recording).
    pub budget: u64,
}

/// One change an actuation pass made to the program (fake-quant inserted, block bypassed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Actuation {
    /// Site name of the changed op.
    pub site: String,
    /// Node id of that op in the rewritten graph (`u32::MAX` if the change removed it).
    pub node: u32,
    /// Pass that made the change.
    pub pass: String,
    /// Position of that pass in the pipeline (0-based).
    pub pass_idx: usize,
    /// What was done, in words.
    pub action: String,
}

impl TapOutput {
    /// Values the sketch output holds: the compile tag plus every slot of the layout.
    pub fn len(&self) -> usize {
        1 + self.layout.iter().map(|s| s.len).sum::<usize>()
    }

    /// Never true: the tag is always there.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Manifest {
    /// Extra outputs the rewritten graph appends after the caller's: the sketch outputs that
    /// got a node, then the captured tensors.
    pub fn appended(&self) -> usize {
        self.outputs.iter().filter(|o| o.output_index.is_some()).count() + self.captures.len()
    }

    /// Look a site up by name: the first pass's entry when several passes found it (their
    /// entries agree on the op; see [`Manifest::site_of`] for a pass's own, with its FLOPs).
    pub fn site(&self, name: &str) -> Option<&Site> {
        self.sites.iter().find(|s| s.site == name)
    }

    /// The entry the pass at `pass_idx` made for site `name`, else (a pass that taps a site it
    /// did not list) the first entry of that name. A site's FLOPs come from the pass that
    /// counts them (`matmul` does, `capture` does not): taking the first entry by name gave
    /// a `capture,matmul` pipeline's matmul rows no FLOPs, and every mining payoff was 0.
    pub fn site_of(&self, name: &str, pass_idx: usize) -> Option<&Site> {
        self.sites.iter().find(|s| s.site == name && s.pass_idx == pass_idx).or_else(|| self.site(name))
    }
}
