//! Models whose inputs come from a file: `opscope record --onnx M --inputs FILE.npz`. Every
//! input the model declares is an array of the `.npz` (numpy's format, read with `npyz`); batch
//! `i` is each array's index `i` along `--axis`. Symbolic dims of the model's inputs are bound
//! from the arrays' shapes; each input is fed in the dtype the model declares.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use npyz::{DType as NpyDType, TypeChar};
use rlx_ir::DType;
use rlx_onnx_import::{build_hir_from_onnx_file, prepare_onnx_file, ImportOptions};
use rlx_runtime::Session;

/// One model input: its name, declared dtype, and its bytes per batch.
struct Feed {
    name: String,
    dtype: DType,
    batches: Vec<Vec<u8>>,
}

/// A model imported for the per-batch shapes of an `.npz`, and the batches to feed it.
pub struct NpzJob {
    graph: rlx_ir::Graph,
    params: HashMap<String, Vec<f32>>,
    feeds: Vec<Feed>,
    batches: usize,
}

/// An array of the archive as f64 values (exact for every integer below 2^53 and every float).
fn values(arr: npyz::NpyFile<impl std::io::Read>, name: &str) -> Result<Vec<f64>> {
    let NpyDType::Plain(ts) = arr.dtype() else { bail!("array '{name}' is not a plain numeric array") };
    let v = match (ts.type_char(), ts.size_field()) {
        (TypeChar::Int, 8) => arr.into_vec::<i64>()?.into_iter().map(|x| x as f64).collect(),
        (TypeChar::Int, 4) => arr.into_vec::<i32>()?.into_iter().map(f64::from).collect(),
        (TypeChar::Uint, 1) | (TypeChar::Bool, 1) => arr.into_vec::<u8>()?.into_iter().map(f64::from).collect(),
        (TypeChar::Float, 4) => arr.into_vec::<f32>()?.into_iter().map(f64::from).collect(),
        (TypeChar::Float, 8) => arr.into_vec::<f64>()?,
        _ => bail!("array '{name}' has numpy dtype {ts}; opscope reads int32, int64, uint8/bool, float32 and float64"),
    };
    Ok(v)
}

/// Encode `v` in `dtype` (little-endian), for input `name` of a model (`--inputs` arrays and
/// the text job's ids and masks alike). Errors on a value the dtype cannot hold exactly, or a
/// dtype opscope does not feed.
pub(crate) fn encode(v: &[f64], dtype: DType, name: &str) -> Result<Vec<u8>> {
    let int = |x: f64| if x.fract() == 0.0 { Ok(x) } else { Err(anyhow::anyhow!("input '{name}' is {dtype:?} and the array holds {x}")) };
    Ok(match dtype {
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::F64 => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        DType::I64 => v.iter().map(|&x| int(x).map(|x| (x as i64).to_le_bytes())).collect::<Result<Vec<_>>>()?.concat(),
        DType::I32 => v
            .iter()
            .map(|&x| {
                let x = int(x)?;
                i32::try_from(x as i64).map(|x| x.to_le_bytes()).with_context(|| format!("input '{name}': {x} does not fit int32"))
            })
            .collect::<Result<Vec<_>>>()?
            .concat(),
        other => bail!("input '{name}' is {other:?}: opscope feeds int32, int64, float32 and float64 inputs"),
    })
}

