//! Registered passes, one file each. Each file ends with `inventory::submit!`; nothing outside
//! this folder names a concrete pass.

mod attn;
mod fakequant;
mod matmul;
mod residual;
mod route;
mod skip;
