//! Reading the calibration table `opscope calibrate` writes (`src/mine/calibrate.rs`,
//! `ort_json`): ONNX Runtime's `calibration.json` layout plus an `"opscope"` object holding, per
//! tensor `site/role`, the site, role, scale, zero point and code type this pass uses.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{closest, Error};

/// One tensor's static quantizer: ONNX QuantizeLinear / DequantizeLinear parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Qdq {
    /// Real value of one code step (units of the tensor), > 0 and finite.
    pub scale: f32,
    /// The code of 0.0, within `[qlo, qhi]`.
    pub zero_point: i32,
    /// Smallest code: -128 (int8) or 0 (uint8), QuantizeLinear's saturation bound.
    pub qlo: i32,
    /// Largest code: 127 (int8) or 255 (uint8).
    pub qhi: i32,
}

impl Qdq {
    /// `int8` or `uint8`.
    pub fn dtype(&self) -> &'static str {
        if self.qlo < 0 {
            "int8"
        } else {
            "uint8"
        }
    }
}

#[derive(Deserialize)]
struct File {
    opscope: Option<Section>,
}

#[derive(Deserialize)]
struct Section {
    method: String,
    tensors: BTreeMap<String, Entry>,
}

#[derive(Deserialize)]
struct Entry {
    site: String,
    role: String,
    scale: f64,
    zero_point: i64,
    dtype: String,
}

/// A calibration table, indexed by (site, role).
#[derive(Debug, Clone)]
pub struct StaticTable {
    /// The file it was read from.
    pub path: PathBuf,
    /// The calibration method that gave the ranges (`minmax`, `percentile`, `entropy`).
    pub method: String,
    by_site: BTreeMap<(String, String), Qdq>,
}

impl StaticTable {
    /// Read and check a table.
    ///
    /// Errors ([`Error::Table`], each naming the file and the fix): unreadable; not JSON or
    /// not written by `opscope calibrate` (no `"opscope"` object with `tensors`, e.g. an ONNX
    /// Runtime table or a TensorRT cache); an entry whose scale is not finite and positive, whose
    /// code type is not `int8`/`uint8` or whose zero point is outside that type.
    pub fn load(path: &Path) -> Result<StaticTable, Error> {
        let err = |why: String| Error::Table { path: path.to_path_buf(), why };
        let bytes = std::fs::read(path).map_err(|e| err(format!("{e}: give the JSON file `opscope calibrate RECORDING --out table.json` wrote")))?;
        let file: File = serde_json::from_slice(&bytes).map_err(|e| {
            err(format!("not a calibration table of `opscope calibrate` ({e}); write one with `opscope calibrate RECORDING --out table.json`"))
        })?;
        let Some(sec) = file.opscope else {
            return Err(err(
                "no \"opscope\" object: a table of ONNX Runtime's own keys tensors by ONNX tensor name, not by site; \
                 write one with `opscope calibrate RECORDING --out table.json`"
                    .into(),
            ));
        };
        let mut by_site = BTreeMap::new();
        for (name, e) in sec.tensors {
            let (qlo, qhi) = match e.dtype.as_str() {
                "uint8" => (0, 255),
                "int8" => (-128, 127),
                d => return Err(err(format!("tensor '{name}': code type '{d}' is not int8 or uint8"))),
            };
            let scale = e.scale as f32;
            if !(scale.is_finite() && scale > 0.0) {
                return Err(err(format!("tensor '{name}': scale {} is not a finite positive number", e.scale)));
            }
            if e.zero_point < qlo as i64 || e.zero_point > qhi as i64 {
                return Err(err(format!("tensor '{name}': zero point {} is outside {} [{qlo}, {qhi}]", e.zero_point, e.dtype)));
            }
            // Two passes that tapped one (site, role) give two entries (`/pass<k>`): the first.
            by_site.entry((e.site, e.role)).or_insert(Qdq { scale, zero_point: e.zero_point as i32, qlo, qhi });
        }
        Ok(StaticTable { path: path.to_path_buf(), method: sec.method, by_site })
    }

    /// The quantizer of `site`'s `role`.
    ///
    /// Errors: [`Error::Table`] naming the site, the closest sites the table holds and the fix.
    pub fn lookup(&self, site: &str, role: &str) -> Result<Qdq, Error> {
        if let Some(q) = self.by_site.get(&(site.to_string(), role.to_string())) {
            return Ok(*q);
        }
        let held: Vec<String> = self.by_site.keys().filter(|k| k.1 == role).map(|k| k.0.clone()).collect();
        let near: Vec<&str> = closest(site, held.iter().map(|s| s.as_str())).into_iter().take(3).collect();
        Err(Error::Table {
            path: self.path.clone(),
            why: format!(
                "no entry for site '{site}' role {role} ({} {role} entries; closest: {}): calibrate a recording of this model made \
                 with matmul{{stats=[min,max]}} at the same stage, or leave the site out with staticquant{{sites=[..]}}",
                held.len(),
                if near.is_empty() { "none".to_string() } else { near.join(", ") }
            ),
        })
    }

    /// The quantizer of one tensor that several sites read (a merged Q/K/V projection's `x`):
    /// the first site's entry; each site must have one.
    ///
    /// Errors: as [`StaticTable::lookup`].
    pub fn lookup_shared(&self, sites: &[String], role: &str) -> Result<Qdq, Error> {
        let all: Vec<Qdq> = sites.iter().map(|s| self.lookup(s, role)).collect::<Result<_, _>>()?;
        Ok(all[0])
    }
}