impl NpzJob {
    /// Import `onnx` for the batches of `npz` taken along `axis`.
    ///
    /// Errors: the archive is unreadable; an input the model declares is missing from it (the
    /// error lists both); arrays disagree on the number of batches or on a symbolic dim; a
    /// static dim differs from the array's; a value does not fit the declared dtype.
    pub fn load(onnx: &Path, npz: &Path, axis: usize) -> Result<NpzJob> {
        if !onnx.is_file() {
            bail!("{}: no such ONNX file", onnx.display());
        }
        let (manifest, ..) = prepare_onnx_file(onnx).map_err(|e| anyhow::anyhow!("{e:#}")).with_context(|| format!("reading {}", onnx.display()))?;
        let mut archive = npyz::npz::NpzArchive::open(npz).with_context(|| format!("{}: not a readable .npz archive", npz.display()))?;
        let names: Vec<String> = archive.array_names().map(str::to_string).collect();
        let mut named: HashMap<String, usize> = HashMap::new();
        let mut raw: Vec<(String, Vec<usize>, Vec<f64>)> = Vec::new();
        for input in &manifest.inputs {
            let arr = archive
                .by_name(&input.name)?
                .with_context(|| {
                    format!(
                        "{}: the model's input '{}' is not in {} (the model declares [{}]; the file holds [{}])",
                        onnx.display(),
                        input.name,
                        npz.display(),
                        manifest.inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", "),
                        names.join(", ")
                    )
                })?;
            let shape: Vec<usize> = arr.shape().iter().map(|&d| d as usize).collect();
            if axis >= shape.len() {
                bail!("array '{}' has shape {shape:?}: no axis {axis} to take batches along", input.name);
            }
            let per: Vec<usize> = shape.iter().enumerate().filter(|(i, _)| *i != axis).map(|(_, &d)| d).collect();
            if per.len() != input.meta.shape.len() {
                bail!("input '{}' has rank {}, the array's batches have shape {per:?}", input.name, input.meta.shape.len());
            }
            for (d, (want, got)) in input.meta.shape.iter().zip(&per).enumerate() {
                match want {
                    serde_json::Value::Number(n) if n.as_u64() != Some(*got as u64) => {
                        bail!("input '{}' dim {d} is {n}, the array's batches have {got}", input.name)
                    }
                    serde_json::Value::String(sym) => {
                        if let Some(prev) = named.insert(sym.clone(), *got) {
                            if prev != *got {
                                bail!("dim '{sym}' is {prev} in one input and {got} in '{}'", input.name);
                            }
                        }
                    }
                    _ => {}
                }
            }
            let v = values(arr, &input.name)?;
            raw.push((input.name.clone(), shape, v));
        }
        let batches = raw.first().map(|r| r.1[axis]).unwrap_or(0);
        if let Some(r) = raw.iter().find(|r| r.1[axis] != batches) {
            bail!("array '{}' holds {} batches along axis {axis}, others {batches}", r.0, r.1[axis]);
        }
        let seq = named.iter().find(|(k, _)| k.contains("seq")).map(|(_, &v)| v).unwrap_or(1);
        let opts = ImportOptions { sequence_length: seq, named_lengths: named.clone(), ..Default::default() };
        let (hir, params, _report, _m) = build_hir_from_onnx_file(onnx, opts).map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("importing {}", onnx.display()))?;
        let mut graph = hir.lower_to_mir().map_err(|e| anyhow::anyhow!("{e:?}"))?.into_graph();
        graph.name = onnx.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
        let mut feeds = Vec::new();
        for (name, shape, v) in raw {
            let Some(id) = graph.input_id(&name) else { continue }; // an input the model never reads
            let dtype = graph.node(id).shape.dtype();
            let numel = opscope::sketch::static_dims(&graph.node(id).shape).map(|d| d.iter().product::<usize>());
            if numel != Some(v.len() / batches.max(1)) {
                bail!("input '{name}' holds {numel:?} values per run, the array's batches {}", v.len() / batches.max(1));
            }
            // Batch i: index i along `axis`, the other axes in order.
            let outer: usize = shape[..axis].iter().product();
            let inner: usize = shape[axis + 1..].iter().product();
            let per_batch = (0..batches)
                .map(|i| {
                    let vals: Vec<f64> = (0..outer).flat_map(|o| v[(o * batches + i) * inner..(o * batches + i + 1) * inner].to_vec()).collect();
                    encode(&vals, dtype, &name)
                })
                .collect::<Result<Vec<_>>>()?;
            feeds.push(Feed { name, dtype, batches: per_batch });
        }
        Ok(NpzJob { graph, params, feeds, batches })
    }

    /// The imported graph (what a tap sees).
    pub fn graph(&self) -> &rlx_ir::Graph {
        &self.graph
    }

    /// Batches in the archive.
    pub fn batches(&self) -> usize {
        self.batches
    }

    /// Run every batch with `pipeline` active at `stage`, recording to `sink`.
    ///
    /// Errors: a run or the recording failed.
    pub fn run(&self, pipeline: &opscope::Pipeline, stage: opscope::Stage, sink: Box<dyn opscope::Sink>) -> Result<opscope::activate::Summary> {
        let session = Session::new(rlx_runtime::Device::Cpu);
        crate::model::STOPPED_EARLY.store(false, std::sync::atomic::Ordering::SeqCst);
        let scope = opscope::Scope::new(pipeline, sink).stage(stage).interrupt_flag(&crate::model::STOPPED_EARLY);
        let (_, recorded) = scope.run(|| {
            let mut c = session.compile_with(self.graph.clone(), &crate::model::compile_options());
            for (name, data) in &self.params {
                c.set_param(name, data);
            }
            for i in 0..self.batches {
                if crate::model::stop_before_next() {
                    break;
                }
                let inputs: Vec<(&str, &[u8], DType)> = self.feeds.iter().map(|f| (f.name.as_str(), f.batches[i].as_slice(), f.dtype)).collect();
                c.run_typed(&inputs);
            }
        });
        recorded.context("recording")
    }
}
