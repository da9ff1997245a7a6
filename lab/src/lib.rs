//! The opscope lab: what the `opscope` CLI runs on top of the plugin. A real ONNX encoder over
//! real text ([`model`]), the measurements that use the actuation passes ([`measure`]), the
//! comparison of two recordings ([`diff`]), the cost and roofline of the deployed graph ([`cost`]), the planted-structure sweep that is the miner's ground truth ([`sweep`]), the HTML report
//! ([`report`]), node-by-node parity of a compiled program ([`parity`]), interleaved A/B timing ([`timing`]), per-site time shares ([`shares`]) and the per-site summary a recording prints ([`summary`]). A program that only
//! wants the tap links `opscope` and none of this (no tokenizer, ONNX importer or plotter).

#![warn(missing_docs)]

pub mod compare;
pub mod cost;
pub mod diff;
pub mod llama;
pub mod measure;
pub mod memo;
pub mod model;
pub mod npz;
pub mod output;
pub mod parity;
pub mod plan;
pub mod probe;
pub mod report;
pub mod shares;
pub mod staticq;
pub mod summary;
pub mod sweep;
pub mod timing;
pub mod verdicts;
