//! Static W8A8 on an ONNX encoder, end to end in process: record the matmul activations of a
//! calibration text, calibrate them into a table (as `opscope calibrate` does), and measure the
//! sentence embeddings under `staticquant{table=..}` against fp32 (as `opscope measure --also`
//! does). `lab/tests/staticquant_ort.rs` puts the result beside ONNX Runtime's own
//! `quantize_static` and `quantize_dynamic` (`scripts/ort_static_reference.py`).

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::model::Job;
use opscope::activate::Stage;
use opscope::mine::{calibrate_all, series_from_rows, CalibrationOptions};
use opscope::{MemorySink, Pipeline};

/// The tap a calibration recording needs: `min` and `max` of every matmul operand, padding
/// positions included, as ONNX Runtime's calibrators see whole tensors (`padding=exclude`, the
/// tap's default, would calibrate on real tokens only).
pub const CALIBRATION_TAP: &str = "matmul{roles=[lhs,rhs],stats=[min,max],padding=include}";

/// Record `job`'s sentences with [`CALIBRATION_TAP`] (the deployed program), calibrate every
/// tensor with `options`, and write the table JSON (`opscope calibrate`'s format) to `out`,
/// through a temporary name renamed into place. Returns the number of tensors calibrated.
///
/// Errors: a run or the recording fails; a tensor cannot be calibrated (named); writing fails.
pub fn calibration_table(job: &Job, options: &CalibrationOptions, out: &Path) -> Result<usize> {
    let sink = MemorySink::default();
    job.run(&Pipeline::parse(CALIBRATION_TAP)?, Stage::Deployed, Box::new(sink.clone()), |_, _| Ok(()))?;
    let table = calibrate_all(&series_from_rows(&sink.rows()), options);
    if let Some((name, e)) = table.failed.first() {
        bail!("{} tensor(s) cannot be calibrated, first {name}: {e}", table.failed.len());
    }
    if table.tensors.is_empty() {
        bail!("the calibration recording holds no matmul operand");
    }
    let json = serde_json::to_vec(&opscope::mine::calibrate::ort_json(&table.tensors, options))?;
    let tmp = out.with_extension("json.partial");
    std::fs::write(&tmp, json).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, out).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    Ok(table.tensors.len())
}

/// Sentence embeddings (`[sentences][hidden]`, the model's last output) of `job` under
/// `pipeline` at the deployed stage; a tap-only pipeline gives the fp32 embeddings (taps leave
/// outputs bit-identical).
///
/// Errors: the pipeline does not parse or a run fails.
pub fn embeddings(job: &Job, pipeline: &str) -> Result<Vec<Vec<f32>>> {
    let p = Pipeline::parse(pipeline).with_context(|| format!("pipeline {pipeline}"))?;
    Ok(crate::measure::embed(job, &p)?.0)
}

/// (mean cosine, worst cosine, SQNR in dB) of `got` against `want`, one embedding per sentence:
/// `opscope measure`'s W8A8 columns.
pub fn versus(want: &[Vec<f32>], got: &[Vec<f32>]) -> (f64, f64, f64) {
    crate::measure::compare(want, got)
}
